"""Nodes the cuda executor fuses after choosing each node's implementation: a candidate for a
group of nodes (a ``kernels.common.NodeGroup`` from a family of ``kernels.GROUPS``) is measured
against the group as already chosen, and one node replaces the group where it wins
(``measure.Tuning``, so the decision is cached like every other). Groups: conv + max pool
(``kernels/direct_conv.py``, ``ConvMaxpool``: conv, epilogue and pool in one kernel) and chains of
linear layers (``kernels/linear.py``, ``LinearChainGroup``: a classifier head in one block).
"""
from __future__ import annotations

import torch.fx as fx

from fxopt.backends.cuda.kernels.common import NodeGroup
from fxopt.backends.cuda.runtime.measure import Tuning, cache_key, with_fallback


def fuse_group(gm: fx.GraphModule, group: NodeGroup, tuning: Tuning, decisions: dict) -> bool:
    """One node computing ``group`` (its reference: the group as chosen so far), inserted after its
    last node and measured against the group's candidates (those whose kernels compiled); where
    one wins, that node takes the group's place. Whether the graph changed."""
    reference = group.reference()
    candidates = {"reference": reference}
    for c in group.candidates:
        if len(c.kernels) == len(c.sources):
            candidates[f"generated_{c.label}"] = with_fallback(c, reference)
    if len(candidates) < 2:
        return False
    g = gm.graph
    with g.inserting_after(group.nodes[-1]):
        node = g.call_function(reference, group.args())
    node.meta = group.meta()
    chosen = [decisions.get(n.name, {}).get("choice", "reference") for n in group.nodes]
    key = cache_key(node, candidates, tuning.graphed).replace("node|", f"{group.kind}|{chosen}|", 1)
    entry = decisions["+".join(n.name for n in group.nodes)] = tuning.entry(node, candidates, key)
    if entry["choice"] not in candidates or entry["choice"] == "reference":
        g.erase_node(node)
        return False
    node.target = candidates[entry["choice"]]
    group.replace(gm, node)
    return True
