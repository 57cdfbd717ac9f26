"""Where does compile time go? One model, compile + first call, in this (fresh) process.

    python3 scripts/compile_profile.py resnet50 --dtype float16 --batch 1 --backend fxopt [--cprofile 30] [--options JSON]

Prints the first-call time and, for fxopt, the time of each pass, of lowering and of the first
replay decisions (from the report); with ``--cprofile N`` the N functions with the largest
cumulative time. ``--backend`` may also be a Dynamo backend name (``eager``, ``aot_eager``,
``inductor``) to see the floor that every backend pays (Dynamo tracing, AOTAutograd). Run each
configuration in a fresh interpreter: the first compile in a process pays one-off imports.
"""
import argparse
import cProfile
import io
import json
import pstats
import time

import torch

from fxopt.bench.models import build_model, make_input


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backend", default="fxopt")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cprofile", type=int, default=0)
    p.add_argument("--sort", default="cumulative", help="cProfile order: cumulative or tottime")
    p.add_argument("--options", default="{}", help="fxopt options as JSON, e.g. '{\"conv_prune\": 0}'")
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, a.dtype)
    model, shape = build_model(a.model)
    model = model.eval().to(device=a.device, dtype=dtype)
    x = make_input(shape, a.batch).to(device=a.device, dtype=dtype)
    t = time.perf_counter()
    if a.device == "cuda":
        torch.cuda.init()
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    print(f"cuda init {time.perf_counter() - t:.2f} s")
    graphs: list = []
    if a.backend == "fxopt":
        from fxopt.testing import compile_with_fxopt
        fn = compile_with_fxopt(model, json.loads(a.options), graphs)
    else:
        fn = torch.compile(model, backend=a.backend)
    prof = cProfile.Profile() if a.cprofile else None
    with torch.no_grad():
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        fn(x)
        if a.device == "cuda":
            torch.cuda.synchronize()
        if prof:
            prof.disable()
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        fn(x)
        if a.device == "cuda":
            torch.cuda.synchronize()
        second = time.perf_counter() - t1
    print(f"{a.model} {a.dtype} b{a.batch} {a.backend}: first call {first:.2f} s, second {second * 1e3:.1f} ms")
    for g in graphs:
        print(f"  graph {g.kind}: fxopt compile (passes + lowering) {g.compile_ms / 1e3:.2f} s, "
              f"executor {g.executor}, cudagraphs {g.cudagraphs}")
        for r in g.passes:
            print(f"    {r.name:28s} {r.ms:8.1f} ms  {r.status}")
        for k, v in g.executor_details.items():
            if k.endswith("_s") or k.endswith("_ms"):
                print(f"    {k:28s} {v}")
        runner = g.executor_details.get("cudagraph_runner")
        if runner is not None:
            print(f"    runner decisions            {runner.decisions()}")
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(a.sort).print_stats(a.cprofile)
        print("\n".join(line[:160] for line in s.getvalue().splitlines()))


if __name__ == "__main__":
    main()
