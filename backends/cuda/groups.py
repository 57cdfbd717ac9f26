"""Nodes the cuda executor fuses after choosing each node's implementation: a candidate for a
group of nodes is measured against the group as already chosen, and one node replaces the group
where it wins (``measure.Tuning``, so the decision is cached like every other). Groups: conv +
max pool (``direct_conv.plan_conv_maxpool``: conv, epilogue and pool in one kernel) and chains of
linear layers (``linear_chain.plan_linear_chains``: a classifier head in one block).
"""
from __future__ import annotations

import torch.fx as fx

from fxopt.backends.cuda.direct_conv import conv_maxpool_chain
from fxopt.backends.cuda.linear_chain import LinearChain, linear_chain_of
from fxopt.backends.cuda.measure import Tuning, cache_key, with_fallback


def _pool_args(pool: fx.Node) -> tuple:
    """max_pool2d_with_indices arguments with the defaults filled in."""
    args = list(pool.args) + [None] * (6 - len(pool.args))
    return (args[1], args[2] or args[1], args[3] if args[3] is not None else 0,
            args[4] if args[4] is not None else 1, bool(args[5]))


def fuse_conv_maxpool(gm: fx.GraphModule, pool: fx.Node, conv: fx.Node, fused: list, tuning: Tuning,
                      decisions: dict) -> bool:
    """Measure conv + max pool as one generated kernel against the pair as chosen so far; where it
    wins, one node replaces both (the pool's values are its only output in use)."""
    reference = conv_maxpool_chain(conv.target, pool.target)
    candidates = {"reference": reference}
    for c in fused:
        if len(c.kernels) == len(c.sources):
            candidates[f"generated_{c.label}"] = with_fallback(c, reference)
    if len(candidates) < 2:
        return False
    g = gm.graph
    conv_args = tuple(conv.args) + (None,) * (12 - len(conv.args))
    with g.inserting_after(pool):
        node = g.call_function(reference, conv_args + _pool_args(pool))
    node.meta = dict(pool.meta)
    node.meta["val"] = pool.meta["val"][0]
    chosen = [decisions.get(n.name, {}).get("choice", "reference") for n in (conv, pool)]
    key = cache_key(node, candidates, tuning.graphed).replace("node|", f"conv_maxpool|{chosen}|", 1)
    entry = decisions[f"{conv.name}+{pool.name}"] = tuning.entry(node, candidates, key)
    if entry["choice"] not in candidates or entry["choice"] == "reference":
        g.erase_node(node)
        return False
    node.target = candidates[entry["choice"]]
    for user in list(pool.users):  # getitem(pool, 0): the values
        user.replace_all_uses_with(node)
        g.erase_node(user)
    g.erase_node(pool)
    g.erase_node(conv)
    return True


def fuse_linear_chain(gm: fx.GraphModule, chain: list, candidate: LinearChain, tuning: Tuning,
                      decisions: dict) -> bool:
    """Measure the chain of linear layers as one generated kernel against the layers as chosen so
    far; where it wins, one node replaces the chain (only the last layer's output is used)."""
    if len(candidate.kernels) != len(candidate.sources):
        return False
    reference = linear_chain_of([n.target for n in chain])
    candidates = {"reference": reference, "generated_linear_chain": with_fallback(candidate, reference)}
    g = gm.graph
    flat = (chain[0].args[0],) + tuple(a for n in chain for a in n.args[1:5])
    with g.inserting_after(chain[-1]):
        node = g.call_function(reference, flat)
    node.meta = dict(chain[-1].meta)
    chosen = [decisions.get(n.name, {}).get("choice", "reference") for n in chain]
    key = cache_key(node, candidates, tuning.graphed).replace("node|", f"linear_chain|{chosen}|", 1)
    entry = decisions["+".join(n.name for n in chain)] = tuning.entry(node, candidates, key)
    if entry["choice"] != "generated_linear_chain":
        g.erase_node(node)
        return False
    node.target = candidates["generated_linear_chain"]
    chain[-1].replace_all_uses_with(node)
    for n in reversed(chain):
        g.erase_node(n)
    return True
