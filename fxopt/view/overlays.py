"""Per-node data overlays for the optimized graphs (``model_explorer.node_data_builder``).

- ``time``: measured microseconds per kernel (``fxopt.view.profile``: GPU time on CUDA, CPU time
  on the CPU; the overlay's name says which), or a profile saved earlier (``load_profile``);
- ``executor``: what runs each op (generated, cuDNN, cuBLAS, oneDNN, ONNX Runtime, ATen, reference);
- ``bytes``: bytes a kernel reads and writes, from the FakeTensor metadata (its tensor inputs and
  outputs; views, item accesses and the folded constants, evaluated once, move none).

A generated kernel covers several ops: its time and bytes are shown on its last op (the group's
other ops carry none), so a layer's sum in Model Explorer's statistics counts each kernel once.
"""
from __future__ import annotations

import json
import operator
from typing import Any, Optional

import torch.fx as fx

from fxopt.names import FOLDED_CONSTANTS_MODULE
from fxopt.view.graphs import graph_ids, kernel_groups, nbytes, node_executors, op_name, require, tensors

#: executor -> node colour in the executor overlay
EXECUTOR_COLORS = {"generated": "#ff9800", "cuDNN": "#4caf50", "cuBLAS": "#2e7d32", "oneDNN": "#2196f3",
                   "ONNX Runtime": "#9c27b0", "ATen": "#bdbdbd", "reference": "#f44336",
                   "unoptimized graph": "#795548"}
#: white -> yellow -> red: the slowest (or heaviest) kernels light up
HEAT = (("#ffffff", 0.0), ("#ffeb3b", 0.5), ("#e53935", 1.0))


def _gradient(me) -> list:
    ndb = me.node_data_builder
    return [ndb.GradientItem(stop=s, bgColor=c) for c, s in HEAT]


def _moves_bytes(node: fx.Node) -> bool:
    if node.op == "call_module":
        return node.target != FOLDED_CONSTANTS_MODULE
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    return not getattr(node.target, "is_view", False)


def _bytes_of(nodes, inside: set) -> int:
    """Bytes read from outside ``inside`` plus bytes written that are read outside it (or returned)."""
    read, total = set(), 0
    for node in nodes:
        for a in node.all_input_nodes:
            if a.name not in inside and a.name not in read:
                read.add(a.name)
                total += sum(nbytes(t) for t in tensors(a.meta.get("val")))
        if any(u.name not in inside for u in node.users) or not node.users:
            total += sum(nbytes(t) for t in tensors(node.meta.get("val")))
    return total


def bytes_moved(g) -> dict[str, int]:
    """Node name -> bytes its kernel reads and writes (a generated kernel's on its last op)."""
    by_name = {n.name: n for n in g.after.graph.nodes}
    out, covered = {}, set()
    for k in kernel_groups(g):
        out[k.anchor] = _bytes_of([by_name[o] for o in k.ops], set(k.ops))
        covered |= set(k.ops)
    for node in g.after.graph.nodes:
        if node.name not in covered and _moves_bytes(node):
            out[node.name] = _bytes_of([node], {node.name})
    return out


def load_profile(path: str) -> dict:
    """A profile saved by ``fxopt view --profile --save-profile F`` (``Profile.to_json``):
    {"clock": "GPU time" | "CPU time", "device": ..., "graphs": {"0": {node name: microseconds}}};
    a plain {node name: microseconds} is taken for graph 0 (CPU time unless "clock" says otherwise)."""
    with open(path) as f:
        data = json.load(f)
    if "graphs" not in data:
        data = {"clock": "CPU time", "graphs": {"0": {k: v for k, v in data.items() if isinstance(v, (int, float))}}}
    return data


def _node_data(me, results: dict, name: str, numeric: bool) -> Any:
    ndb = me.node_data_builder
    if numeric:
        return ndb.GraphNodeData(results={k: ndb.NodeDataResult(value=round(float(v), 3)) for k, v in results.items()},
                                 name=name, gradient=_gradient(me))
    return ndb.GraphNodeData(results={k: ndb.NodeDataResult(value=v, bgColor=EXECUTOR_COLORS.get(v, "#e0e0e0"))
                                      for k, v in results.items()}, name=name)


def overlays(report, profile: Optional[dict] = None) -> dict[str, Any]:
    """Overlay name -> ``node_data_builder.ModelNodeData`` for the optimized graphs of ``report``.
    ``profile``: ``Profile.to_json()`` or ``load_profile(path)``; its node names that are not nodes
    of the optimized graph are dropped."""
    me = require()
    ndb = me.node_data_builder
    out = {}
    executors, moved, times = {}, {}, {}
    clock = (profile or {}).get("clock", "CPU time")
    for i, g in enumerate(report.graphs):
        gid = graph_ids(i)[0]
        names = {n.name for n in g.after.graph.nodes}
        executors[gid] = _node_data(me, node_executors(g), "executor", numeric=False)
        moved[gid] = _node_data(me, bytes_moved(g), "bytes moved", numeric=True)
        if profile is not None:
            per_node = (profile.get("graphs") or {}).get(str(i)) or {}
            times[gid] = _node_data(me, {k: v for k, v in per_node.items() if k in names},
                                    f"{clock} (us)", numeric=True)
    # Model Explorer shows the last overlay loaded: time where measured
    out["executor"] = ndb.ModelNodeData(graphsData=executors)
    out["bytes"] = ndb.ModelNodeData(graphsData=moved)
    if times:
        out["time"] = ndb.ModelNodeData(graphsData=times)
    return out


__all__ = ["overlays", "bytes_moved", "load_profile", "EXECUTOR_COLORS", "op_name"]
