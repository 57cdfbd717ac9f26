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


@pytest.mark.parametrize("name,model,x", _models()[:2], ids=lambda v: v if isinstance(v, str) else "")
def test_build_cpu(name, model, x):  # ResNet-18 on the CPU: the profiled one below
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


@pytest.mark.parametrize("name,model,x", _models(), ids=lambda v: v if isinstance(v, str) else "")
def test_cuda_executor_kernel_groups(name, model, x):
    """The cuda executor planned on CPU tensors (kernels generated, the reference runs): each region
    names the optimized-graph nodes it computes, and its kernel is a group of exactly those (a node
    several kernels recompute: in the first one's); the measured node groups name theirs too."""
    report = fxopt.explain(model, x, options={"executor": "cuda"})
    for g in report.graphs:
        after = {n.name for n in g.after.graph.nodes}
        regions = g.executor_details.get("regions") or {}
        groups = {k.region: k for k in kernel_groups(g)}
        claimed: set = set()
        for region, r in regions.items():
            assert r["nodes"] and set(r["nodes"]) <= after, (region, r)
            # its generated kernel (named after it, with the variant) lists the same nodes, compiled here
            assert [k.nodes for k in g.kernels if k.name.startswith(r["kernel"] + "_")] == [r["nodes"]]
            assert groups[region].kernel == r["kernel"] and groups[region].compiled is not None
            assert set(groups[region].ops) == set(r["nodes"]) - claimed
            claimed |= set(r["nodes"])
        assert {o for k in groups.values() for o in k.ops} == claimed
        # a per-node template kernel names its node; a node group its nodes
        assert all(set(k.nodes) <= after for k in g.kernels) and any(k.nodes for k in g.kernels)
        for key, grp in (g.executor_details.get("node_groups") or {}).items():
            assert set(grp["nodes"]) <= after and len(grp["nodes"]) >= 2 and grp["kernels"], key
    g = report.graphs[0]
    if name == "catnet":  # the concatenation and the conv epilogues it computes
        [r] = [r for r in g.executor_details["regions"].values() if "aten.cat.default" in r["ops"]]
        cat = next(n for n in g.after.graph.nodes if n.target is torch.ops.aten.cat.default)
        assert cat.name in r["nodes"] and {a.name for a in cat.all_input_nodes} <= set(r["nodes"])
    if name == "resnet18":
        assert any("aten.mean.dim" in r["ops"] for r in g.executor_details["regions"].values())
    groups = g.executor_details.get("node_groups") or {}
    if name == "seedcnn":  # conv + max pool: a group where its kernel wins (as measured on a GPU)
        key, grp = next(iter(groups.items()))
        choice, kernels = next(iter(grp["kernels"].items()))
        g.executor_details["node_choices"] = {key: {"choice": choice, "ms": {"reference": 2.0, choice: 1.0}}}
        [k] = [k for k in kernel_groups(g) if k.region == key]
        assert set(k.ops) == set(grp["nodes"]) and k.kernel == " + ".join(kernels)
    v = view.build(report, label=name)
    _check(report, v)
    opt = v.graphs[graph_ids(0)[0]]
    in_groups = {n.id for n in opt.nodes if KERNEL_PREFIX in n.namespace}
    assert in_groups == {o for k in kernel_groups(g) for o in k.ops}
    assert bool(in_groups) == (name != "seedcnn" or bool(groups))


def test_kernel_groups():
    """A report whose regions list their ops by node name (no "nodes"): a group of exactly those
    ops, inside the module holding them all; its time and bytes sit on its last op."""
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
    opt = v.graphs[graph_ids(0)[0]]
    assert any(n.namespace == "layer1/0/conv1" for n in opt.nodes)
    executors = {r.value for r in v.overlays["executor"].graphsData[opt.id].results.values()}
    assert executors & {"oneDNN", "ONNX Runtime", "ATen", "unoptimized graph"}
    manifest = view.write(v, str(tmp_path / "out"))
    data = json.load(open(tmp_path / "out" / manifest["model"]))
    assert data["label"] == "resnet18" and {g["id"] for g in data["graphs"]} == set(v.graphs)
    node_data = json.load(open(tmp_path / "out" / manifest["overlays"]["time"]))
    assert set(node_data) == {graph_ids(0)[0]}


def test_cli_writes_view(tmp_path, capsys):
    from fxopt.cli import main

    # the command's own function in this process (tests/test_backend.py runs ``python -m fxopt.cli``)
    out = tmp_path / "v"
    assert main(["view", "seedcnn", "--batch", "2", "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
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
