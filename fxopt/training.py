"""Training graphs: how AOTAutograd splits the joint graph, and what the split keeps for backward.

Why: in training, AOTAutograd traces forward and backward as one joint graph and a *partition
function* decides which forward values the backward reads (saved tensors, alive from the forward
until their use in the backward) and which it recomputes. AOTAutograd's default partition saves
every forward value the backward uses. ``min_cut_rematerialization_partition`` instead solves a
min cut over the joint graph: a cheap pointwise value (a ReLU, an add, a cast autocast inserted)
whose inputs are saved anyway is recomputed in the backward rather than stored, so fewer and
smaller tensors stay alive between forward and backward (less memory traffic and a lower peak),
at the cost of recomputing those ops. Convolutions, matrix products and reductions are never
recomputed. The results are the same values (the recomputation repeats the forward's own ops).

Option ``partitioner``: ``"min_cut"`` (default) or ``"default"`` (AOTAutograd's default
partition: save everything the backward needs). ``saved_for_backward`` says what a backward graph
reads from its forward: every compiled backward's ``GraphReport.training`` carries it, beside the
partitioner that produced it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.config import PARTITIONERS  # noqa: F401  (re-exported)


def partition_function(name: str) -> Callable:
    """The AOTAutograd partition function for option ``partitioner``."""
    from functorch.compile import default_partition, min_cut_rematerialization_partition

    if name == "min_cut":
        return min_cut_rematerialization_partition
    if name == "default":
        return default_partition
    raise ValueError(f"fxopt: partitioner must be one of {PARTITIONERS}, got {name!r}")


def default_partition_fn() -> Callable:
    from functorch.compile import default_partition

    return default_partition


#: comparisons whose operands must be bitwise the forward's values
_COMPARISONS = (torch.ops.aten.eq.Tensor, torch.ops.aten.ne.Tensor)


def save_compared_values(joint: fx.GraphModule) -> int:
    """Mark the forward values a floating-point ``eq`` / ``ne`` of the joint graph compares as
    saved for the backward (``CheckpointPolicy.MUST_SAVE``), never recomputed there: amax's
    gradient compares the input with the maximum, and a recomputation by other kernels than the
    forward's (a generated GELU in one graph, PyTorch's in the other) may round otherwise and match
    no maximum (a NaN gradient: GPU fuzz a93a79118e). Returns how many values it marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward: set = set()
    for n in joint.graph.nodes:  # what depends on the tangents is the backward's
        if (n.op == "placeholder" and "tangents" in n.name) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    marked = 0
    for n in joint.graph.nodes:
        if n.op != "call_function" or n.target not in _COMPARISONS:
            continue
        for a in n.args[:2]:
            v = a.meta.get("val") if isinstance(a, fx.Node) else None
            if (isinstance(v, torch.Tensor) and v.is_floating_point() and a not in backward
                    and a.op == "call_function" and "recompute" not in a.meta):
                a.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                marked += 1
    return marked


class Partitioner:
    """The partition function handed to AOTAutograd; remembers that it ran (``used``), so that the
    reports say which partition produced the graphs rather than which one was asked for."""

    def __init__(self, name: str, options=None, target=None):
        self.name, self.fn, self.used = name, partition_function(name), None
        self.options = options  # with options, the joint-graph passes run first (fxopt.pipeline)
        self.target = target  # what they may assume of the executor (fxopt.target; None: generic)
        self.num_fwd_outputs: Optional[int] = None  # the forward's outputs before the saved values
        self.joint_passes: list = []  # their PassRecords

    def __call__(self, joint_module, joint_inputs, **kwargs):
        if self.options is not None:
            from fxopt.pipeline import run_joint_pipeline

            joint_module, self.joint_passes = run_joint_pipeline(joint_module, joint_inputs, self.options,
                                                                 self.target)
        if self.fn is not default_partition_fn():
            save_compared_values(joint_module)
        result = self.fn(joint_module, joint_inputs, **kwargs)
        self.used = self.name
        self.num_fwd_outputs = kwargs.get("num_fwd_outputs")
        return result


def saved_for_backward(backward: fx.GraphModule) -> dict:
    """What a backward graph reads from its forward: the placeholders that are not incoming
    gradients (``tangents_*``). ``tensors``/``bytes`` count them all; ``activations`` /
    ``activation_bytes`` leave out the forward's own inputs (``primals_*``: parameters and the
    batch, alive anyway), i.e. the memory the partition keeps alive between forward and backward."""
    out = {"tensors": 0, "bytes": 0, "activations": 0, "activation_bytes": 0}
    for node in backward.graph.find_nodes(op="placeholder"):
        v = node.meta.get("val")
        if node.name.startswith("tangents") or not isinstance(v, torch.Tensor):
            continue
        size = _hint(v.numel()) * v.element_size()
        out["tensors"] += 1
        out["bytes"] += size
        if not node.name.startswith("primals"):
            out["activations"] += 1
            out["activation_bytes"] += size
    return out


def _hint(n) -> int:
    """An element count; a symbolic one (dynamic shapes) by the size it was traced at (0 if none)."""
    return n if isinstance(n, int) else int(getattr(getattr(n, "node", None), "hint", None) or 0)


def training_details(graph: fx.GraphModule, kind: str, partitioner: Partitioner) -> dict:
    """``GraphReport.training`` of a forward or backward graph: the partition function that split
    the joint graph (None if AOTAutograd did not call fxopt's), and for a backward graph what it
    reads from its forward (``saved_for_backward``)."""
    details: dict = {"partitioner": partitioner.used,
                     "joint_passes": [{"name": r.name, "status": r.status, "changed": r.changed,
                                       "nodes_before": r.nodes_before, "nodes_after": r.nodes_after,
                                       "ms": r.ms, "notes": list(r.notes), **({"error": r.error} if r.error else {})}
                                      for r in partitioner.joint_passes]}
    if kind == "backward":
        details["saved_for_backward"] = saved_for_backward(graph)
    return details
