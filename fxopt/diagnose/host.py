"""``fxopt diagnose host``: where the time of one compiled call goes.

    fxopt diagnose host seedcnn --batch 1 --device cuda [--choices] [--kernels] [--inductor]

Prints, in µs per call (``call``: as the benchmark times it; ``*_host``: host time to issue it,
calls back to back, best of 3 interleaved repeats):

- ``call``, ``host``: the compiled model; ``host`` close to ``call`` means the call is bound by
  Python and launches, not by the device;
- ``entry_host``: Dynamo + AOTAutograd around a compiled graph that does nothing, the per-call
  cost of ``torch.compile`` itself, which every backend pays.

With fxopt's CUDA-graph runner (CUDA inference) also:

- ``runner``, ``runner_host``: the runner called directly, without Dynamo and AOTAutograd;
- ``replay``, ``replay_host``: the captured CUDA graph replayed alone (its kernels + the launch);
- ``check_host``: the runner's per-call check of the weights it reads;
- ``wrappers_host``: Dynamo + AOTAutograd around a runner that returns at once;

and the runner's replay decision. Then the executor's choice per node (``--choices``: every
candidate's time); ``--kernels``: the kernels of one replay by GPU time (``--rows N`` of them;
kernels launched early wait inside their predecessor's time, so their times overlap: ``FXOPT_PDL=0``
for times without); ``--inductor``: Inductor (freezing, reduce-overhead) beside it, and with
``--kernels`` Inductor's kernels of one call too (on a thread of its own, so with the cuDNN plans
its own first calls chose); ``--cprofile N``: the N functions with the most
own time over 1000 calls of the compiled model.
"""
from __future__ import annotations

import collections

import torch

from fxopt.diagnose.timing import call_us, host_us, profiled, sync
from fxopt.modelspec import add_model_arguments, model_and_input, options_json

HELP = "one call's time split: Dynamo's entry, fxopt's runner, the CUDA-graph replay"


def add_arguments(p) -> None:
    add_model_arguments(p, suite=True, device="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--options", type=options_json, default={}, help="fxopt options as JSON")
    p.add_argument("--choices", action="store_true", help="every measured candidate per node")
    p.add_argument("--kernels", action="store_true", help="the kernels of one CUDA-graph replay")
    p.add_argument("--inductor", action="store_true", help="Inductor (freezing, reduce-overhead) beside it "
                   "(with --kernels: its kernels too)")
    p.add_argument("--rows", type=int, default=12, metavar="N", help="--kernels: the N kernels with the most time")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="profile 1000 calls: N functions")


def entry_host_us(model, x, device: str) -> float:
    """Dynamo + AOTAutograd per call around a compiled graph that only returns the outputs."""
    from torch._dynamo.backends.common import aot_autograd

    ref = model(x)

    def inference(gm, args):
        def run(a):
            a.clear()
            return (ref,)
        run._boxed_call = True
        return run

    torch.compiler.reset()
    compiled = torch.compile(model, backend=lambda gm, ex: aot_autograd(
        fw_compiler=inference, inference_compiler=inference)(gm, ex))
    return host_us(compiled, x, device, calls=300)


def _recording(runner) -> None:
    """Make the runner keep the flat argument list Dynamo and AOTAutograd hand it."""
    class Recording(type(runner)):
        def __call__(self, *args):
            self.last_args = args
            return super().__call__(*args)

    runner.__class__ = Recording


def runner_split(runner, compiled, x, device: str) -> tuple[dict, str]:
    """The runner's, the replay's and the wrappers' share of a call; the runner's state."""
    _recording(runner)
    compiled(x)
    args = runner.last_args
    real = type(runner).__mro__[1]
    runner.__class__ = real
    entry = next(iter(runner.graphs.values()))
    replay = entry.instances[0].graph.replay
    row = {"runner": call_us(lambda _: runner(*args), x, device),
           "replay": call_us(lambda _: replay(), x, device)}
    outs = runner._replay(entry, args)
    trivial = type("Trivial", (real,), {"__call__": lambda self, *a: outs})
    host = collections.defaultdict(list)
    for _ in range(3):  # interleaved: the host's speed drifts
        runner.__class__ = real
        host["runner_host"].append(host_us(lambda _: runner(*args), x, device))
        host["replay_host"].append(host_us(lambda _: replay(), x, device))
        host["check_host"].append(host_us(lambda _: runner.watch.check(args), x, device))
        runner.__class__ = trivial  # Dynamo + AOTAutograd + boxing around a runner doing nothing
        host["wrappers_host"].append(host_us(compiled, x, device))
    runner.__class__ = real
    row.update({k: min(v) for k, v in host.items()})
    state = (f"decisions={runner.decisions()} watched={len(runner.watch.indices)}/{len(runner.static)} "
             f"versioned={len(runner.watch.version_indices)} fast_path={runner._fast is not None}")
    return row, state


def kernel_table(fn, rows: int = 12, title: str = "replay") -> str:
    """The kernels of 10 calls of ``fn``, by GPU time per call."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0)]
    total = sum(e.device_time_total for e in events) / 10
    lines = [f"  kernels per {title} {sum(e.count for e in events) / 10:.0f}, GPU µs per {title} {total:.1f}"]
    for e in sorted(events, key=lambda e: -e.device_time_total)[:rows]:
        lines.append(f"  {e.device_time_total / 10:8.1f} µs  x{e.count / 10:4.0f}  {e.key[:90]}")
    return "\n".join(lines)


def _inductor_row(model, x, args, row: dict) -> str:
    """Inductor (freezing, reduce-overhead) timed into ``row``; its kernel table with ``--kernels``."""
    torch.compiler.reset()
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        ind = torch.compile(model, mode="reduce-overhead")
        row["inductor_freezing_ro"] = call_us(ind, x, args.device)
        row["inductor_host"] = host_us(ind, x, args.device)
        table = ""
        if args.kernels and args.device == "cuda":
            table = "\n  Inductor (freezing, reduce-overhead):\n" + kernel_table(lambda: ind(x), args.rows, "call")
    torch.compiler.reset()  # its CUDA graphs belong to this thread
    return table


def run(args) -> int:
    from fxopt.testing import compile_with_fxopt

    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    model, x = model_and_input(args)
    graphs: list = []
    compiled = compile_with_fxopt(model, args.options, graphs)
    with torch.no_grad():
        row = {"call": call_us(compiled, x, args.device), "host": host_us(compiled, x, args.device)}
        g = graphs[0]
        runner = g.executor_details.get("cudagraph_runner")
        state = f"executor={g.executor} cudagraphs={g.cudagraphs} compile={g.compile_ms / 1e3:.1f}s"
        if runner is not None:
            split, runner_state = runner_split(runner, compiled, x, args.device)
            row.update(split)
            state += " " + runner_state
        with profiled(args.cprofile) as prof:
            for _ in range(1000 if args.cprofile else 0):
                compiled(x)
            sync(args.device)
        kernels = ""
        if args.kernels and runner is not None:
            kernels = kernel_table(next(iter(runner.graphs.values())).instances[0].graph.replay, args.rows)
        row["entry_host"] = entry_host_us(model, x, args.device)
        if args.inductor:  # on a thread of its own: torch caches cuDNN's plans per thread
            from fxopt.bench.runners import BackendThread

            worker = BackendThread("inductor")
            try:
                kernels += worker(_inductor_row, model, x, args, row)
            finally:
                worker.close()
    torch.compiler.reset()
    print(f"{args.model} {args.dtype} {tuple(x.shape)} {args.device}, µs per call: "
          + "  ".join(f"{k}={v:.1f}" for k, v in row.items()))
    print(f"  {state}")
    choices = g.executor_details.get("node_choices", {})
    if choices:
        print(f"  node choices {dict(collections.Counter(e['choice'] for e in choices.values()))}")
    for name, e in choices.items() if args.choices else ():
        ms = " ".join(f"{k}={v * 1e3:.2f}µs" for k, v in sorted(e.get("ms", {}).items(), key=lambda kv: kv[1]))
        print(f"  {name}: {e.get('choice')} | {ms}")
    if args.kernels and runner is None:
        print("  --kernels: no CUDA-graph replay to profile (CUDA inference only)")
    if kernels:
        print(kernels)
    if prof.text:
        print(prof.text)
    return 0
