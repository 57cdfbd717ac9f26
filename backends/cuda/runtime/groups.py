"""Nodes the cuda executor fuses after choosing each node's implementation: a candidate for a
group of nodes (a ``kernels.common.NodeGroup`` from a family of ``kernels.GROUPS``) is measured
against the group as already chosen, and one node replaces the group where it wins
(``measure.Tuning``, so the decision is cached like every other). Groups: conv + max pool
(``kernels/direct_conv.py``, ``ConvMaxpool``: conv, epilogue and pool in one kernel) and chains of
linear layers (``kernels/linear.py``, ``LinearChainGroup``: a classifier head in one block).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from fxopt.backends.cuda.kernels.common import NodeGroup
from fxopt.backends.cuda.runtime.measure import Tuning, cache_key, not_compiled, with_fallback


def fuse_group(gm: fx.GraphModule, group: NodeGroup, tuning: Tuning, decisions: dict,
               compile_now: Optional[Callable] = None) -> bool:
    """One node computing ``group`` (its reference: the group as chosen so far), inserted after its
    last node and measured against the group's candidates (those whose kernels compiled); where
    one wins, that node takes the group's place. Whether the graph changed. ``compile_now(cands,
    skipped)``: compiles the candidates once the autotuning cache was asked (where it holds the
    choice, only the chosen one's; ``skipped``: id -> why not); None: they are compiled already."""
    reference = group.reference()
    named = {f"generated_{c.label}": c for c in group.candidates}
    if not named:
        return False
    g = gm.graph
    with g.inserting_after(group.nodes[-1]):
        node = g.call_function(reference, group.args())
    node.meta = group.meta()
    chosen = [decisions.get(n.name, {}).get("choice", "reference") for n in group.nodes]
    key = cache_key(node, ["reference", *named], tuning.graphed).replace("node|", f"{group.kind}|{chosen}|", 1)
    entry = tuning.lookup(key)
    skipped = not_compiled(named, entry, tuning.losers(key) if entry is None else ())
    if compile_now is not None:
        compile_now(list(named.values()), skipped)
    candidates = {"reference": reference}
    candidates.update((name, with_fallback(c, reference)) for name, c in named.items()
                      if len(c.kernels) == len(c.sources))
    if entry is None and len(candidates) < 2:
        if skipped:
            tuning.reference_kept(key)
        g.erase_node(node)
        return False
    entry = decisions["+".join(n.name for n in group.nodes)] = (
        entry if entry is not None else tuning.measured(node, candidates, key))
    if entry["choice"] not in candidates or entry["choice"] == "reference":
        g.erase_node(node)
        return False
    node.target = candidates[entry["choice"]]
    group.replace(gm, node)
    return True
