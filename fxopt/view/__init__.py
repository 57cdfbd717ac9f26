"""What fxopt did, as an interactive graph in Google's Model Explorer (``pip install 'fxopt[view]'``).

    report = fxopt.explain(model, x)
    view = fxopt.view.build(report)                   # Model Explorer graphs and overlays
    fxopt.view.write(view, "out/")                    # graph JSON + node-data JSON files
    fxopt.view.show(model, x, profile=True)           # the same, served on localhost

Per compiled graph: the optimized graph (nodes grouped by module and by generated kernel, executors,
convolution algorithms, shapes, dtypes and memory formats) and the graph before the passes; overlays
of measured time per kernel, executor and bytes moved. ``fxopt view`` is the command line.
Model Explorer is imported only when one of these functions runs.
"""
from __future__ import annotations

from fxopt.view.graphs import graph_ids, require
from fxopt.view.serve import View, build, serve, show, url_for, write

__all__ = ["View", "build", "write", "serve", "show", "url_for", "graph_ids", "require", "profile"]


def profile(model, *inputs, options=None, iters: int = 5):
    """(report, Profile): the report of ``model`` and each optimized node's measured time (fxopt.view.profile)."""
    from fxopt.view.profile import profile as _profile

    return _profile(model, *inputs, options=options, iters=iters)
