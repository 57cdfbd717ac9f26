"""``fxopt view``: the optimized graph of a model in Model Explorer.

    fxopt view torchvision.models:resnet18 --shape 1,3,224,224 [--dtype D] [--device cuda] [--profile]
               [--save-profile F | --profile-from F] [--compare] [--port N] [--no-browser] [-o DIR]
    fxopt view DIR                     # serve a view written before with -o
"""
from __future__ import annotations

import argparse
import os

from fxopt.modelspec import add_model_arguments, model_and_input, options_json


def cmd_view(args) -> int:
    from fxopt import view
    from fxopt.view.serve import MANIFEST

    view.require()
    if os.path.isfile(os.path.join(args.model, MANIFEST)):
        view.serve(args.model, port=args.port, open_browser=not args.no_browser, compare=args.compare)
        return 0
    model, x = model_and_input(args)
    prof = args.profile_from
    if args.profile or args.save_profile:
        report, measured = view.profile(model, x, options=args.options)
        if args.save_profile:
            measured.save(args.save_profile)
            print(f"wrote {args.save_profile} ({measured.clock})")
        prof = prof or measured
    else:
        import fxopt

        report = fxopt.explain(model, x, options=args.options)
    label = args.model.split(":")[-1].split(".")[-1]
    out_dir = args.output
    if out_dir is None:
        import tempfile

        out_dir = tempfile.mkdtemp(prefix=f"fxopt-view-{label}-")
    view.write(view.build(report, prof, label=label), out_dir)
    print(f"wrote {out_dir}")
    if args.output is None or args.serve:
        view.serve(out_dir, port=args.port, open_browser=not args.no_browser, compare=args.compare)
    return 0


def add_view(sub) -> None:
    p = sub.add_parser("view", help="the optimized graph in Model Explorer (pip install 'fxopt[view]')",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, suite=True)
    p.add_argument("--options", type=options_json, help="fxopt options as JSON")
    p.add_argument("--profile", action="store_true",
                   help="measure each kernel's time (torch.profiler: GPU time on CUDA, CPU time on the CPU)")
    p.add_argument("--save-profile", metavar="F", help="write the measured times as JSON (implies --profile)")
    p.add_argument("--profile-from", metavar="F", help="the time overlay from a profile saved with --save-profile")
    p.add_argument("--compare", action="store_true", help="open the graph before the passes beside the optimized one")
    p.add_argument("--port", type=int, default=None, help="server port (default: the first free from 8080)")
    p.add_argument("--no-browser", action="store_true", help="print the page's address, open no browser")
    p.add_argument("-o", "--output", metavar="DIR", help="write the graph and overlay JSON files here, serve nothing")
    p.add_argument("--serve", action="store_true", help="with -o: serve the written view too")
    p.set_defaults(run=cmd_view)
