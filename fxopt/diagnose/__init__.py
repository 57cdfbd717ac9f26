"""Where the time of a compiled model goes: ``fxopt diagnose DIAGNOSTIC MODEL [options]``.

MODEL is a benchmark suite model (seedcnn, resnet50, ...) or MODULE:ATTR with --shape. Run each in
a fresh process (this command is one): a second compile in a process finds imports and caches warm.
Each diagnostic is one module of this package (``DIAGNOSTICS``); they time calls the same way
(``fxopt.diagnose.timing``).
"""
from __future__ import annotations

import argparse

from fxopt.diagnose import autotune, compile_time, host, timeline

#: subcommand name -> module with HELP, add_arguments(parser) and run(args) -> int
DIAGNOSTICS = {"host": host, "compile": compile_time, "autotune": autotune, "timeline": timeline}


def add_subcommands(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="diagnostic_name", required=True, metavar="DIAGNOSTIC")
    for name, module in DIAGNOSTICS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(diagnostic=module.run)
