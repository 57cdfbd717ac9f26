"""Where the host time of one compiled call goes (GPU machine).

    python3 scripts/host_profile.py seedcnn:float32:1 [--calls 3000]

Prints, in microseconds per call: the benchmark's CUDA-event measure (e2e), the host time of
back-to-back calls (cpu), the same for fxopt's CUDA-graph runner called directly, whether the
runner's fast path served the calls, and a cProfile of the compiled call (the functions with the
most time of their own, per call). ``--choices``: the executor's measured candidates per node.

With ``--neighbour inductor-reduce-overhead`` (or another ``torch.compile`` mode) a copy of the
model is also compiled that way in the same process, as the benchmark harness does, and the
fxopt call is measured again next to it (with and without Python's garbage collector; with the
profiling/monitoring hooks installed in the process listed): what a neighbour costs fxopt's call.
"""
import copy
import gc
import sys
import time
import argparse
import cProfile
import io
import pstats

import torch

from fxopt.bench.models import build_model
from fxopt.bench.runners import host_ms_per_call, time_calls
from fxopt.testing import compile_with_fxopt


def hooks() -> str:
    tools = [i for i in range(6) if sys.monitoring.get_tool(i)] if hasattr(sys, "monitoring") else []
    return f"profile={sys.getprofile()} trace={sys.gettrace()} monitoring_tools={tools}"


def neighbour_report(mode: str, model, c, x):
    def cpu_us(fn):
        return min(host_ms_per_call(fn, x, 500) for _ in range(5)) * 1e3

    print(f"   before neighbour: cpu={cpu_us(c):.1f} {hooks()} gc={gc.get_count()}", flush=True)
    other = copy.deepcopy(model)
    t0 = time.perf_counter()
    n = torch.compile(other, mode=None if mode == "inductor" else mode.replace("inductor-", ""))
    for _ in range(5):
        n(x)
    torch.cuda.synchronize()
    print(f"   neighbour {mode} compiled in {time.perf_counter() - t0:.1f} s, cpu={cpu_us(n):.1f}", flush=True)
    for _ in range(20):
        c(x)
    with_n = cpu_us(c)
    gc.disable()
    no_gc = cpu_us(c)
    gc.enable()
    e2e = sorted(time_calls(c, x, "cuda", 200))[100] * 1e3
    print(f"   next to it: cpu={with_n:.1f} cpu_gc_off={no_gc:.1f} e2e={e2e:.1f} {hooks()} gc={gc.get_count()}",
          flush=True)
    del n, other
    gc.collect()
    torch.cuda.synchronize()
    print(f"   neighbour deleted: cpu={cpu_us(c):.1f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="+")
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--neighbour", default=None, help="e.g. inductor-reduce-overhead, inductor")
    p.add_argument("--choices", action="store_true", help="print the executor's measured choices per node")
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    for cfg in a.configs:
        name, dtype, batch = cfg.split(":")
        model, shape = build_model(name)
        model = model.eval().cuda().to(getattr(torch, dtype))
        x = torch.randn(int(batch), *shape, device="cuda", dtype=getattr(torch, dtype))
        graphs = []
        c = compile_with_fxopt(model, {}, graphs)
        with torch.no_grad():
            c(x)
        runner = graphs[0].executor_details.get("cudagraph_runner")
        if a.choices:  # what the executor measured for each node (ms per candidate) and chose
            for name, entry in graphs[0].executor_details.get("node_choices", {}).items():
                ms = " ".join(f"{k}={v * 1e3:.2f}us" for k, v in sorted(entry.get("ms", {}).items(), key=lambda kv: kv[1]))
                print(f"   {name}: {entry.get('choice')} | {ms}", flush=True)
        seen = {}
        real_call = type(runner).__call__

        class Recording(type(runner)):
            def __call__(self, *args):
                seen["args"] = args
                return real_call(self, *args)

        with torch.no_grad():
            for _ in range(20):
                c(x)
            e2e = sorted(time_calls(c, x, "cuda", 200))[100] * 1e3
            cpu = min(host_ms_per_call(c, x, 500) for _ in range(5)) * 1e3
            fast = runner._fast is not None
            runner.__class__ = Recording
            c(x)
            runner.__class__ = type(runner).__mro__[1]
            args = seen.pop("args")
            r_e2e = sorted(time_calls(lambda _: runner(*args), x, "cuda", 200))[100] * 1e3
            r_cpu = min(host_ms_per_call(lambda _: runner(*args), x, 500) for _ in range(5)) * 1e3
            g = runner._fast[0].graph if runner._fast else None
            rep = sorted(time_calls(lambda _: g.replay(), x, "cuda", 200))[100] * 1e3 if g else float("nan")
            rep_cpu = min(host_ms_per_call(lambda _: g.replay(), x, 500) for _ in range(5)) * 1e3 if g else float("nan")
            print(f"{cfg}: e2e={e2e:.1f} cpu={cpu:.1f} fast_path={fast} runner_e2e={r_e2e:.1f} runner_cpu={r_cpu:.1f} "
                  f"replay_e2e={rep:.1f} replay_cpu={rep_cpu:.1f} fast_after={runner._fast is not None}", flush=True)
            if a.neighbour:
                neighbour_report(a.neighbour, model, c, x)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                c(x)
            prof.disable()
            torch.cuda.synchronize()
        s = io.StringIO()
        st = pstats.Stats(prof, stream=s)
        st.sort_stats("tottime").print_stats(18)
        print("\n".join(s.getvalue().splitlines()[:40]))
        torch.compiler.reset()


if __name__ == "__main__":
    main()
