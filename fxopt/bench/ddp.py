"""Data-parallel training through fxopt: ``torch.compile(DistributedDataParallel(model), backend="fxopt")``.

Launched with one process per device::

    torchrun --standalone --nproc-per-node 2 -m fxopt.bench.ddp --device cuda --model resnet50 --batch 64
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m fxopt.bench.ddp --device cpu \\
        --model seedcnn2 --batch 8 --amp none --iters 3 --warmup 1      # gloo on the CPU

Every process trains with the reference loop (``fxopt.testing.training.TrainLoop``) on its own
seeded batches (per rank), from the same initial weights:

1. ``--single`` (default on): each process trains the model alone (no DDP) on its device, all at
   once: the one-device step time and throughput per backend.
2. per backend, ``DistributedDataParallel(model)`` (gradients all-reduced in buckets of
   ``--bucket-cap-mb``), compiled by the backend (eager: not compiled). Dynamo's DDPOptimizer
   splits the model's graph at the bucket boundaries (so that each bucket's all-reduce can start
   while the backward of the pieces before it runs); every piece is compiled by the backend, which
   fxopt's reports show (one forward and one backward graph per piece).

   Every model is compiled and warmed up first; the timed steps are then spread over ``--rounds``
   rounds in which, per backend, the one-device model and the DDP model take turns, every process
   starting each turn together (a barrier): both are timed under the same conditions (no process
   compiling meanwhile, the host and the GPUs as warm), so their ratio, the scaling, does not
   carry the drift between two phases of the run.
3. checks: the replicas' parameters are identical on every rank after the last step (the
   gradients were all-reduced: a backward whose gradients DDP missed would let them drift apart);
   each compiled backend's losses (every rank's first ``--losses``) and its parameters after the
   last step against eager DDP's, within the tolerance of the precision or the rounding spread where
   larger: the largest distance from eager DDP of ``--rounding-references`` runs of eager DDP whose
   gradients are perturbed by one rounding of the precision at every step (one seed each, the same
   on every rank) and of ``eager-channels-last`` where it ran (other cuDNN kernels and rounding);
   training amplifies rounding at every optimizer step, so a correct backend lands anywhere inside
   that spread. The trained parameters and BatchNorm's running statistics (which a training step
   does not read; their relative distances come out ten times the parameters') are bounded
   apart, each by its own spread. fxopt compiled every piece without falling back.
4. the time of one all-reduce of a buffer the size of the gradients, alone (the communication floor);
   on CUDA with ``--profile-steps N``, N DDP steps under torch.profiler: compute kernel time, NCCL
   kernel time and host time per step.

Rank 0 writes results.json and results.md to ``--out``: per backend the step time, images/s per
device and in all, the scaling over one device (all devices' images/s / one device's), the loss
and parameter differences, and fxopt's graphs. The exit status is 1 on a failed check.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

#: relative difference (max |p - p_eager| / max |p_eager|, over the trained parameters and apart over
#: the buffers) after the steps
PARAM_TOLERANCE = {"none": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}


def build_parser() -> argparse.ArgumentParser:
    from .train_peers import TRAIN_BACKENDS

    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m fxopt.bench.ddp",
                                description="DistributedDataParallel training through each backend vs eager DDP.")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cuda if available (NCCL), else cpu (gloo)")
    p.add_argument("--model", default="resnet50", help="a fxopt.bench model (default resnet50)")
    p.add_argument("--batch", type=int, default=64, help="batch per process (default 64)")
    p.add_argument("--amp", choices=["float16", "bfloat16", "none"],
                   help="default float16 on cuda, none on cpu; none on cuda also turns TF32 off (float32 throughout)")
    p.add_argument("--backends", default="eager,eager-channels-last,fxopt",
                   help=f"comma list (eager always; known: {','.join(TRAIN_BACKENDS)})")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50, help="timed steps (of each model)")
    p.add_argument("--rounds", type=int, help="spread the timed steps over this many rounds in which the one-device "
                   "and the DDP model of each backend take turns (default 5 on cuda, 1 on cpu)")
    p.add_argument("--rewarm", type=int, default=2, help="untimed steps before each turn (rounds > 1)")
    p.add_argument("--losses", type=int, default=20, help="losses compared with eager DDP's")
    p.add_argument("--rounding-references", type=int, default=4, metavar="K",
                   help="K untimed runs of eager DDP with every gradient perturbed by one rounding of the precision "
                        "(one seed each): their largest distance from eager DDP (losses, parameters) bounds every "
                        "backend's (default 4)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (DDP's default 25)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="DDP steps under torch.profiler on cuda (default 0: a profiler session after other CUDA "
                        "graphs were captured and destroyed crashed the process once, see README)")
    p.add_argument("--trace", action="store_true",
                   help="rank 0 writes the profiled DDP steps' timeline per backend (trace_BACKEND.json in --out; "
                        "2 profiled steps unless --profile-steps says otherwise)")
    p.add_argument("--phases", type=int, default=20, metavar="N",
                   help="after the timed rounds, N more steps of every model with a phase timer "
                        "(fxopt.bench.phases: host and GPU time of forward, backward and optimizer, the GPU's lag "
                        "behind the host; DDP's own runtime statistics); 0: none (default 20)")
    p.add_argument("--ddp-options", default=None, metavar="JSON",
                   help='more DistributedDataParallel arguments, e.g. {"gradient_as_bucket_view": true}')
    p.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each process training alone (the one-device baseline)")
    p.add_argument("--image-size", type=int, help="input height/width of the ImageNet models (default 224)")
    p.add_argument("--data-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--fxopt-options", default=None, metavar="JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-min", type=float, default=60.0, help="collective timeout (compiles happen between)")
    p.add_argument("--out", default="bench_ddp_out")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    import torch

    from . import models as M
    from .train_peers import TRAIN_BACKENDS

    p = build_parser()
    a = p.parse_args(list(argv) if argv is not None else None)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.amp = a.amp or ("float16" if a.device == "cuda" else "none")
    if a.model not in M.MODELS:
        p.error(f"unknown model {a.model!r}; known: {', '.join(M.MODELS)}")
    a.backends = ["eager"] + [b.strip() for b in a.backends.split(",") if b.strip() and b.strip() != "eager"]
    bad = [b for b in a.backends if b not in TRAIN_BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; known: {', '.join(TRAIN_BACKENDS)}")
    a.rounds = a.rounds or (5 if a.device == "cuda" else 1)
    if a.batch < 2 or min(a.iters, a.rounds) < 1 or min(a.warmup, a.rewarm, a.losses, a.profile_steps, a.phases,
                                                          a.rounding_references) < 0:
        p.error("--batch >= 2, --iters and --rounds >= 1, --warmup, --rewarm, --losses, --profile-steps and "
                "--rounding-references >= 0")
    a.fxopt_options = json.loads(a.fxopt_options) if a.fxopt_options else {}
    a.ddp_options = json.loads(a.ddp_options) if a.ddp_options else {}
    if a.trace and not a.profile_steps:
        a.profile_steps = 2  # a timeline needs profiled steps
    a.final_steps = 0
    return a


def _prepare(t, a) -> None:
    """First step (timed: compile) and warm-up; a failure marks the cell."""
    from .trainee import _guarded

    errors: List[str] = []
    _guarded(t, t.first_step, errors, "first step")
    _guarded(t, lambda: t.steps(a.warmup), errors, "warm-up")
    if errors:
        print(errors[0], file=sys.stderr)


def _timed_rounds(pairs: List[tuple], a) -> None:
    """The timed steps: ``a.rounds`` rounds, in each of which every model of ``pairs`` (per backend:
    the one-device model or None, the DDP model) runs ``iters / rounds`` timed steps after
    ``a.rewarm`` untimed ones, all processes starting each turn together. A model whose steps
    failed sits out; every process skips it alike (its DDP steps are collectives)."""
    per_round = -(-a.iters // a.rounds)
    for _ in range(a.rounds):
        for t in _runnable(pairs):
            def go(t=t):
                if a.rounds > 1:
                    t.steps(a.rewarm)
                t.timed(per_round)
            _run_guarded(t, go, "timed steps")


def _runnable(pairs: List[tuple]):
    """The models of ``pairs`` in order whose steps have not failed on any rank (a collective per
    model: every process skips a failed one alike, its DDP steps being collectives)."""
    import torch.distributed as dist

    for pair in pairs:
        for t in pair:
            if t is None:
                continue
            ok = [None] * dist.get_world_size()
            dist.all_gather_object(ok, t.cell["status"] == "ok")
            if all(ok):
                yield t


def _run_guarded(t, fn, what: str) -> None:
    """``fn`` as one phase of ``t`` (a failure marks its cell, printed once)."""
    from .trainee import _guarded

    errors: List[str] = []
    _guarded(t, fn, errors, what)
    if errors:
        print(errors[0], file=sys.stderr)


#: DDP's runtime statistics of its last step (``DistributedDataParallel._get_ddp_logging_data``, ns) kept, as ms
_DDP_STATS = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
              "backward_compute_comm_overlap_time")


def _phases(pairs: List[tuple], a) -> None:
    """``a.phases`` steps of every model under a phase timer, all processes together; per cell
    ``phases`` (``fxopt.bench.phases``) and for a DDP model ``ddp_stats``, DDP's own times of the
    last of those steps (its reducer times every step while the sample rate is 1)."""
    from fxopt.testing.training import run_steps

    from .phases import time_phases

    for t in _runnable(pairs):
        ddp = t.module if hasattr(t.module, "_set_ddp_runtime_logging_sample_rate") else None

        def go(t=t, ddp=ddp):
            if ddp is not None:
                ddp._set_ddp_runtime_logging_sample_rate(1)

            def steps(n):
                t.losses += run_steps(t.loop, t.batches, n, start=len(t.losses), seed=t.seed)

            t.cell["phases"] = time_phases(t.loop, steps, a.phases, t.device == "cuda")
            if ddp is not None:
                data = ddp._get_ddp_logging_data()
                t.cell["ddp_stats"] = {k + "_ms": data[k] / 1e6 for k in _DDP_STATS if data.get(k)}

        _run_guarded(t, go, "phases")


def _cell(t, a, world: int) -> Dict[str, Any]:
    from .measure import stats
    from .trainee import _graph_summary

    cell = dict(t.cell)
    cell["losses"] = [float(x) for x in t.losses]
    if t.samples and cell["status"] == "ok":
        st = stats(t.samples)
        cell.update(median_ms=st["median"], iqr_ms=st["iqr"], n=st["n"])
        cell["images_per_s_per_device"] = a.batch / (st["median"] / 1e3)
        cell["images_per_s"] = cell["images_per_s_per_device"] * world
    if t.reports:
        cell["fxopt"] = _graph_summary(t.reports)
    return cell


def _param_rel_diff(model, reference) -> dict:
    """max |p - p_ref| / max |p_ref| over the parameters and floating-point buffers (BatchNorm's
    running statistics): ``all``, and apart (what the checks bound), ``parameters`` (what the
    optimizer trains) and ``buffers`` (statistics, which training-mode steps do not read)."""
    import torch

    def worst(ts, refs):
        num = den = 0.0
        with torch.no_grad():
            for p, q in zip(ts, refs):
                num = max(num, (p.float() - q.float()).abs().max().item())
                den = max(den, q.float().abs().max().item())
        return num, den

    def floats(ts):
        return [t for t in ts if t.is_floating_point()]

    pn, pd = worst(floats(model.parameters()), floats(reference.parameters()))
    bn, bd = worst(floats(model.buffers()), floats(reference.buffers()))
    num, den = max(pn, bn), max(pd, bd)
    return {"all": num / den if den else num, "parameters": pn / pd if pd else pn,
            "buffers": bn / bd if bd else bn}


def _distances(t, eager, a) -> Dict[str, float]:
    """``t``'s distance from eager DDP on this rank: its first ``a.losses`` losses and its parameters
    after the same number of steps (``param_rel_diff``: all, and apart)."""
    from fxopt.testing.training import max_rel_diff

    mine, ref = [float(x) for x in t.losses], [float(x) for x in eager.losses]
    n = min(a.losses, len(mine), len(ref))
    diffs = _param_rel_diff(t.model, eager.model)
    return {"losses_max_rel_diff": max_rel_diff(mine[:n], ref[:n]), "param_rel_diff": diffs["all"],
            "param_rel_diff_parameters": diffs["parameters"], "param_rel_diff_buffers": diffs["buffers"]}


def _replica_diff(model) -> float:
    """max |p - p_rank0| over the parameters (a collective: every rank calls it). Data parallelism
    keeps the replicas bitwise equal: the same start, the same all-reduced gradients, the same
    optimizer step. BatchNorm's running statistics are left out: each rank updates them from its
    own batch after the last broadcast."""
    import torch
    import torch.distributed as dist

    worst = 0.0
    with torch.no_grad():
        for p in model.parameters():
            ref = p.detach().clone()
            dist.broadcast(ref, 0)
            worst = max(worst, (p.detach().float() - ref.float()).abs().max().item())
    return worst


def _allreduce_ms(model, device: str, iters: int = 20) -> float:
    """Median time of one all-reduce of a float32 buffer with as many elements as the model's
    parameters (the gradients' bytes in one collective; a collective on every rank)."""
    import torch
    import torch.distributed as dist

    from .measure import time_calls

    buf = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)
    for _ in range(3):
        dist.all_reduce(buf)
    return statistics.median(time_calls(lambda _: dist.all_reduce(buf), None, torch.device(device).type, iters))


def run(a: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """This process's part; returns the results on rank 0 (None elsewhere)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fxopt.testing.training import AMP_DTYPES, LOSS_TOLERANCE, UNIT_ROUNDOFF, make_batches

    from . import _device_info, _versions
    from .train import _build
    from .trainee import Trainee, _guarded, step_profile

    local = int(os.environ.get("LOCAL_RANK", 0))
    if a.device == "cuda":
        torch.cuda.set_device(local)
        torch.backends.cudnn.benchmark = True
        if a.amp == "none":  # float32 means float32: losses then compare at its tolerance
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
    device = f"cuda:{local}" if a.device == "cuda" else "cpu"
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=a.timeout_min),
                            **({"device_id": torch.device(device)} if a.device == "cuda" else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        base, shape, classes = _build(a.model, a)
        batches = make_batches(a.data_batches, a.batch, shape, classes, device, seed=a.seed + 1000 * rank)
        torch._dynamo.reset()
        singles: Dict[str, Any] = {}
        if a.single:
            for be in a.backends:
                singles[be] = Trainee(be, base, batches, device, a.amp, a.lr, a.fxopt_options,
                                      seed=a.seed + 1000 * rank)
                _prepare(singles[be], a)
        dist.barrier()
        comm_ms = _allreduce_ms(base, device)
        bucket = {"bucket_cap_mb": a.bucket_cap_mb, **({"device_ids": [local]} if a.device == "cuda" else {}),
                  **a.ddp_options}
        trainees = {}
        for be in a.backends:
            t = Trainee(be, base, batches, device, a.amp, a.lr, a.fxopt_options,
                        wrap_model=lambda m: DDP(m, **bucket), seed=a.seed + 1000 * rank)
            _prepare(t, a)
            if a.device == "cuda" and a.profile_steps and t.cell["status"] == "ok":
                trace = os.path.join(a.out, f"trace_{be}.json") if a.trace and rank == 0 else None
                if trace:
                    os.makedirs(a.out, exist_ok=True)
                _guarded(t, lambda: t.cell.update(step_profile(t, a.profile_steps, trace)), [], "profile")
            trainees[be] = t
            dist.barrier()
        _timed_rounds([(singles.get(be), trainees[be]) for be in a.backends], a)
        if a.phases:
            _phases([(singles.get(be), trainees[be]) for be in a.backends], a)
        single = {be: _cell(t, a, 1) for be, t in singles.items()}
        for t in trainees.values():
            t.cell["replica_diff"] = _replica_diff(t.model)
        eager = trainees["eager"]
        ddp: Dict[str, Any] = {}
        for be, t in trainees.items():
            cell = _cell(t, a, world)
            if be != "eager" and cell["status"] == "ok" and eager.cell["status"] == "ok":
                cell.update(_distances(t, eager, a))
            ddp[be] = cell
        if eager.cell["status"] == "ok" and a.rounding_references:
            eps = UNIT_ROUNDOFF[AMP_DTYPES[a.amp]]
            refs = []
            for k in range(1, a.rounding_references + 1):  # untimed, as many steps as eager DDP took
                t = Trainee("eager", base, batches, device, a.amp, a.lr, wrap_model=lambda m: DDP(m, **bucket),
                            seed=a.seed + 1000 * rank, grad_noise=(eps, a.seed + k))
                _guarded(t, lambda: t.steps(len(eager.losses)), [], f"rounding reference {k}")
                refs.append({"grad_noise": eps, "noise_seed": a.seed + k, "status": t.cell["status"],
                             **(_distances(t, eager, a) if t.cell["status"] == "ok" else {})})
                del t
            ddp["eager"]["rounding_references"] = refs
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "device": device, "single": single, "ddp": ddp,
                                          "allreduce_ms": comm_ms})
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return None
    import torch._dynamo

    tol = LOSS_TOLERANCE[AMP_DTYPES[a.amp]]
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "torchrun --nproc-per-node {} -m fxopt.bench.ddp ".format(world) + " ".join(sys.argv[1:]),
            "kind": "ddp", "world_size": world, "backend_comm": "nccl" if a.device == "cuda" else "gloo",
            "device_type": a.device, **_device_info(a.device), "versions": _versions(),
            "dynamo_optimize_ddp": str(torch._dynamo.config.optimize_ddp),
            "config": {k: getattr(a, k) for k in ("model", "batch", "amp", "backends", "warmup", "iters", "rounds",
                                                   "rewarm", "losses",
                                                   "rounding_references", "bucket_cap_mb", "single", "image_size", "data_batches", "lr",
                                                   "seed", "fxopt_options", "profile_steps", "phases", "ddp_options")},
            "allreduce_ms": gathered[0]["allreduce_ms"],
            "gradient_mb": sum(p.numel() for p in base.parameters()) * 4 / 2**20,
            "loss_tolerance": tol, "param_tolerance": PARAM_TOLERANCE[a.amp]}
    return {"meta": meta, "ranks": gathered, "summary": _summarize(gathered, a, tol)}


def _summarize(ranks: List[Dict[str, Any]], a, tol: float) -> Dict[str, Any]:
    """Per backend: rank 0's step time, throughput, scaling and profile; the worst loss, parameter
    and replica difference over the ranks; fxopt's graphs; the checks."""
    out: Dict[str, Any] = {"backends": {}, "checks": []}
    for be in a.backends:
        cells = [r["ddp"][be] for r in ranks]
        c0, s0 = cells[0], ranks[0]["single"].get(be, {})
        row = {"status": "ok" if all(c["status"] == "ok" for c in cells) else
               next(f"{c['status']}: {c.get('error')}" for c in cells if c["status"] != "ok"),
               "ddp_step_ms": c0.get("median_ms"), "ddp_images_per_s_per_device": c0.get("images_per_s_per_device"),
               "ddp_images_per_s": c0.get("images_per_s"), "first_step_s": c0.get("first_step_s"),
               "single_step_ms": s0.get("median_ms"), "single_images_per_s": s0.get("images_per_s"),
               "replica_diff": max((c.get("replica_diff", float("inf")) for c in cells), default=None),
               "fxopt": c0.get("fxopt"), "phases_single": s0.get("phases"), "phases_ddp": c0.get("phases"),
               "ddp_stats": c0.get("ddp_stats"),
               **{k: c0[k] for k in ("gpu_kernel_ms", "comm_kernel_ms", "host_ms", "kernels_per_step") if k in c0}}
        if row["ddp_images_per_s"] and row["single_images_per_s"]:
            row["scaling"] = row["ddp_images_per_s"] / row["single_images_per_s"]
        if be != "eager":
            for key in ("losses_max_rel_diff", "param_rel_diff", "param_rel_diff_parameters", "param_rel_diff_buffers"):
                diffs = [c.get(key) for c in cells]
                row[key] = None if None in diffs else max(diffs)
        out["backends"][be] = row
    # the rounding spread: the largest distance from eager DDP of eager channels_last and of eager's
    # rounding references (over the ranks)
    refs = [out["backends"].get("eager-channels-last", {})]
    per_rank = [r["ddp"].get("eager", {}).get("rounding_references") or [] for r in ranks]
    for k, ref in enumerate(per_rank[0]):
        got = [rr[k] for rr in per_rank if len(rr) > k]
        ok = all(g["status"] == "ok" for g in got)
        row = {"status": "ok" if ok else "error", "noise_seed": ref["noise_seed"], "grad_noise": ref["grad_noise"]}
        for key in ("losses_max_rel_diff", "param_rel_diff", "param_rel_diff_parameters", "param_rel_diff_buffers"):
            row[key] = max(g.get(key) or 0.0 for g in got) if ok else None
        out.setdefault("rounding_references", []).append(row)
        if ok:
            refs.append(row)
    parts = ("param_rel_diff_parameters", "param_rel_diff_buffers")
    spread = {k: max(r.get(k) or 0.0 for r in refs) for k in ("losses_max_rel_diff",) + parts}
    out["tolerances"] = {"losses": max(tol, spread["losses_max_rel_diff"]),
                         "parameters": max(PARAM_TOLERANCE[a.amp], spread["param_rel_diff_parameters"]),
                         "buffers": max(PARAM_TOLERANCE[a.amp], spread["param_rel_diff_buffers"])}
    loss_tol = out["tolerances"]["losses"]
    for be, row in out["backends"].items():
        problems = []
        if row["status"] != "ok":
            if be == "eager-channels-last":
                continue  # a reference, not a compiler under test
            problems.append(row["status"])
        elif row["replica_diff"] != 0.0:
            problems.append(f"the replicas' parameters differ by {row['replica_diff']:.3g} (gradients not all-reduced)")
        if be not in ("eager", "eager-channels-last") and row["status"] == "ok":
            if row["losses_max_rel_diff"] is None or not row["losses_max_rel_diff"] <= loss_tol:
                problems.append(f"losses differ from eager DDP's by {row['losses_max_rel_diff']} > {loss_tol:g}")
            for part in ("parameters", "buffers"):  # trained parameters; BatchNorm's running statistics
                got, bound = row.get(f"param_rel_diff_{part}"), out["tolerances"][part]
                if got is not None and not got <= bound:
                    problems.append(f"{part} differ from eager DDP's by {got:.3g} > {bound:.3g}")
            if be.startswith("fxopt"):
                fx = [c.get("fxopt") for c in (r["ddp"][be] for r in ranks) if c.get("fxopt")]
                if not fx or any(f["fallbacks"] for f in fx):
                    problems.append("fxopt compiled no graph" if not fx else f"fxopt fell back: {fx[0]['fallbacks']}")
        out["checks"].append({"backend": be, "ok": not problems, "reason": "; ".join(problems) or None})
    return out


def render_markdown(results: Dict[str, Any]) -> str:
    from .train_report import _precision

    m, s = results["meta"], results["summary"]
    cfg = m["config"]

    def f(v, spec=".2f"):
        return "–" if v is None else format(v, spec)

    lines = [f"# fxopt data-parallel training: {cfg['model']} b{cfg['batch']} per device, {m['world_size']} "
             f"processes ({m['backend_comm']})", ""]
    if m["device_type"] == "cpu":
        lines += ["> **CPU run — not a GPU performance result.**", ""]
    lines += [f"- device: {m.get('device_name')} × {m['world_size']}, `{m['device_type']}`",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
              f"- date: {m['date']}", f"- command: `{m['command']}`",
              f"- loop: {_precision(cfg['amp'])}"
              + (" (TF32 off)" if cfg["amp"] == "none" and m["device_type"] == "cuda" else "")
              + f", Adam, cross-entropy; median of {cfg['iters']} steps after {cfg['warmup']} warm-up steps (rank 0)"
              + ("" if not cfg.get("single") else
                 f", in {cfg['rounds']} round(s) in which each backend's one-device and DDP models take turns"
                 if "rounds" in cfg else ", the one-device models timed first, then the DDP ones") + "; "
              f"DDP buckets of {cfg['bucket_cap_mb']} MB"
              + "".join(f", {k}={v}" for k, v in (cfg.get("ddp_options") or {}).items())
              + f"; Dynamo optimize_ddp={m['dynamo_optimize_ddp']}", "",
              f"- all-reduce of the gradients' {m.get('gradient_mb', 0):.1f} MB (float32) alone: "
              f"{f(m.get('allreduce_ms'), '.3f')} ms (median of 20)", "",
              "| backend | status | 1 device ms/step | 1 device img/s | DDP ms/step | DDP img/s per device | "
              "DDP img/s all | scaling | compute / NCCL kernels / host ms | first DDP step s | losses max rel diff | "
              "params rel diff | replicas differ by | fxopt graphs |",
              "|" + "---|" * 14]
    for be, r in s["backends"].items():
        fx = r.get("fxopt")
        graphs = (", ".join(f"{fx['graphs'].count(k)} {k}" for k in dict.fromkeys(fx["graphs"]))
                  + (f"; fallbacks: {fx['fallbacks']}" if fx["fallbacks"] else "")) if fx else "–"
        lines.append("| " + " | ".join([
            be, r["status"], f(r.get("single_step_ms"), ".3f"), f(r.get("single_images_per_s"), ".0f"),
            f(r.get("ddp_step_ms"), ".3f"), f(r.get("ddp_images_per_s_per_device"), ".0f"),
            f(r.get("ddp_images_per_s"), ".0f"), f(r.get("scaling")) + ("×" if r.get("scaling") else ""),
            " / ".join(f(r.get(k)) for k in ("gpu_kernel_ms", "comm_kernel_ms", "host_ms")),
            f(r.get("first_step_s")), f(r.get("losses_max_rel_diff"), ".2e"),
            f(r.get("param_rel_diff"), ".2e") + (f" ({f(r.get('param_rel_diff_parameters'), '.2e')} / "
                                                 f"{f(r.get('param_rel_diff_buffers'), '.2e')})"
                                                 if r.get("param_rel_diff_parameters") is not None else ""),
            f(r.get("replica_diff"), ".3g"), graphs]) + " |")
    lines += _phase_lines(s)
    checks = s["checks"]
    bad = [c for c in checks if not c["ok"]]
    lines += ["", f"scaling = DDP images/s on all {m['world_size']} devices / one device's images/s without DDP. "
              f"Tolerances: losses {s['tolerances']['losses']:.3g}, trained parameters {s['tolerances']['parameters']:.3g}, "
              f"BatchNorm buffers {s['tolerances'].get('buffers', s['tolerances']['parameters']):.3g} (the precision's "
              f"{m['loss_tolerance']:g} and {m['param_tolerance']:g}, or the rounding spread where larger: the largest "
              "distance from eager DDP of eager-channels-last and of eager DDP with every gradient perturbed by one "
              "rounding of the precision, per seed). params rel diff = over parameters and buffers together "
              "(trained parameters / buffers apart)."
              + "".join(f" Rounding reference {r['noise_seed']}: losses {f(r.get('losses_max_rel_diff'), '.3g')}, "
                        f"trained parameters {f(r.get('param_rel_diff_parameters'), '.3g')}, buffers "
                        f"{f(r.get('param_rel_diff_buffers'), '.3g')}." for r in s.get("rounding_references") or [])
              + "  compute / NCCL kernels / host = per DDP step under torch.profiler: the "
              "compute kernels' time, NCCL's kernels' time (overlapping the compute) and the host's time outside "
              "waits (an upper bound).", "",
              f"Checks: {len(checks) - len(bad)}/{len(checks)} passed."]
    lines += [f"- FAILED {c['backend']}: {c['reason']}" for c in bad]
    return "\n".join(lines) + "\n"


def _phase_lines(s: Dict[str, Any]) -> List[str]:
    """The phase table (rank 0's medians): per backend, one row for the one-device model and one for
    the DDP model."""
    from .phases import PHASES

    rows = []
    for be, r in s["backends"].items():
        for which in ("single", "ddp"):
            ph = r.get(f"phases_{which}")
            if not ph or not ph.get("steps"):
                continue
            cells = [" / ".join("–" if ph.get(p, {}).get(k) is None else f"{ph[p][k]:.2f}"
                                for k in ("host_ms", "gpu_ms", "lag_ms")) for p in PHASES]
            stats = r.get("ddp_stats") if which == "ddp" else None
            rows.append(f"| {be} | {'1 device' if which == 'single' else 'DDP'} | " + " | ".join(cells)
                        + f" | {ph.get('step_gpu_ms', ph.get('step_host_ms', 0)):.2f} | "
                        + (", ".join(f"{k[:-3].replace('_', ' ')} {v:.2f}" for k, v in stats.items()) if stats else "–")
                        + " |")
    if not rows:
        return []
    return ["", "Phases (rank 0, medians; host ms / GPU ms / GPU's lag behind the host at the phase's end, ms: "
            "near 0 = the GPU waited for the host there); `between` = from the optimizer's end to the next step:",
            "", "| backend | model | " + " | ".join(PHASES) + " | step ms | DDP's own times of its last step (ms) |",
            "|" + "---|" * (len(PHASES) + 4)] + rows


def write_results(results: Optional[dict], out: str, render) -> int:
    """Rank 0's results (None on the other ranks) as ``results.json`` and ``render``'s markdown in
    ``out``, the markdown printed; the exit status: 1 where a check failed."""
    if results is None:
        return 0
    from .report import write_json

    os.makedirs(out, exist_ok=True)
    write_json(results, os.path.join(out, "results.json"))
    text = render(results)
    with open(os.path.join(out, "results.md"), "w") as fh:
        fh.write(text)
    sys.stdout.write(text)
    return 0 if all(c["ok"] for c in results["summary"]["checks"]) else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    return write_results(run(a), a.out, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
