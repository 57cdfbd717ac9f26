"""Measured time per node of a compiled model (``torch.profiler``), for the ``time`` overlay.

``profile(model, *inputs, options)`` compiles the model as ``fxopt.explain`` does (same report),
then runs each optimized graph as its executor lowered it (oneDNN convolutions, generated kernels,
library calls), node by node, with ``record_function`` around each node, on the tensors Dynamo
handed the backend (the real parameters and inputs). A node's time is what the profiler records
inside its range: the device time of the kernels it launched on CUDA ("GPU time"), the CPU time on
the CPU ("CPU time"). A generated kernel's time is its last op's. The graph runs without its
CUDA-graph replay or the runner's choice between graphs (ONNX Runtime, the unoptimized graph):
the report's ``runs`` attribute says what the runner chose.
"""
from __future__ import annotations

import json
import operator
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from fxopt.view.graphs import details, kernel_groups, runnable_of

PREFIX = "fxopt_view::"


@dataclass
class Profile:
    """Per graph: node name -> microseconds per call; ``clock``: "GPU time" or "CPU time"."""
    clock: str
    device: str
    graphs: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"clock": self.clock, "device": self.device, "notes": self.notes,
                "graphs": {str(i): {k: round(v, 3) for k, v in t.items()} for i, t in self.graphs.items()}}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)


def node_labels(g, runnable: fx.GraphModule) -> dict[str, str]:
    """Runnable node name -> the optimized-graph node its time belongs to: the same name, the same
    value (a node an executor replaced keeps its metadata), or a generated kernel's last op (a
    convolution whose epilogue moved into a kernel keeps its own: cuDNN runs it)."""
    after = {n.name: n for n in g.after.graph.nodes}
    by_val = {id(n.meta["val"]): n.name for n in g.after.graph.nodes if n.meta.get("val") is not None}
    anchor = {o: k.anchor for k in kernel_groups(g) for o in k.ops}
    regions = {k.region: k.anchor for k in kernel_groups(g)}
    out = {}
    for n in runnable.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.name in regions:
            out[n.name] = regions[n.name]
            continue
        if n.meta.get("fxopt_split_from") in after:  # a conv whose epilogue a kernel computes: its own time
            out[n.name] = n.meta["fxopt_split_from"]
            continue
        name = n.name if n.name in after else by_val.get(id(n.meta.get("val")))
        if name is None and n.op == "call_function" and n.target is operator.getitem and n.args[0].name in regions:
            name = regions[n.args[0].name]
        if name is not None:
            out[n.name] = anchor.get(name, name)
    return out


class _Ranges(fx.Interpreter):
    """Runs a graph module node by node, each mapped node inside ``record_function``."""

    def __init__(self, gm: fx.GraphModule, labels: dict):
        super().__init__(gm)
        self.labels = labels

    def run_node(self, n: fx.Node) -> Any:
        label = self.labels.get(n.name)
        if label is None:
            return super().run_node(n)
        with torch.profiler.record_function(PREFIX + label):
            return super().run_node(n)


def _args_for(runnable: fx.GraphModule, dynamo_gm: fx.GraphModule, example_inputs: list) -> Optional[list]:
    """The runnable's arguments from the tensors Dynamo handed the backend (with the parameters
    AOTAutograd lifts in front of them, where it did), or None when they do not line up."""
    n = sum(1 for p in runnable.graph.nodes if p.op == "placeholder")
    if n == len(example_inputs):
        return list(example_inputs)
    lifted = list({**dict(dynamo_gm.named_parameters(remove_duplicate=False)),
                   **dict(dynamo_gm.named_buffers(remove_duplicate=False))}.values())
    if n == len(lifted) + len(example_inputs):
        return lifted + list(example_inputs)
    return None


def time_nodes(runnable: fx.GraphModule, labels: dict, args: list, cuda: bool, iters: int = 5,
               warmup: int = 2) -> dict[str, float]:
    """Label -> median microseconds per call over ``iters`` profiled calls."""
    from torch.profiler import ProfilerActivity

    interp = _Ranges(runnable, labels)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        for _ in range(warmup):
            interp.run(*args)
        sync()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(iters):
                interp.run(*args)
            sync()
    per: dict[str, list] = {}
    for e in prof.events():
        if not e.name.startswith(PREFIX) or getattr(e.device_type, "name", "CPU") != "CPU":
            continue
        us = e.device_time_total if cuda else e.cpu_time_total
        per.setdefault(e.name[len(PREFIX):], []).append(float(us))
    # several runnable nodes can belong to one label (a kernel and its outputs' item accesses)
    return {k: sum(v) / iters if len(v) > iters else statistics.median(v) for k, v in per.items()}


def profile(model, *inputs, options=None, iters: int = 5):
    """(report, Profile): ``fxopt.explain``'s report of ``model`` on ``inputs`` and the measured
    time of each node of its optimized graphs."""
    from fxopt.backend import fxopt_backend
    from fxopt.config import Options
    from fxopt.pipeline import ALL_PASS_NAMES
    from fxopt.report import Report

    opts = Options.from_any(options, ALL_PASS_NAMES)
    graphs: list = []
    seen: list = []

    def capture(gm, example_inputs):
        first = len(graphs)
        fn = fxopt_backend(gm, example_inputs, options=opts, _sink=graphs)
        seen.append((gm, list(example_inputs), range(first, len(graphs))))
        return fn

    compiled = torch.compile(model, backend=capture, dynamic=False)
    cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)
    result = Profile(clock="GPU time" if cuda else "CPU time",
                     device=torch.cuda.get_device_name() if cuda else "cpu")
    try:
        with torch.no_grad():
            compiled(*inputs)
        for gm, example_inputs, indices in seen:
            for i in indices:
                g = graphs[i]
                runnable = runnable_of(g)
                args = _args_for(runnable, gm, example_inputs) if runnable is not None else None
                if args is None:
                    result.notes[str(i)] = "not profiled: the executor's graph or its inputs were not found"
                    continue
                result.graphs[i] = time_nodes(runnable, node_labels(g, runnable), args, cuda, iters)
                result.notes[str(i)] = f"executor {g.executor}, run node by node"
    finally:
        torch.compiler.reset()
    return Report(graphs), result


__all__ = ["Profile", "profile", "time_nodes", "node_labels", "runnable_of"]
