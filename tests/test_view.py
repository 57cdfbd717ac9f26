"""fxopt.view: a report as Model Explorer graphs and overlays, and the page Model Explorer serves."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fxopt

me = pytest.importorskip("model_explorer", reason="the view extra (ai-edge-model-explorer) is not installed")

from fxopt import view  # noqa: E402
from fxopt.view.graphs import KERNEL_PREFIX, graph_ids, kernel_groups  # noqa: E402


class CatNet(nn.Module):
    """Two branches concatenated (a DenseNet-like join) before a pooled head."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU())
        self.head = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), self.b(x)], 1)).mean((2, 3))


def _models():
    from fxopt.testing.models import SeedCNN

    out = [("seedcnn", SeedCNN().eval(), torch.randn(2, 3, 32, 32)), ("catnet", CatNet().eval(), torch.randn(1, 3, 16, 16))]
    tv = pytest.importorskip("torchvision")
    out.append(("resnet18", tv.models.resnet18().eval(), torch.randn(1, 3, 64, 64)))
    return out


@pytest.fixture(scope="module")
def resnet18_profiled():
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    report, prof = view.profile(tv.models.resnet18().eval(), torch.randn(1, 3, 64, 64), iters=2)
    return report, prof


def _check(report, v):
    graphs = v.graphs
    assert len(graphs) == 2 * len(report.graphs)
    for i, g in enumerate(report.graphs):
        opt_id, before_id = graph_ids(i)
        opt, before = graphs[opt_id], graphs[before_id]
        # every optimized node exactly once, edges between existing nodes only
        ids = [n.id for n in opt.nodes]
        assert sorted(ids) == sorted(n.name for n in g.after.graph.nodes)
        assert len(set(ids)) == len(ids)
        for n in opt.nodes:
            assert all(e.sourceNodeId in set(ids) for e in n.incomingEdges)
        # the graph before the passes, beside it
        assert sorted(n.id for n in before.nodes) == sorted(n.name for n in g.before.graph.nodes)
        # a kernel's group holds exactly its ops
        by_ns: dict = {}
        for n in opt.nodes:
            by_ns.setdefault(n.namespace, set()).add(n.id)
        for k in kernel_groups(g):
            [ns] = [ns for ns in by_ns if ns.split("/")[-1] == KERNEL_PREFIX + k.kernel]
            assert by_ns[ns] == set(k.ops)
        assert all(KERNEL_PREFIX not in ns for ns in by_ns) or kernel_groups(g)
        # overlays are keyed to nodes of the optimized graph
        for name, data in v.overlays.items():
            results = data.graphsData[opt_id].results
            assert set(results) <= set(ids), name
        # modules fold: convolutions sit in their module's namespace
        convs = [n for n in opt.nodes if n.label in ("fused_conv", "convolution")]
        assert convs and all(n.namespace for n in convs)
        assert all(any(a.key == "shape" for a in m.attrs) for n in convs for m in n.outputsMetadata)


@pytest.mark.parametrize("name,model,x", _models(), ids=lambda v: v if isinstance(v, str) else "")
def test_build_cpu(name, model, x):
    report = fxopt.explain(model, x)
    v = view.build(report, label=name)
    _check(report, v)
    opt = v.graphs[graph_ids(0)[0]]
    executors = v.overlays["executor"].graphsData[opt.id].results
    assert {r.value for r in executors.values()} & {"oneDNN", "ONNX Runtime", "ATen", "unoptimized graph"}
    moved = v.overlays["bytes"].graphsData[opt.id].results
    conv = next(n.id for n in opt.nodes if n.label == "fused_conv")
    assert moved[conv].value > x.numel() * 0  # inputs + weights + outputs
    if name == "catnet":
        assert any(n.label == "cat" for n in opt.nodes)
    if name == "resnet18":
        assert any(n.namespace == "layer1/0/conv1" for n in opt.nodes)


def test_kernel_groups():
    """A generated kernel (executor_details["regions"]: region -> kernel and the ops it covers) is a
    group of exactly its ops, inside the module holding them all; its time and bytes sit on its last op."""
    report = fxopt.explain(CatNet().eval(), torch.randn(1, 3, 16, 16), options={"executor": "cuda"})
    g = report.graphs[0]
    cat = next(n for n in g.after.graph.nodes if n.target is torch.ops.aten.cat.default)
    ops = [a.name for a in cat.all_input_nodes] + [cat.name]
    g.executor_details["regions"] = {"fx_region_0": {"kernel": "fx_pw_cat", "ops": ops}}
    groups = kernel_groups(g)
    assert [k.ops for k in groups] == [ops]
    v = view.build(report)
    _check(report, v)
    moved = v.overlays["bytes"].graphsData[graph_ids(0)[0]].results
    assert cat.name in moved and not set(ops[:-1]) & set(moved)


def test_profile_and_files(resnet18_profiled, tmp_path):
    report, prof = resnet18_profiled
    assert prof.clock == "CPU time" and prof.graphs[0]
    path = tmp_path / "profile.json"
    prof.save(str(path))
    v = view.build(report, str(path), label="resnet18")  # a saved profile, as from a GPU run
    _check(report, v)
    times = v.overlays["time"].graphsData[graph_ids(0)[0]].results
    convs = [k for k in times if k.startswith("fused_conv")]
    assert len(convs) >= 10 and all(times[k].value > 0 for k in convs)
    assert v.overlays["time"].graphsData[graph_ids(0)[0]].name == "CPU time (us)"
    manifest = view.write(v, str(tmp_path / "out"))
    data = json.load(open(tmp_path / "out" / manifest["model"]))
    assert data["label"] == "resnet18" and {g["id"] for g in data["graphs"]} == set(v.graphs)
    node_data = json.load(open(tmp_path / "out" / manifest["overlays"]["time"]))
    assert set(node_data) == {graph_ids(0)[0]}


def test_cli_writes_view(tmp_path):
    out = tmp_path / "v"
    r = subprocess.run([sys.executable, "-m", "fxopt.cli", "view", "seedcnn", "--batch", "2", "-o", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    manifest = json.load(open(out / "fxopt-view.json"))
    assert os.path.exists(out / manifest["model"]) and set(manifest["overlays"]) == {"executor", "bytes"}


def test_import_fxopt_does_not_import_model_explorer():
    code = "import sys, fxopt, fxopt.cli; fxopt.cli.build_parser(); print('model_explorer' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_page_renders_in_chromium(resnet18_profiled, tmp_path):
    from fxopt.view.browser import chromium_path, screenshot_dir

    pytest.importorskip("playwright", reason="the playwright package is not installed")
    if chromium_path() is None:
        pytest.skip("no Chromium installed (apt-get install chromium)")
    report, prof = resnet18_profiled
    view.write(view.build(report, prof, label="resnet18"), str(tmp_path / "v"))
    shot = tmp_path / "page.png"
    result = screenshot_dir(str(tmp_path / "v"), str(shot), search="fused_conv")
    assert result["canvas"] and result["webgl"]
    n_convs = sum(1 for n in report.graphs[0].after.graph.nodes if n.name.startswith("fused_conv"))
    assert result["search_matches"] >= n_convs > 0
    assert shot.stat().st_size > 10_000
