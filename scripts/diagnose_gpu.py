"""Where does fxopt's time go? Per-call breakdown on the GPU machine.

    python3 scripts/diagnose_gpu.py seedcnn:float32:1 resnet50:float16:1 [--profile] [--inductor]

For each model:dtype:batch prints, in microseconds per call:
- ``e2e``: the benchmark's measure (CUDA events around back-to-back calls, median of 50);
- ``cpu``: host time to issue one call (back-to-back, no sync): above ``e2e`` means CPU-bound;
- ``noop``: Dynamo + AOTAutograd alone (a backend whose compiled graph does nothing);
- ``runner``: fxopt's CUDA-graph runner called directly (no Dynamo / AOTAutograd);
- ``replay``: the captured CUDA graph replayed alone (its kernels' GPU time plus the launch);
- ``*_cpu``: host time of the runner, one replay, the runner's weight check, and of Dynamo +
  AOTAutograd around a runner that does nothing (``wrappers_cpu``);
- with ``--inductor``: Inductor (freezing, reduce-overhead) e2e for comparison;
- with ``--profile``: the kernels in one fxopt replay, by GPU time.
Also the executor's per-node choices and the replay-vs-plain decision.
"""
import argparse
import collections
import statistics

import torch
from torch._dynamo.backends.common import aot_autograd

from fxopt.bench.models import build_model
from fxopt.bench.runners import host_ms_per_call, time_calls
from fxopt.testing import compile_with_fxopt


def us(samples):
    return statistics.median(samples) * 1e3


def e2e_us(fn, x, iters=50):
    with torch.no_grad():
        for _ in range(10):
            fn(x)
        return us(time_calls(fn, x, "cuda", iters))


def cpu_us(fn, x, iters=100):
    with torch.no_grad():
        for _ in range(5):
            fn(x)
        return host_ms_per_call(fn, x, iters) * 1e3


def noop_us(model, x):
    """Dynamo + AOTAutograd per-call cost with a compiled graph that only returns a constant."""
    with torch.no_grad():
        ref = model(x)

    def inference(gm, args):
        def run(a):
            a.clear()
            return (ref,)
        run._boxed_call = True
        return run

    torch.compiler.reset()
    c = torch.compile(model, backend=lambda gm, ex: aot_autograd(fw_compiler=inference,
                                                                  inference_compiler=inference)(gm, ex))
    return cpu_us(c, x, 300)


def record_args(runner):
    """Make the runner keep the flat argument list Dynamo/AOTAutograd passes it."""
    class Recording(type(runner)):
        def __call__(self, *args):
            self.last_args = args
            return super().__call__(*args)

    runner.__class__ = Recording


def kernel_table(fn, rows=12):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "device_time_total", 0)]
    total = sum(getattr(e, "device_time_total", 0) for e in events) / 10
    lines = [f"   kernels/replay={sum(e.count for e in events) / 10:.0f}  GPU us/replay={total:.1f}"]
    for e in sorted(events, key=lambda e: -getattr(e, "device_time_total", 0))[:rows]:
        lines.append(f"   {getattr(e, 'device_time_total', 0) / 10:8.1f} us  x{e.count / 10:4.0f}  {e.key[:90]}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="+", help="model:dtype:batch, e.g. resnet50:float16:1")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--inductor", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    for cfg in a.configs:
        name, dtype, batch = cfg.split(":")
        dtype, batch = getattr(torch, dtype), int(batch)
        model, shape = build_model(name)
        model = model.eval().cuda().to(dtype)
        x = torch.randn(batch, *shape, device="cuda", dtype=dtype)
        graphs = []
        c = compile_with_fxopt(model, {}, graphs)
        row = {"e2e": e2e_us(c, x)}
        g = graphs[0]
        runner = g.executor_details.get("cudagraph_runner")
        epi = g.executor_details.get("node_choices", {})
        info = f"cudagraphs={g.cudagraphs} compile={g.compile_ms / 1e3:.1f}s"
        if runner is None:
            row["cpu"] = cpu_us(c, x)
        else:
            record_args(runner)
            with torch.no_grad():
                c(x)
            args = runner.last_args
            row["runner"] = e2e_us(lambda _: runner(*args), x)
            entry = next(iter(runner.graphs.values()))
            row["replay"] = e2e_us(lambda _: entry.instances[0].graph.replay(), x)
            real = type(runner)
            outs = runner._replay(entry, args)
            trivial = type("Trivial", (real,), {"__call__": lambda self, *a: outs})
            # host times, interleaved and repeated (the host's speed drifts): min of 3
            cpu = collections.defaultdict(list)
            for _ in range(3):
                runner.__class__ = real
                cpu["cpu"].append(cpu_us(c, x))
                cpu["runner_cpu"].append(cpu_us(lambda _: runner(*args), x))
                cpu["replay_cpu"].append(cpu_us(lambda _: entry.instances[0].graph.replay(), x))
                cpu["check_cpu"].append(cpu_us(lambda _: runner.watch.check(args), x))
                runner.__class__ = trivial  # Dynamo + AOTAutograd + boxing around a runner that does nothing
                cpu["wrappers_cpu"].append(cpu_us(c, x))
            runner.__class__ = real
            row.update({k: min(v) for k, v in cpu.items()})
            info += (f" decisions={runner.decisions()} watched={len(runner.watch.indices)}/{len(runner.static)}"
                     f" versioned={len(runner.watch.version_indices)} fast_path={runner._fast is not None}")
        row["noop"] = noop_us(model, x)
        if a.inductor:
            torch.compiler.reset()
            with torch._inductor.config.patch(freezing=True):
                ind = torch.compile(model, mode="reduce-overhead")
                row["inductor_fro"] = e2e_us(ind, x)
                row["inductor_cpu"] = cpu_us(ind, x)
        print(f"{cfg}: " + "  ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
        print(f"   {info}")
        print(f"   node choices={dict(collections.Counter(e['choice'] for e in epi.values()))}")
        for node_name, e in epi.items():
            if "conv" not in node_name:  # pooling / mean nodes: show the measurements
                print(f"   {node_name}: {e['choice']} ms={e['ms']} errors={e['errors']}")
        if a.profile and runner is not None:
            print("  fxopt replay:\n" + kernel_table(entry.instances[0].graph.replay))
        torch.compiler.reset()


if __name__ == "__main__":
    main()
