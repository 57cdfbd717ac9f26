"""A serving loop with varying sizes: ``fxopt bench --serving`` / ``python -m fxopt.bench.serving``.

Per model and backend, one ``torch.compile``; then phase "batch": ``--calls`` calls with batch sizes
drawn at random (seeded) from 1..``--max-batch`` at the model's image size, and phase "image": as
many calls with the batch and one of three ``--image-sizes`` drawn (the same compiled model goes on
serving). Peers: fxopt, inductor-default, inductor-dynamic (``dynamic=True``),
inductor-reduce-overhead; fxopt-dynamic (``dynamic=True``) on request.

Reported per backend and phase (``fxopt.bench.serving_report``): the Dynamo graphs compiled; the
compile seconds (the wall time of calls during which Dynamo compiled a graph or fxopt lowered a
size) and the overhead seconds (every call's time beyond the steady latency of its size: compiles,
CUDA-graph captures, padded runs); the first-call time of a new size (median, max); whether any call
ran eagerly (Dynamo's recompile limit hit, a graph break, and for fxopt: calls not served by an
fxopt-compiled graph, runtime fallbacks); peak GPU memory (``torch.cuda.max_memory_allocated``,
reset per backend). After the loops, for a sample of sizes (``--sample`` batches at the model's
image size, ``--image-sample`` at the other image sizes), the median latency of the serving model
(each size warmed first, so fxopt's exact specialization has taken over) against the same backend
compiled statically for that size (a copy of the model, ``automatic_dynamic_shapes`` off: one static
graph per size), both in this process, timed alternately in ``ROUNDS`` rounds over ``INPUTS`` input
tensors in turn (a serving loop's calls bring new tensors).
``--time-budget`` bounds a run: a backend's loop stops at its share (the JSON says so), static
comparisons are skipped when none is left. Each model and backend runs in a process of its own
(``--no-isolate``: all in this one, the first paying the others' lazy imports and CUDA start-up).
Writes ``serving.json`` and ``serving.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import random
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

BACKENDS = {
    "fxopt": dict(backend="fxopt"),
    "fxopt-dynamic": dict(backend="fxopt", dynamic=True),
    "inductor-default": dict(backend="inductor"),
    "inductor-dynamic": dict(backend="inductor", dynamic=True),
    "inductor-reduce-overhead": dict(backend="inductor", mode="reduce-overhead"),
}
DEFAULT_BACKENDS = ["fxopt", "inductor-default", "inductor-dynamic", "inductor-reduce-overhead"]
ALIASES = {"inductor": "inductor-default"}


class _LimitHits(logging.Handler):
    """Counts Dynamo's "hit config.recompile_limit" warnings: frames from then on run eagerly."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record):
        if "hit config." in str(record.msg) or "recompile_limit" in str(record.msg):
            self.hits += 1


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, x, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        fn(x)
    _sync(device)
    return time.perf_counter() - t0


#: distinct input tensors a latency is timed over, in turn: a serving loop's calls bring new tensors
#: (a CUDA-graph runner copies them in), never one tensor over and over (which a capture may read in place)
INPUTS = 3


def _inputs(b: int, chw, side: int, device, dtype) -> list:
    return [torch.randn(b, chw[0], side, side, device=device, dtype=dtype) for _ in range(INPUTS)]


def _median_ms(fn, xs: list, device, iters: int) -> float:
    return statistics.median(_timed(fn, xs[i % len(xs)], device) for i in range(iters)) * 1e3


def plan(calls: int, max_batch: int, sides: Sequence[int], seed: int) -> list:
    rng = random.Random(seed)
    return [(rng.randint(1, max_batch), rng.choice(list(sides))) for _ in range(calls)]


class FxoptProbe:
    """fxopt as the backend, its reports kept and the calls its compiled graphs serve counted."""

    def __init__(self, options: Optional[dict]):
        self.options, self.reports, self.calls = options or {}, [], 0

    def __call__(self, gm, inputs):
        from fxopt.backend import fxopt_backend

        fn = fxopt_backend(gm, inputs, options=self.options, _sink=self.reports)

        def counted(*args):
            self.calls += 1
            return fn(*args)

        return counted

    def dynamic(self) -> list:
        return [r.executor_details.get("dynamic") or {} for r in self.reports]

    def lowerings(self) -> int:
        return sum(rec.get("lowered", 0) for info in self.dynamic()
                   for rec in info.get("specializations", {}).values())

    def fallbacks(self) -> int:
        return sum(1 for r in self.reports if r.executor_details.get("runtime_fallback")
                   or str(r.executor).startswith("torch (fallback")) + sum(
            1 for info in self.dynamic() for rec in info.get("specializations", {}).values()
            if str(rec.get("note", "")).startswith("lowering failed"))


def _compile(name: str, model, fxopt_options: Optional[dict], static: bool = False):
    kwargs = dict(BACKENDS[name])
    probe = None
    if kwargs["backend"] == "fxopt":
        probe = FxoptProbe(fxopt_options)
        kwargs["backend"] = probe  # the probe hands fxopt its options
    if static:
        kwargs["dynamic"] = False
    return torch.compile(model, **kwargs), probe


def _phase(compiled, probe, plan_, chw, device, dtype, deadline: float) -> dict:
    from torch._dynamo.utils import counters

    graphs0 = counters["stats"]["unique_graphs"]
    breaks0 = sum(counters["graph_break"].values())
    fx_calls0 = probe.calls if probe else 0
    times: dict = {}
    first, compile_s, done = [], 0.0, 0
    first_no_compile, every = [], []  # first calls during which Dynamo compiled no graph; every call
    for b, side in plan_:
        if time.perf_counter() > deadline:
            break
        x = torch.randn(b, chw[0], side, side, device=device, dtype=dtype)
        g0, l0 = counters["stats"]["unique_graphs"], probe.lowerings() if probe else 0
        dt = _timed(compiled, x, device)
        every.append(dt)
        if (b, side) not in times:
            first.append(dt)
            if counters["stats"]["unique_graphs"] == g0:
                first_no_compile.append(dt)
            times[(b, side)] = []
        else:
            times[(b, side)].append(dt)
        if counters["stats"]["unique_graphs"] != g0 or (probe and probe.lowerings() != l0):
            compile_s += dt
        done += 1
    steady = {k: statistics.median(v) for k, v in times.items() if v}
    overhead = 0.0
    for k, v in times.items():
        base = steady.get(k)
        if base is not None:
            overhead += sum(max(0.0, t - base) for t in v)
    out = {"calls": done, "planned_calls": len(plan_), "truncated": done < len(plan_), "sizes": len(times),
           "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs0, "compile_s": round(compile_s, 3),
           "overhead_s": round(overhead + sum(max(0.0, f - steady.get(k, f)) for f, k in zip(first, times)), 3),
           "total_s": round(sum(first) + sum(sum(v) for v in times.values()), 3),
           "first_call_new_size_s_median": round(statistics.median(first), 4) if first else None,
           "first_call_new_size_s_max": round(max(first), 4) if first else None,
           "first_call_new_size_s_max_no_dynamo_compile": round(max(first_no_compile), 4) if first_no_compile
           else None,
           "call_ms_p99": round(sorted(every)[int(0.99 * (len(every) - 1))] * 1e3, 3) if every else None,
           "steady_ms_median": round(statistics.median(steady.values()) * 1e3, 3) if steady else None,
           "graph_breaks": sum(counters["graph_break"].values()) - breaks0}
    if probe is not None:
        out["calls_not_served_by_fxopt"] = done - (probe.calls - fx_calls0)
    return out


def run_backend(name: str, model, chw, device, dtype, plans: dict, samples: Sequence, iters: int,
                fxopt_options: Optional[dict], deadline: float) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled, probe = _compile(name, model, fxopt_options)
    hits = _LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out: dict = {"backend": name, "kwargs": {k: v for k, v in BACKENDS[name].items() if k != "backend"}}
    try:
        for phase, p in plans.items():
            out[phase] = _phase(compiled, probe, p, chw, device, dtype, deadline)
        out["dynamo_graphs_total"] = counters["stats"]["unique_graphs"]
        out["recompile_limit_hits"] = hits.hits
        if device.type == "cuda":
            out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        if probe is not None:
            out["fxopt_runtime_fallbacks"] = probe.fallbacks()
            infos = [info for info in probe.dynamic() if info]
            out["fxopt_dynamic"] = [{k: v for k, v in info.items() if k != "specializations"} for info in infos]
            out["fxopt_lowerings"] = probe.lowerings()
            secs = sorted(t for info in infos for rec in info.get("specializations", {}).values()
                          for t in rec.get("seconds", ()))
            out["fxopt_size_lowerings_s"] = _spread(secs)  # lazy specializations (Dynamo's compiles apart)
            # the same with the first call that ran on each (warm-ups, CUDA-graph capture, what it measured)
            out["fxopt_size_first_calls_s"] = _spread(sorted(
                t for info in infos for rec in info.get("specializations", {}).values()
                for t in rec.get("first_call_seconds", ())))
        not_fx = sum(out[ph].get("calls_not_served_by_fxopt", 0) for ph in plans)
        out["eager_calls"] = bool(hits.hits or any(out[ph]["graph_breaks"] for ph in plans) or not_fx
                                  or out.get("fxopt_runtime_fallbacks"))
        out["latency_vs_static"] = _versus_static(name, model, compiled, probe, chw, device, dtype, samples, iters,
                                                  fxopt_options, deadline)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(hits)
    return out


def _spread(secs: list) -> Optional[dict]:
    """count, total, median and max of sorted seconds (None: none)."""
    return ({"count": len(secs), "total": round(sum(secs), 3), "median": round(statistics.median(secs), 4),
             "max": secs[-1]} if secs else None)


def _dispatch_calls(probe: Optional[FxoptProbe]) -> dict:
    """(dispatcher id, size key) -> calls so far, over fxopt's symbolic graphs (``SizeDispatcher``)."""
    if probe is None:
        return {}
    return {(id(r.dispatcher), k): n for r in probe.reports if getattr(r, "dispatcher", None) is not None
            for k, n in r.dispatcher.calls.items()}


def _served_as(probe: FxoptProbe, before: dict) -> str:
    """How the symbolic graph that served the calls since ``before`` (``_dispatch_calls``) serves
    their size now: "own specialization", "padded to batch N", ... ("static graph" where no symbolic
    graph served them: one of Dynamo's static graphs)."""
    how = []
    for r in probe.reports:
        d = getattr(r, "dispatcher", None)
        if d is None:
            continue
        for key, n in d.calls.items():
            if n > before.get((id(d), key), 0):
                rec = d.info["specializations"].get(d.shapes.describe(key), {})
                how.append("own specialization" if key in d.cache else str(rec.get("runs", "?")))
    return "; ".join(how) or "static graph"


def _static_family(name: str) -> str:
    """Backends whose static compiles are the same: fxopt and fxopt-dynamic, inductor and inductor-dynamic."""
    return {"fxopt-dynamic": "fxopt", "inductor-dynamic": "inductor-default"}.get(name, name)


#: rounds a size's serving and static latencies are timed in, alternately (``iters`` calls a round each)
ROUNDS = 4


def _static_twin(model):
    """A copy of ``model`` behind a function of its own: its Dynamo cache entries and automatic-dynamic
    state are its own (another code object), so it compiles statically beside the serving model."""
    twin = copy.deepcopy(model)

    def static_forward(x):
        return twin(x)
    return static_forward


def _versus_static(name, model, compiled, probe, chw, device, dtype, samples, iters, fxopt_options,
                   deadline) -> dict:
    """Per sampled size: the serving model (warmed first) against the same backend compiled statically
    for that size, in one process and timed alternately (``ROUNDS`` rounds, the medians' median), so
    that both see the same state of the host and the device."""
    per_size, inputs = {}, {}
    warm = (fxopt_options or {}).get("specialize_after", 2) + 3
    for b, side in samples:
        if time.perf_counter() > deadline:
            per_size[f"{b}x{side}"] = {"skipped": "time budget"}
            continue
        xs = inputs[(b, side)] = _inputs(b, chw, side, device, dtype)
        before = _dispatch_calls(probe)
        for i in range(warm):
            _timed(compiled, xs[i % len(xs)], device)
        per_size[f"{b}x{side}"] = {}
        if probe is not None:
            per_size[f"{b}x{side}"]["served_as"] = _served_as(probe, before)
    family = _static_family(name)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=max(8, 2 * len(samples) + 1)):
        static, static_probe = _compile(family, _static_twin(model), fxopt_options, static=True)
        for (b, side), xs in inputs.items():
            rec = per_size[f"{b}x{side}"]
            if time.perf_counter() > deadline:
                rec["static_skipped"] = "time budget"
                continue
            for i in range(max(3, len(xs) + 1)):  # compiled here, at this size
                _timed(static, xs[i % len(xs)], device)
            calls = static_probe.calls if static_probe is not None else None
            dyn, stat = [], []
            for _ in range(ROUNDS):
                dyn.append(_median_ms(compiled, xs, device, iters))
                stat.append(_median_ms(static, xs, device, iters))
            if static_probe is not None and static_probe.calls - calls != ROUNDS * iters:
                rec["static_skipped"] = "the static compile did not serve its calls"
                continue
            rec["dynamic_ms"] = round(statistics.median(dyn), 4)
            rec["static_ms"] = round(statistics.median(stat), 4)
            rec["ratio"] = round(rec["dynamic_ms"] / rec["static_ms"], 3) if rec["static_ms"] else None
    torch._dynamo.reset()
    return per_size


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxopt bench --serving", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18", help="comma list (fxopt.bench.models names)")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float16 (cuda default) or float32 (cpu default)")
    p.add_argument("--calls", type=int, default=1000, help="calls per phase")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--image-sizes", default=None, help="three image sides for the image phase, e.g. 192,224,256 "
                   "(default: the model's side and that -32, +32)")
    p.add_argument("--phases", default="batch,image", help="comma list of batch, image")
    p.add_argument("--sample", default="1,16,64", help="batch sizes timed against a static compile (model's side)")
    p.add_argument("--image-sample", default="16", help="batch sizes timed against a static compile at the "
                   "other image sides")
    p.add_argument("--iters", type=int, default=15, help="timed calls per size and round against a static compile")
    p.add_argument("--fxopt-options", default=None, help="fxopt options as JSON")
    p.add_argument("--size-oblivious", action="store_true", help="compile under torch.fx.experimental._config."
                   "backed_size_oblivious (no 0/1 specialization: batch 1 shares the symbolic graph)")
    p.add_argument("--cpp-shape-guards", action="store_true", help="compile under torch._dynamo.config."
                   "enable_cpp_symbolic_shape_guards (Dynamo checks a symbolic graph's size guards in C++, not in "
                   "Python on every call: the per-call cost a static graph does not pay)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (shared by backends)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--no-isolate", dest="isolate", action="store_false",
                   help="run every backend in this process (default: each model and backend in a process of "
                   "its own, as a user's first compile runs: the first in a shared process would pay the lazy "
                   "imports of Dynamo, AOTAutograd and sympy and the CUDA libraries' start-up for the rest)")
    return p


def _isolated(argv: Sequence[str], model_name: str, name: str, budget: float) -> dict:
    """One model and backend run by a child process of this module (``--no-isolate``); its result."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        args = [*argv, "--models", model_name, "--backends", name, "--out", out, "--no-isolate"]
        if budget != float("inf"):
            args += ["--time-budget", str(max(1.0, budget))]
        proc = subprocess.run([sys.executable, "-m", "fxopt.bench.serving", *args], capture_output=True, text=True)
        try:
            with open(os.path.join(out, "serving.json")) as f:
                return json.load(f)["results"][0]
        except (OSError, ValueError, KeyError, IndexError):
            return {"backend": name, "error": f"the child process failed (rc {proc.returncode}): "
                    f"{proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ''}"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    import contextlib

    from .models import build_model
    from .serving_report import markdown

    a = build_parser().parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("float16" if device.type == "cuda" else "float32"))
    names = [ALIASES.get(n, n) for n in a.backends.split(",") if n]
    bad = [n for n in names if n not in BACKENDS]
    if bad:
        raise SystemExit(f"unknown backend(s) {bad}; known: {list(BACKENDS)}")
    t_start = time.perf_counter()
    budget = a.time_budget or float("inf")
    results = []
    models = a.models.split(",")
    jobs = [(m, n) for m in models for n in names]
    opts = json.loads(a.fxopt_options) if a.fxopt_options else None
    if a.cpp_shape_guards and not hasattr(torch._dynamo.config, "enable_cpp_symbolic_shape_guards"):
        raise SystemExit(f"--cpp-shape-guards: torch {torch.__version__} has no "
                         "torch._dynamo.config.enable_cpp_symbolic_shape_guards")

    def settings() -> contextlib.ExitStack:  # the PyTorch settings a run is compiled under
        stack = contextlib.ExitStack()
        if a.size_oblivious:
            stack.enter_context(torch.fx.experimental._config.patch(backed_size_oblivious=True))
        if a.cpp_shape_guards:
            stack.enter_context(torch._dynamo.config.patch(enable_cpp_symbolic_shape_guards=True))
        return stack
    for j, (model_name, name) in enumerate(jobs):
        if a.isolate and len(jobs) > 1:
            r = _isolated(list(sys.argv[1:] if argv is None else argv), model_name, name,
                          (budget - (time.perf_counter() - t_start)) / (len(jobs) - j))
            r["model"] = model_name
            r["seconds"] = round(time.perf_counter() - t_start, 1)
            results.append(r)
            print(json.dumps(r, default=str), flush=True)
            continue
        model, chw = build_model(model_name, seed=a.seed)
        model = model.to(device=device, dtype=dtype).eval()
        side = chw[1]
        sides = [int(s) for s in a.image_sizes.split(",")] if a.image_sizes else [max(side - 32, 8), side, side + 32]
        phases = a.phases.split(",")
        plans = {}
        if "batch" in phases:
            plans["batch"] = plan(a.calls, a.max_batch, [side], a.seed)
        if "image" in phases:
            plans["image"] = plan(a.calls, a.max_batch, sides, a.seed + 1)
        samples = [(int(b), side) for b in a.sample.split(",") if b and int(b) <= a.max_batch]
        if "image" in phases:
            samples += [(int(b), s) for s in sides if s != side for b in a.image_sample.split(",")
                        if b and int(b) <= a.max_batch]
        left = budget - (time.perf_counter() - t_start)
        deadline = time.perf_counter() + left / (len(jobs) - j)
        try:
            with settings():
                r = run_backend(name, model, chw, device, dtype, plans, samples, a.iters, opts, deadline)
        except Exception as e:  # noqa: BLE001 - one backend failing does not end the run
            r = {"backend": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        r["model"] = model_name
        r["seconds"] = round(time.perf_counter() - t_start, 1)
        r["process"] = os.getpid()
        results.append(r)
        print(json.dumps(r, default=str), flush=True)
    os.makedirs(a.out, exist_ok=True)
    meta = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "dtype": str(dtype), "torch": torch.__version__, "calls": a.calls, "max_batch": a.max_batch,
            "seed": a.seed, "size_oblivious": a.size_oblivious, "cpp_shape_guards": a.cpp_shape_guards,
            "fxopt_options": opts,
            "wall_s": round(time.perf_counter() - t_start, 1)}
    with open(os.path.join(a.out, "serving.json"), "w") as f:
        json.dump({**meta, "results": results}, f, indent=1, default=str)
    md = markdown(meta, results)
    with open(os.path.join(a.out, "serving.md"), "w") as f:
        f.write(md)
    print(md)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
