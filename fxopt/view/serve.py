"""Writing a view to files (Model Explorer's own serializers) and serving it on localhost.

A written view is a directory: ``<label>.json`` (the graph collection, as Model Explorer's adapter
response serializer writes it, which its JSON loader reads back), ``<label>.<overlay>.json`` per
overlay (``ModelNodeData.save_to_file``), and ``fxopt-view.json`` naming them and the graph to open
first. ``serve(dir)`` starts Model Explorer's server on it (``model_explorer.visualize_from_config``)
and opens the optimized graph, with the graph before the passes in a split pane with ``compare``.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.parse
import urllib.request
import webbrowser
from dataclasses import dataclass, field
from typing import Any, Optional

from fxopt.view.graphs import collection, graph_ids, require

MANIFEST = "fxopt-view.json"


@dataclass
class View:
    """A report as Model Explorer data: the graph collection and the overlays by name."""
    collection: Any
    overlays: dict = field(default_factory=dict)
    label: str = "fxopt"

    @property
    def graphs(self) -> dict:
        return {g.id: g for g in self.collection.graphs}


def build(report, profile=None, label: str = "fxopt") -> View:
    """The Model Explorer graphs of an ``fxopt.explain`` report and their overlays. ``profile``: a
    ``fxopt.view.profile.Profile``, its ``to_json()``, or the path of one saved with ``--save-profile``."""
    from fxopt.view.overlays import load_profile, overlays

    if isinstance(profile, (str, os.PathLike)):
        profile = load_profile(str(profile))
    elif profile is not None and hasattr(profile, "to_json"):
        profile = profile.to_json()
    return View(collection(report, label=label), overlays(report, profile), label=label)


def _safe(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label) or "fxopt"


def write(view: View, out_dir: str) -> dict:
    """Writes the view's files into ``out_dir``; returns the manifest (paths relative to it)."""
    me = require()
    from model_explorer.utils import convert_adapter_response

    os.makedirs(out_dir, exist_ok=True)
    base = _safe(view.label)
    graph_file = f"{base}.json"
    data = convert_adapter_response({"graphCollections": [view.collection]})["graphCollections"][0]
    with open(os.path.join(out_dir, graph_file), "w") as f:
        json.dump(data, f)
    files = {}
    for name, node_data in view.overlays.items():
        files[name] = f"{base}.{name}.json"
        node_data.save_to_file(os.path.join(out_dir, files[name]), indent=None)
    ids = [g.id for g in view.collection.graphs]
    manifest = {"model": graph_file, "label": view.collection.label, "overlays": files, "optimized": ids[0] if ids else "",
                "before": ids[1] if len(ids) > 1 else "", "model_explorer": me.__version__}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _config(out_dir: str, overlays: Optional[list] = None):
    """Model Explorer's config for a written view (the graph file and its overlays)."""
    me = require()
    with open(os.path.join(out_dir, MANIFEST)) as f:
        manifest = json.load(f)
    model = os.path.abspath(os.path.join(out_dir, manifest["model"]))
    config = me.config()
    config.add_model_from_path(model, adapterId="builtin_json")
    for name, path in manifest["overlays"].items():
        if overlays is None or name in overlays:
            # Model Explorer matches node data to a model by its collection's label
            config.add_node_data_from_path(os.path.abspath(os.path.join(out_dir, path)),
                                           model_name=manifest.get("label", ""))
    return config, manifest


def url_for(out_dir: str, host: str, port: int, compare: bool = False, graph: Optional[str] = None,
            overlays: Optional[list] = None) -> str:
    """The page showing a written view: the optimized graph (or ``graph``), with the graph before
    the passes beside it when ``compare``; ``overlays``: the ones to load (default all)."""
    config, manifest = _config(out_dir, overlays)
    data = json.loads(urllib.parse.unquote(config.to_url_param_value()))

    def pane(gid: str, width: float, selected: bool) -> dict:
        return {"deepestExpandedGroupNodeIds": [], "selectedNodeId": "", "selectedGraphId": gid,
                "selectedCollectionLabel": "", "widthFraction": width, "flattenLayers": False, "selected": selected}

    first = graph or manifest["optimized"]
    panes = [pane(first, 1, True)]
    if compare and manifest["before"]:
        panes = [pane(first, 0.5, True), pane(manifest["before"], 0.5, False)]
    data["uiState"] = {"paneStates": panes}
    return f"http://{host}:{port}/?data={urllib.parse.quote(json.dumps(data))}"


def free_port(host: str = "localhost", start: int = 8080) -> int:
    for port in range(start, start + 100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex((host, port)) != 0:
                return port
    raise RuntimeError(f"no free port in {start}..{start + 99}")


def wait_until_up(host: str, port: int, timeout: float = 30.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/check_health", timeout=2) as r:
                if r.read() == b"model_explorer_ok":
                    return True
        except OSError:
            time.sleep(0.2)
    return False


def serve(out_dir: str, host: str = "localhost", port: Optional[int] = None, open_browser: bool = True,
          compare: bool = False) -> None:
    """Serves a written view with Model Explorer's server until interrupted (Ctrl+C)."""
    me = require()
    port = port or free_port(host)
    config, _ = _config(out_dir)
    url = url_for(out_dir, host, port, compare=compare)

    def announce():
        if wait_until_up(host, port):
            print(f"\nfxopt view: {url}\n", flush=True)
            if open_browser:
                webbrowser.open_new_tab(url)

    threading.Thread(target=announce, daemon=True).start()
    me.visualize_from_config(config, host=host, port=port, no_open_in_browser=True)


def show(model, *inputs, options=None, profile: bool = False, out_dir: Optional[str] = None,
         label: Optional[str] = None, **serve_args) -> None:
    """Explain ``model`` on ``inputs`` (profiling it with ``profile``), write the view and serve it."""
    import tempfile

    import fxopt

    if profile:
        from fxopt.view.profile import profile as run_profile

        report, prof = run_profile(model, *inputs, options=options)
    else:
        report, prof = fxopt.explain(model, *inputs, options=options), None
    view = build(report, prof, label=label or type(model).__name__)
    out_dir = out_dir or tempfile.mkdtemp(prefix="fxopt-view-")
    write(view, out_dir)
    serve(out_dir, **serve_args)


__all__ = ["View", "build", "write", "serve", "show", "url_for", "graph_ids", "free_port", "wait_until_up"]
