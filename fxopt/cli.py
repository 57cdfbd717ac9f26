"""The ``fxopt`` command: ``fxopt explain``, ``fxopt export``, ``fxopt package``, ``fxopt run``,
``fxopt bench``, ``fxopt diagnose``, ``fxopt fuzz``.

Each subcommand is one ``add_<name>(sub)`` that declares its parser and sets ``run`` to the
function doing the work; ``SUBCOMMANDS`` lists them in the order ``fxopt --help`` shows. A
subcommand that owns its own parser (``bench``) takes the rest of the command line as it is.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from fxopt.modelspec import (DTYPES, add_model_arguments, load_model, model_and_input, non_negative_int, options_json,
                             parse_shape)

__all__ = ["main", "build_parser", "DTYPES", "load_model", "parse_shape"]


def cmd_explain(args) -> int:
    import fxopt

    model, x = model_and_input(args)
    with torch.no_grad():
        report = fxopt.explain(model, x, options=args.options, dynamic=args.dynamic)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 0


def add_explain(sub) -> None:
    p = sub.add_parser("explain", help="show what every pass does to a model")
    add_model_arguments(p)
    p.add_argument("--options", type=options_json,
                   help="fxopt options as JSON, e.g. '{\"layout\": \"channels_last\"}'")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--dynamic", action="store_true",
                   help="compile with symbolic sizes (torch.compile(dynamic=True)) and run the input and its batch "
                        "plus one: which dimensions are symbolic, which sizes were specialized and their cost")
    p.set_defaults(run=cmd_explain)


def cmd_export(args) -> int:
    import fxopt

    model, x = model_and_input(args)
    with torch.no_grad():
        fxopt.export_onnx(model, (x,), args.output, options=args.options, dynamic_batch=not args.static)
    print(f"wrote {args.output}")
    return 0


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write the optimized graph as ONNX")
    add_model_arguments(p)
    p.add_argument("--options", type=options_json,
                   help="fxopt options as JSON, e.g. '{\"layout\": \"channels_last\"}'")
    p.add_argument("-o", "--output", required=True, help="path of the .onnx file")
    p.add_argument("--static", action="store_true", help="fixed batch size (default: dynamic batch)")
    p.set_defaults(run=cmd_export)


def cmd_package(args) -> int:
    import fxopt

    model, x = model_and_input(args)
    with torch.no_grad():
        summary = fxopt.package(model, (x,), args.output, options=args.options, dynamic_batch=not args.static)
    batch = summary["batch"]
    print(f"wrote {args.output} ({summary['bytes'] / 2**20:.1f} MiB, batch "
          f"{'dynamic' if batch['dynamic'] else 'fixed at ' + str(batch['example'])}) in {summary['timings']['total_s']:.1f} s")
    return 0


def cmd_run(args) -> int:
    """Load a package (no torch.compile), time its calls on random inputs of ``--shape``."""
    import time

    import fxopt

    t0 = time.perf_counter()
    module = fxopt.load(args.package, device=args.device)
    load_s = time.perf_counter() - t0
    with torch.no_grad():
        times, first_s = _time_calls(module, args)
    print(module.summary())
    print(f"load {load_s:.3f} s, first call {first_s:.3f} s; {args.iters} calls: median {times[len(times) // 2]:.3f} ms"
          f" (min {times[0]:.3f}, max {times[-1]:.3f})" if times else f"load {load_s:.3f} s, first call {first_s:.3f} s")
    return 0


def _time_calls(module, args) -> tuple[list, float]:
    """The first call's seconds and the sorted milliseconds of ``args.iters`` further calls."""
    import time

    spec = module.input_specs[0]
    x = torch.randn(args.shape, device=module.device, dtype=getattr(torch, spec["dtype"]))
    sync = torch.cuda.synchronize if module.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    module(x)
    sync()
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        module(x)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times), first_s


def add_package(sub) -> None:
    p = sub.add_parser("package", help="write the optimized model as one file that fxopt run / fxopt.load run")
    add_model_arguments(p)
    p.add_argument("--options", type=options_json, help="fxopt options as JSON")
    p.add_argument("--static", action="store_true", help="fixed batch size (default: dynamic batch)")
    p.add_argument("-o", "--output", required=True, help="path of the package (.fxopt)")
    p.set_defaults(run=cmd_package)


def add_run(sub) -> None:
    p = sub.add_parser("run", help="load a package (no torch.compile) and time it")
    p.add_argument("package", help="path of a .fxopt package")
    p.add_argument("--shape", type=parse_shape, required=True, help="input shape, e.g. 1,3,224,224")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: where it was packaged")
    p.add_argument("--iters", type=non_negative_int, default=20, help="timed calls after the first (default 20)")
    p.set_defaults(run=cmd_run)


def cmd_bench(args) -> int:
    from fxopt.bench import main as bench_main

    return bench_main(args.rest)


def add_bench(sub) -> None:
    # the harness parses its own options (python -m fxopt.bench --help), --help included
    p = sub.add_parser("bench", add_help=False,
                       help="benchmark against eager, Inductor and ONNX Runtime (fxopt bench --help)")
    p.set_defaults(run=cmd_bench, takes_rest=True)


def cmd_diagnose(args) -> int:
    return args.diagnostic(args)


def add_diagnose(sub) -> None:
    from fxopt import diagnose

    p = sub.add_parser("diagnose", help="where a compiled model's time goes (fxopt diagnose --help)",
                       description=diagnose.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    diagnose.add_subcommands(p)
    p.set_defaults(run=cmd_diagnose)


def add_view(sub) -> None:
    from fxopt.view.command import add_view as add  # imports no Model Explorer until it runs

    add(sub)


def cmd_fuzz(args) -> int:
    from fxopt.fuzz import merge, run_fuzz

    if args.merge:
        merged = merge(args.merge, out=args.out)
        return 1 if merged["failures"] else 0
    if args.jobs > 1:
        from fxopt.fuzz.parallel import run_jobs

        if args.shard != "0/1":
            raise SystemExit("--jobs N runs the shards 0/N .. N-1/N itself: no --shard with it")
        return run_jobs(args.jobs, args.out or "fuzz-out", _fuzz_arguments(args), args.threads,
                        30.0 if args.progress is None else args.progress)
    i, n = (int(v) for v in args.shard.split("/"))
    if not 0 <= i < n:
        raise SystemExit(f"--shard {args.shard}: expected i/n with 0 <= i < n")
    if args.threads:
        torch.set_num_threads(args.threads)
    summary = run_fuzz(args.device, fuzz_examples(args), args.seed, args.time_budget, args.out or "fuzz-out", (i, n),
                       executors=args.executor or None, progress=args.progress, restart=args.restart)
    return 1 if summary["failures"] else 0


#: graphs a fuzz run draws without --examples or --time-budget
DEFAULT_FUZZ_EXAMPLES = 200
#: without --examples, a run with a time budget draws until the budget is spent (this many at most)
BUDGETED_FUZZ_EXAMPLES = 10_000_000


def fuzz_examples(args) -> int:
    """The graphs to draw over all shards: ``--examples`` where given; else, under a time budget,
    as many as it allows (a budget alone used to stop at the default 200); else the default."""
    if args.examples is not None:
        return args.examples
    return BUDGETED_FUZZ_EXAMPLES if args.time_budget is not None else DEFAULT_FUZZ_EXAMPLES


def _fuzz_arguments(args) -> list:
    """The arguments every shard of a ``--jobs`` run gets."""
    out = ["--device", args.device, "--examples", str(fuzz_examples(args)), "--seed", str(args.seed),
           "--out", args.out or "fuzz-out"]
    out += ["--time-budget", f"{args.time_budget:g}"] if args.time_budget is not None else []
    return out + [a for e in args.executor or [] for a in ("--executor", e)]


def add_fuzz(sub) -> None:
    p = sub.add_parser("fuzz", help="random CNN graphs through the whole backend against eager (fxopt.fuzz)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--examples", type=non_negative_int, default=None,
                   help=f"graphs over all shards (default: {DEFAULT_FUZZ_EXAMPLES}; with --time-budget, as many as "
                        "the budget allows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None, help="stop drawing graphs after SECONDS (per shard)")
    p.add_argument("--out", default=None, help="directory of summaries, coverage and reproducers (default fuzz-out)")
    p.add_argument("--shard", default="0/1", help="i/n: this run's share of the examples and its seeds")
    p.add_argument("--jobs", type=non_negative_int, default=1,
                   help="run the shards 0/N .. N-1/N as N processes at once, then merge them (fxopt.fuzz.parallel)")
    p.add_argument("--threads", type=non_negative_int, default=0,
                   help="CPU threads of each process (default: all for one process, cores / N for --jobs N)")
    p.add_argument("--progress", type=float, default=None, help="a progress line at most every SECONDS")
    p.add_argument("--executor", action="append", choices=["cpu", "torch", "cuda"],
                   help="executors to draw (default: cuda on a GPU; cpu, torch and cuda's CPU checks on the CPU)")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="add up the shards' summaries under DIR... instead")
    p.add_argument("--restart", type=non_negative_int, default=0,
                   help="K > 0: this shard again after a failure left its process unusable (other seeds; "
                        "output under restart-K; --jobs does this itself)")
    p.set_defaults(run=cmd_fuzz)


SUBCOMMANDS = [add_explain, add_export, add_package, add_run, add_bench, add_diagnose, add_view, add_fuzz]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fxopt", description="fxopt: an optimizing compiler for CNNs")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_rest", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
