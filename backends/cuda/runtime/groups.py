"""Nodes the cuda executor fuses after choosing each node's implementation: a candidate for a
group of nodes is measured against the group as already chosen, and one node replaces the group
where it wins (``measure.Tuning``, so the decision is cached like every other). Groups: conv +
max pool (``kernels/direct_conv.py``, ``plan_conv_maxpool``: conv, epilogue and pool in one kernel) and chains of
linear layers (``kernels/linear.py``, ``plan_linear_chains``: a classifier head in one block).
"""
from __future__ import annotations

import torch.fx as fx

from fxopt.backends.cuda.runtime.measure import Tuning, cache_key, with_fallback
from fxopt.backends.cuda.kernels.direct_conv import conv_maxpool_chain
from fxopt.backends.cuda.kernels.linear import LinearChain, linear_chain_of


def _pool_args(pool: fx.Node) -> tuple:
    """max_pool2d_with_indices arguments with the defaults filled in."""
    args = list(pool.args) + [None] * (6 - len(pool.args))
    return (args[1], args[2] or args[1], args[3] if args[3] is not None else 0,
            args[4] if args[4] is not None else 1, bool(args[5]))


def _measured_group(gm: fx.GraphModule, group: list, kind: str, reference, generated: list, args: tuple,
                    meta: dict, tuning: Tuning, decisions: dict):
    """One node computing ``group`` (``reference``: the group as chosen so far, over ``args``),
    inserted after its last node and measured against the ``generated`` candidates (those whose
    kernels compiled); the node with the winner as target, or None (nothing changed) where the
    reference stays."""
    candidates = {"reference": reference}
    for c in generated:
        if len(c.kernels) == len(c.sources):
            candidates[f"generated_{c.label}"] = with_fallback(c, reference)
    if len(candidates) < 2:
        return None
    g = gm.graph
    with g.inserting_after(group[-1]):
        node = g.call_function(reference, args)
    node.meta = meta
    chosen = [decisions.get(n.name, {}).get("choice", "reference") for n in group]
    key = cache_key(node, candidates, tuning.graphed).replace("node|", f"{kind}|{chosen}|", 1)
    entry = decisions["+".join(n.name for n in group)] = tuning.entry(node, candidates, key)
    if entry["choice"] not in candidates or entry["choice"] == "reference":
        g.erase_node(node)
        return None
    node.target = candidates[entry["choice"]]
    return node


def fuse_conv_maxpool(gm: fx.GraphModule, pool: fx.Node, conv: fx.Node, fused: list, tuning: Tuning,
                      decisions: dict) -> bool:
    """Measure conv + max pool as one generated kernel against the pair as chosen so far; where it
    wins, one node replaces both (the pool's values are its only output in use)."""
    conv_args = tuple(conv.args) + (None,) * (12 - len(conv.args))
    meta = dict(pool.meta, val=pool.meta["val"][0])
    node = _measured_group(gm, [conv, pool], "conv_maxpool", conv_maxpool_chain(conv.target, pool.target), fused,
                           conv_args + _pool_args(pool), meta, tuning, decisions)
    if node is None:
        return False
    for user in list(pool.users):  # getitem(pool, 0): the values
        user.replace_all_uses_with(node)
        gm.graph.erase_node(user)
    gm.graph.erase_node(pool)
    gm.graph.erase_node(conv)
    return True


def fuse_linear_chain(gm: fx.GraphModule, chain: list, candidate: LinearChain, tuning: Tuning,
                      decisions: dict) -> bool:
    """Measure the chain of linear layers as one generated kernel against the layers as chosen so
    far; where it wins, one node replaces the chain (only the last layer's output is used)."""
    flat = (chain[0].args[0],) + tuple(a for n in chain for a in n.args[1:5])
    node = _measured_group(gm, chain, "linear_chain", linear_chain_of([n.target for n in chain]), [candidate],
                           flat, dict(chain[-1].meta), tuning, decisions)
    if node is None:
        return False
    chain[-1].replace_all_uses_with(node)
    for n in reversed(chain):
        gm.graph.erase_node(n)
    return True
