"""The ``fxopt`` command: ``fxopt explain``, ``fxopt export``, ``fxopt bench``, ``fxopt diagnose``.

Each subcommand is one ``add_<name>(sub)`` that declares its parser and sets ``run`` to the
function doing the work; ``SUBCOMMANDS`` lists them in the order ``fxopt --help`` shows. A
subcommand that owns its own parser (``bench``) takes the rest of the command line as it is.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from fxopt.modelspec import DTYPES, add_model_arguments, load_model, model_and_input, options_json, parse_shape

__all__ = ["main", "build_parser", "DTYPES", "load_model", "parse_shape"]


def cmd_explain(args) -> int:
    import fxopt

    model, x = model_and_input(args)
    with torch.no_grad():
        report = fxopt.explain(model, x, options=args.options)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 0


def add_explain(sub) -> None:
    p = sub.add_parser("explain", help="show what every pass does to a model")
    add_model_arguments(p)
    p.add_argument("--options", type=options_json,
                   help="fxopt options as JSON, e.g. '{\"layout\": \"channels_last\"}'")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
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


SUBCOMMANDS = [add_explain, add_export, add_bench, add_diagnose]


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
