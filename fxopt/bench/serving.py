"""A serving loop with varying sizes: ``fxopt bench --serving`` / ``python -m fxopt.bench.serving``.

Per model and backend, one ``torch.compile``, then ``--calls`` calls with batch sizes drawn at
random (seeded) from 1..``--max-batch``, then as many again with the batch and one of three image
sizes drawn. Reported per backend: the Dynamo graphs compiled, the total seconds of calls that
compiled (a new size's first call), the first-call time of a new size (median), the median latency
per size for a sample of sizes against the same model compiled statically for that size, peak GPU
memory, and whether any call ran eagerly (Dynamo's recompile limit hit: it then runs new sizes with
PyTorch's ops). Writes ``serving.json`` into ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
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
    "inductor": dict(backend="inductor"),
    "inductor-dynamic": dict(backend="inductor", dynamic=True),
    "inductor-reduce-overhead": dict(backend="inductor", mode="reduce-overhead"),
}


class _LimitHits(logging.Handler):
    """Counts Dynamo's "hit config.recompile_limit" warnings: frames from then on run eagerly."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record):
        if "hit config." in str(record.msg):
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


def _median_ms(fn, x, device, iters: int) -> float:
    return statistics.median(_timed(fn, x, device) for _ in range(iters)) * 1e3


def _plan(calls: int, max_batch: int, sides: Sequence[int], seed: int) -> list:
    rng = random.Random(seed)
    return [(rng.randint(1, max_batch), rng.choice(sides)) for _ in range(calls)]


def run_backend(name: str, model, chw, device, dtype, plans: dict, sample: Sequence, iters: int,
                fxopt_options: Optional[dict]) -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    kwargs = dict(BACKENDS[name])
    if kwargs["backend"] == "fxopt" and fxopt_options:
        kwargs["options"] = fxopt_options
    compiled = torch.compile(model, **kwargs)
    hits = _LimitHits()
    logging.getLogger("torch._dynamo").addHandler(hits)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out: dict = {"backend": name}
    try:
        for phase, plan in plans.items():
            seen, first, steady, compile_s = set(), [], {}, 0.0
            for b, side in plan:
                x = torch.randn(b, chw[0], side, side, device=device, dtype=dtype)
                before = counters["stats"]["unique_graphs"]
                dt = _timed(compiled, x, device)
                if (b, side) not in seen:
                    seen.add((b, side))
                    first.append(dt)
                else:
                    steady.setdefault((b, side), []).append(dt * 1e3)
                if counters["stats"]["unique_graphs"] != before:
                    compile_s += dt
            out[phase] = {"calls": len(plan), "sizes": len(seen), "dynamo_graphs": counters["stats"]["unique_graphs"],
                          "compile_calls_s": round(compile_s, 2),
                          "first_call_new_size_s_median": round(statistics.median(first), 4),
                          "first_call_new_size_s_max": round(max(first), 4),
                          "eager_after_recompile_limit": hits.hits > 0}
        per_size = {}
        for b, side in sample:
            x = torch.randn(b, chw[0], side, side, device=device, dtype=dtype)
            dyn = _median_ms(compiled, x, device, iters)
            torch._dynamo.reset()
            static = torch.compile(model, **{**kwargs, "dynamic": False})
            for _ in range(3):
                _timed(static, x, device)
            per_size[f"{b}x{side}"] = {"dynamic_ms": round(dyn, 3),
                                       "static_ms": round(_median_ms(static, x, device, iters), 3)}
            torch._dynamo.reset()
            compiled = torch.compile(model, **kwargs)  # the serving model again (recompiles once: not counted)
        out["latency_vs_static"] = per_size
        out["eager_calls_possible"] = hits.hits > 0
        out["recompile_limit_hits"] = hits.hits
        if device.type == "cuda":
            out["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    finally:
        logging.getLogger("torch._dynamo").removeHandler(hits)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxopt bench --serving", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="resnet18", help="comma list (fxopt.bench.models names)")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float16 (cuda default) or float32 (cpu default)")
    p.add_argument("--calls", type=int, default=1000, help="calls per phase (batch sizes, then image sizes)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--sides", default=None, help="three image sides, e.g. 192,224,256 (default: the model's "
                   "side and that +-32)")
    p.add_argument("--sample", default="1,8,32", help="batch sizes timed against a static compile")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--fxopt-options", default=None, help="fxopt options as JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .models import build_model

    a = build_parser().parse_args(argv)
    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("float16" if device.type == "cuda" else "float32"))
    results = []
    for model_name in a.models.split(","):
        model, chw = build_model(model_name, seed=a.seed)
        model = model.to(device=device, dtype=dtype).eval()
        side = chw[1]
        sides = [int(s) for s in a.sides.split(",")] if a.sides else [side, side + 32, max(side - 32, 8)]
        plans = {"batch_sizes": _plan(a.calls, a.max_batch, [side], a.seed),
                 "image_sizes": _plan(a.calls, a.max_batch, sides, a.seed + 1)}
        sample = [(int(b), side) for b in a.sample.split(",") if int(b) <= a.max_batch]
        opts = json.loads(a.fxopt_options) if a.fxopt_options else None
        for name in a.backends.split(","):
            try:
                r = run_backend(name, model, chw, device, dtype, plans, sample, a.iters, opts)
            except Exception as e:  # noqa: BLE001 - one backend failing does not end the run
                r = {"backend": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            r["model"] = model_name
            results.append(r)
            print(json.dumps(r), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "serving.json"), "w") as f:
        json.dump({"device": str(device), "dtype": str(dtype), "torch": torch.__version__, "results": results}, f,
                  indent=1)
    print(f"{'model':12} {'backend':26} {'phase':12} {'graphs':>6} {'compile s':>9} {'1st new s':>9} eager")
    for r in results:
        for phase in ("batch_sizes", "image_sizes"):
            if phase in r:
                p = r[phase]
                print(f"{r['model']:12} {r['backend']:26} {phase:12} {p['dynamo_graphs']:6d} {p['compile_calls_s']:9.2f} "
                      f"{p['first_call_new_size_s_median']:9.3f} {p['eager_after_recompile_limit']}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
