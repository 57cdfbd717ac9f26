"""Data-parallel training through fxopt against eager in one command: DDP with its default settings
and FSDP2 (``torch.distributed.fsdp.fully_shard``), each eager and compiled with ``backend="fxopt"``.

Launched with one process per device::

    torchrun --standalone --nproc-per-node 8 -m fxopt.bench.fsdp --device cuda --model resnet50 --batch 64
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m fxopt.bench.fsdp --device cpu \\
        --model seedcnn2 --batch 8 --amp none --warmup 1 --iters 3      # gloo on the CPU (a smoke run)

Every process trains from the same seeded weights on its own seeded batches (per rank), SGD with
momentum, cross-entropy:

- ``single``: eager, the model alone on each device (all at once): the one-device images/s that the
  scaling divides by;
- ``ddp``: ``DistributedDataParallel(model)`` (25 MB buckets, buffers broadcast), eager and
  ``torch.compile(DDP(model), backend="fxopt")`` (Dynamo's DDPOptimizer splits the graph at the
  buckets; fxopt compiles every piece); precision ``--amp``: ``torch.autocast``;
- ``fsdp``: ``fully_shard`` on every block (the outermost submodules with parameters whose
  ``forward`` is not ``torch.nn``'s: a ResNet's bottlenecks) and on the whole model, eager and then
  ``torch.compile(model, backend="fxopt")``; ``--amp`` here is FSDP2's
  ``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`` (no autocast; BatchNorm's running
  statistics are kept in that dtype too: FSDP2 casts parameters, not buffers, and BatchNorm asks
  for its weight and statistics in one dtype). FSDP2's hooks are
  ``torch._dynamo.disable``d: the graph breaks at every block, and Dynamo resumes in a block's
  ``forward`` only where it is user code (a ``torch.nn`` layer sharded alone would run eagerly;
  the checks look for every convolution in fxopt's graphs).

Per mode and backend: the first step's time (compile), the mean step time over ``--iters`` steps
after ``--warmup`` (all ranks start together), images/s per device and in all, the scaling (all
devices' images/s / one device's, eager alone); fxopt's losses (every step) and its trained
parameters and BatchNorm buffers after the last step against eager's of the same mode (relative:
max |p - p_eager| / max |p_eager|), the replicas' parameters against rank 0's, and fxopt's graphs.
Checks (exit status 1 on a failure): the replicas equal; losses and parameters within
``LOSS_TOLERANCE`` / ``PARAM_TOLERANCE`` of the precision (the buffers are reported, not bounded:
training-mode steps do not read them and their distance runs ten times the parameters'); fxopt
compiled graphs with no fallback, and every kind of convolution of the model (weight shape) is in
one of its forward graphs (a layer run eagerly between graphs fails this unless a
layer alike was compiled: blocks alike share one graph).
Rank 0 writes results.json and results.md to ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

from .ddp import PARAM_TOLERANCE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m fxopt.bench.fsdp",
                                description="DDP and FSDP2 training, eager and through fxopt.")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cuda if available (NCCL), else cpu (gloo)")
    p.add_argument("--model", default="resnet50", help="a fxopt.bench model (default resnet50)")
    p.add_argument("--batch", type=int, default=64, help="batch per process (default 64)")
    p.add_argument("--amp", choices=["bfloat16", "none"], help="default bfloat16 on cuda, none on cpu")
    p.add_argument("--modes", default="ddp,fsdp", help="comma list of ddp, fsdp (default both)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--image-size", type=int, help="input height/width of the ImageNet models (default 224)")
    p.add_argument("--data-batches", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--fxopt-options", default=None, metavar="JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recompile-limit", type=int, metavar="N",
                   help="torch._dynamo.config.recompile_limit for this command (default: Dynamo's, 8): a block "
                        "class whose blocks differ in shape per stage is compiled once per shape, and past the "
                        "limit Dynamo runs it eagerly")
    p.add_argument("--timeout-min", type=float, default=30.0)
    p.add_argument("--out", default="bench_fsdp_out")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    import torch

    from . import models as M

    p = build_parser()
    a = p.parse_args(list(argv) if argv is not None else None)
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.amp = a.amp or ("bfloat16" if a.device == "cuda" else "none")
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.model not in M.MODELS:
        p.error(f"unknown model {a.model!r}; known: {', '.join(M.MODELS)}")
    if not a.modes or set(a.modes) - {"ddp", "fsdp"}:
        p.error("--modes: ddp, fsdp")
    if a.batch < 2 or a.iters < 1 or a.warmup < 0:
        p.error("--batch >= 2, --iters >= 1, --warmup >= 0")
    a.fxopt_options = json.loads(a.fxopt_options) if a.fxopt_options else {}
    return a


def shard_blocks(model) -> List:
    """The outermost submodules with parameters whose ``forward`` is not ``torch.nn``'s own."""
    import torch

    out: List = []

    def visit(m):
        for child in m.children():
            own = not type(child).forward.__module__.startswith("torch.")
            if own and any(True for _ in child.parameters()):
                out.append(child)
            elif not own:
                visit(child)
    visit(model)
    assert all(isinstance(b, torch.nn.Module) for b in out)
    return out


class Run:
    """One mode and backend on this rank: its model, loop, losses and times."""

    def __init__(self, mode: str, backend: str, base, a, device: str):
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.nn.parallel import DistributedDataParallel as DDP

        from fxopt.backend import fxopt_backend

        self.mode, self.backend, self.reports, self.losses = mode, backend, [], []
        self.model = copy.deepcopy(base).to(device)
        self.autocast = None
        dtype = getattr(torch, a.amp) if a.amp != "none" else None
        if mode == "fsdp":
            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else None
            kw = {"mp_policy": policy} if policy else {}
            if dtype:  # FSDP2 casts the parameters, not the buffers: BatchNorm wants its statistics alike
                for m in self.model.modules():
                    if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                        m.running_mean, m.running_var = m.running_mean.to(dtype), m.running_var.to(dtype)
            for b in shard_blocks(self.model):
                fully_shard(b, **kw)
            fully_shard(self.model, **kw)
            module = self.model
        else:
            self.autocast = dtype
            module = self.model if mode == "single" else DDP(
                self.model, **({"device_ids": [torch.device(device).index]} if a.device == "cuda" else {}))
        if backend == "fxopt":
            def compile_fn(gm, example_inputs):  # backend="fxopt", keeping its reports
                return fxopt_backend(gm, example_inputs, options=a.fxopt_options, _sink=self.reports)
            module = torch.compile(module, backend=compile_fn)
        self.trained = module
        self.opt = torch.optim.SGD(self.model.parameters(), lr=a.lr, momentum=0.9)

    def step(self, x, y):
        import torch
        import torch.nn.functional as F

        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            loss = F.cross_entropy(self.trained(x), y)
        loss.backward()
        self.opt.step()
        self.losses.append(loss.detach())


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _train(r: Run, batches, a, device: str) -> Dict[str, Any]:
    import torch.distributed as dist

    t0 = time.perf_counter()
    r.step(*batches[0])
    _sync(device)
    first = time.perf_counter() - t0
    for i in range(1, 1 + a.warmup):
        r.step(*batches[i % len(batches)])
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1 + a.warmup, 1 + a.warmup + a.iters):
        r.step(*batches[i % len(batches)])
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / a.iters
    return {"first_step_s": first, "step_ms": ms, "images_per_s_per_device": a.batch / (ms / 1e3)}


def _conv_calls(r: Run, batch, device: str) -> Dict[str, int]:
    """One more step under torch.profiler, CPU activity only (no CUPTI): how many times it called
    ``aten::conv2d`` (what an ``nn.Conv2d`` run eagerly, or a Dynamo graph run as Python, calls;
    fxopt's lowered graphs call ``aten::convolution`` or replay a CUDA graph) and
    ``aten::convolution`` (every convolution run op by op, whoever called it)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        r.step(*batch)
        _sync(device)
    names = [e.name for e in prof.events()]
    return {"aten::conv2d": names.count("aten::conv2d"), "aten::convolution": names.count("aten::convolution")}


def _state(model) -> tuple:
    """Full parameters and floating-point buffers on the CPU in float32 (a DTensor's full value:
    a collective)."""
    def full(t):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        return t.detach().float().cpu()
    return ([full(p) for p in model.parameters()],
            [full(b) for b in model.buffers() if b.is_floating_point()])


def _rel(ts, refs) -> float:
    num = max((float((t - q).abs().max()) for t, q in zip(ts, refs)), default=0.0)
    den = max((float(q.abs().max()) for q in refs), default=0.0)
    return num / den if den else num


def _replica_diff(params, device: str) -> float:
    import torch.distributed as dist

    worst = 0.0
    for p in params:
        ref = p.to(device).clone()
        dist.broadcast(ref, 0)
        worst = max(worst, float((p - ref.cpu()).abs().max()))
    return worst


def _conv_signature(weight_shape) -> str:
    return "x".join(map(str, weight_shape))


def _dynamo_counters() -> Dict[str, Any]:
    """What Dynamo did in a run: graphs captured, frames compiled, recompile-limit hits, graph breaks."""
    from torch._dynamo.utils import counters

    out = {k: dict(counters[k]) for k in ("stats", "frames", "recompile_limit") if counters.get(k)}
    breaks = counters.get("graph_break")
    if breaks:
        out["graph_breaks"] = sum(breaks.values())
    return out


def _fxopt_summary(r: Run, base) -> Dict[str, Any]:
    """fxopt's graphs; the convolutions of the model (by weight shape) that none of its forward
    graphs holds: those ran eagerly. Blocks alike share one graph (Dynamo's guards see the same
    shapes), so the check is by weight shape, not by count; not by stride either: where one
    block's code is compiled again for a block with another stride, Dynamo makes the stride a
    symbolic input."""
    import torch

    compiled = set()
    for rep in r.reports:
        for n in rep.before.graph.nodes if rep.kind == "forward" else ():
            if n.op == "call_function" and getattr(n.target, "__name__", "").startswith("convolution."):
                compiled.add(_conv_signature(n.args[1].meta["val"].shape))
    model = {_conv_signature(m.weight.shape) for m in base.modules() if isinstance(m, torch.nn.Conv2d)}
    return {"graphs": [rep.kind for rep in r.reports], "fallbacks": [rep.fallback for rep in r.reports if rep.fallback],
            "convolutions": len(model & compiled), "model_convolutions": len(model),
            "eager_convolutions": sorted(model - compiled),
            "compile_s": sum(rep.compile_ms for rep in r.reports) / 1e3}


def run(a: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """This process's part; the results on rank 0 (None elsewhere)."""
    import torch
    import torch.distributed as dist

    from fxopt.testing.training import make_batches

    from . import _device_info, _versions
    from .train import _build

    local = int(os.environ.get("LOCAL_RANK", 0))
    if a.device == "cuda":
        torch.cuda.set_device(local)
        torch.backends.cudnn.benchmark = True
        if a.amp == "none":
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    device = f"cuda:{local}" if a.device == "cuda" else "cpu"
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=a.timeout_min),
                            **({"device_id": torch.device(device)} if a.device == "cuda" else {}))
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.recompile_limit:
        torch._dynamo.config.recompile_limit = a.recompile_limit
    cells: Dict[str, Any] = {}
    try:
        base, shape, classes = _build(a.model, a)
        batches = make_batches(a.data_batches, a.batch, shape, classes, device, seed=a.seed + 1000 * rank)
        for mode, backend in [("single", "eager")] + [(m, b) for m in a.modes for b in ("eager", "fxopt")]:
            torch._dynamo.reset()
            r = Run(mode, backend, base, a, device)
            torch._dynamo.utils.counters.clear()
            cell = _train(r, batches, a, device)
            cell["dynamo"] = _dynamo_counters()
            cell["conv_calls_per_step"] = _conv_calls(r, batches[0], device)
            cell["losses"] = [float(x) for x in r.losses]
            if mode != "single":
                params, buffers = _state(r.model)
                cell["replica_diff"] = _replica_diff(params, device)
                if backend == "eager":
                    ref = (params, buffers, cell["losses"])
                else:
                    n = min(len(cell["losses"]), len(ref[2]))
                    cell.update(losses_max_rel_diff=max(abs(x - y) / abs(y) for x, y in
                                                        zip(cell["losses"][:n], ref[2][:n])),
                                param_rel_diff=_rel(params, ref[0]), buffer_rel_diff=_rel(buffers, ref[1]),
                                fxopt=_fxopt_summary(r, base))
            cells[f"{mode}/{backend}"] = cell
            del r
            if a.device == "cuda":
                torch.cuda.empty_cache()
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, cells)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return None
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": f"torchrun --nproc-per-node {world} -m fxopt.bench.fsdp " + " ".join(sys.argv[1:]),
            "world_size": world, "device_type": a.device, **_device_info(a.device), "versions": _versions(),
            "config": {k: getattr(a, k) for k in ("model", "batch", "amp", "modes", "warmup", "iters", "image_size",
                                                   "lr", "seed", "fxopt_options", "recompile_limit")}}
    return {"meta": meta, "ranks": gathered, "summary": summarize(gathered, a)}


def summarize(ranks: List[Dict[str, Any]], a) -> Dict[str, Any]:
    """Rank 0's times; the worst distances over the ranks; the checks."""
    from fxopt.testing.training import AMP_DTYPES, LOSS_TOLERANCE

    import torch  # noqa: F401  (AMP_DTYPES' dtypes)

    tol = {"losses": LOSS_TOLERANCE[AMP_DTYPES[a.amp]], "parameters": PARAM_TOLERANCE[a.amp]}
    single = ranks[0]["single/eager"]["images_per_s_per_device"]
    rows, checks = {}, []
    for key, c0 in ranks[0].items():
        row = {k: c0.get(k) for k in ("first_step_s", "step_ms", "images_per_s_per_device", "conv_calls_per_step")}
        row["images_per_s"] = c0["images_per_s_per_device"] * (1 if key.startswith("single") else len(ranks))
        if not key.startswith("single"):
            row["scaling"] = row["images_per_s"] / single
            row["replica_diff"] = max(r[key]["replica_diff"] for r in ranks)
            for k in ("losses_max_rel_diff", "param_rel_diff", "buffer_rel_diff"):
                if k in c0:
                    row[k] = max(r[key][k] for r in ranks)
            problems = [] if row["replica_diff"] == 0.0 else [f"replicas differ by {row['replica_diff']:.3g}"]
            if key.endswith("fxopt"):
                fx = [r[key]["fxopt"] for r in ranks]
                row["fxopt"] = fx[0]
                if not row["losses_max_rel_diff"] <= tol["losses"]:
                    problems.append(f"losses differ from eager's by {row['losses_max_rel_diff']:.3g}")
                if not row["param_rel_diff"] <= tol["parameters"]:
                    problems.append(f"parameters differ from eager's by {row['param_rel_diff']:.3g}")
                if any(f["eager_convolutions"] or f["fallbacks"] or not f["graphs"] for f in fx):
                    problems.append(f"convolutions in no fxopt graph (weight shape): {fx[0]['eager_convolutions']}"
                                    f"; fallbacks {fx[0]['fallbacks']}; {len(fx[0]['graphs'])} graphs")
            checks.append({"run": key, "ok": not problems, "reason": "; ".join(problems) or None})
        rows[key] = row
    return {"rows": rows, "checks": checks, "tolerances": tol}


def render_markdown(results: Dict[str, Any]) -> str:
    m, s = results["meta"], results["summary"]
    cfg = m["config"]

    def f(v, spec=".2f"):
        return "–" if v is None else format(v, spec)

    lines = [f"# fxopt DDP / FSDP2: {cfg['model']} b{cfg['batch']} per device, {m['world_size']} processes", ""]
    if m["device_type"] == "cpu":
        lines += ["> **CPU run (gloo) — not a GPU performance result.**", ""]
    lines += [f"- device: {m.get('device_name')} × {m['world_size']}; precision {cfg['amp']} (DDP: autocast; "
              "FSDP2: MixedPrecisionPolicy, float32 reduce); SGD momentum 0.9",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v),
              f"- date: {m['date']}; command: `{m['command']}`",
              f"- mean of {cfg['iters']} steps after {cfg['warmup']} warm-up steps (rank 0); scaling = images/s "
              "on all devices / eager alone on one device", "",
              "| run | first step s | ms/step | img/s per device | img/s all | scaling | losses rel diff | "
              "params rel diff | buffers rel diff | replicas differ | fxopt graphs (conv kinds compiled) | "
              "aten::conv2d / aten::convolution calls a step |", "|" + "---|" * 12]
    for key, r in s["rows"].items():
        fx = r.get("fxopt")
        graphs = (f"{fx['graphs'].count('forward')} fw + {fx['graphs'].count('backward')} bw "
                  f"({fx['convolutions']}/{fx['model_convolutions']})") if fx else "–"
        lines.append("| " + " | ".join([
            key, f(r["first_step_s"]), f(r["step_ms"], ".1f"), f(r["images_per_s_per_device"], ".0f"),
            f(r["images_per_s"], ".0f"), f(r.get("scaling")), f(r.get("losses_max_rel_diff"), ".2e"),
            f(r.get("param_rel_diff"), ".2e"), f(r.get("buffer_rel_diff"), ".2e"), f(r.get("replica_diff"), ".3g"),
            graphs, " / ".join(str(v) for v in (r.get("conv_calls_per_step") or {}).values()) or "–"]) + " |")
    bad = [c for c in s["checks"] if not c["ok"]]
    lines += ["", f"Tolerances: losses {s['tolerances']['losses']:g}, parameters {s['tolerances']['parameters']:g} "
              "(relative, against eager's same mode).", "",
              f"Checks: {len(s['checks']) - len(bad)}/{len(s['checks'])} passed."]
    lines += [f"- FAILED {c['run']}: {c['reason']}" for c in bad]
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .ddp import write_results

    a = parse_args(argv)
    return write_results(run(a), a.out, render_markdown)


if __name__ == "__main__":
    sys.exit(main())
