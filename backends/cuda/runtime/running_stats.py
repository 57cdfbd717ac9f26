"""The cuda executor's last step on a training forward: BatchNorm updates its buffers in place.

Why: AOTAutograd's forward graph is functional. Each training BatchNorm returns *new* running
statistics (ATen's functional variant, and ``fxopt::batch_norm_relu``, first copy the old ones
into fresh tensors), the graph ends with one ``copy_`` per buffer writing them back, and each
``num_batches_tracked`` is incremented into a new tensor and copied back. That is six tiny kernels
per BatchNorm (two clones, three copies, one add): 312 of MobileNetV2's forward's kernels, about
a microsecond each inside a CUDA graph, where eager runs none of them but one add.

What: once the graph is lowered (the fusion scheduler and the measurements saw the functional
graph), a BatchNorm whose new statistics only feed the ``copy_`` into its own buffers becomes the
in-place form eager runs (``aten._batch_norm_with_update`` / ``fxopt.ops.batch_norm_relu_update``),
writing the buffers where they live; the copies and the new tensors go. The counter increments
(``add(n, 1)`` copied into ``n``) become one ``_foreach_add_`` over all counters at the graph's end.

Illegal (left as traced): a buffer read by anything else in the graph (a read after the update
would see the new value); new statistics read by anything but their copy (e.g. saved for the
backward); a BatchNorm used other than through its outputs. The values are the same: the
functional ops are defined as a copy followed by these in-place ones.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.ops import BATCH_NORM_RELU, batch_norm_relu_update

aten = torch.ops.aten
#: functional training BatchNorm -> its in-place form (same arguments; outputs 0-3 the same, the
#: new running mean and variance (4, 5) written into arguments 3 and 4 instead)
IN_PLACE = {aten._batch_norm_with_update_functional.default: aten._batch_norm_with_update.default,
            BATCH_NORM_RELU: batch_norm_relu_update}


def _copy_into(item: Optional[fx.Node], dst, reader: fx.Node) -> Optional[fx.Node]:
    """The one ``copy_(dst, item)`` that is ``item``'s only user, where ``dst`` is a graph input
    read by nothing but ``reader`` (the op computing ``item``) and that copy; else None."""
    if item is None or len(item.users) != 1:
        return None
    cp = next(iter(item.users))
    if not (cp.op == "call_function" and cp.target is aten.copy_.default and cp.args[0] is dst and cp.args[1] is item):
        return None
    if not isinstance(dst, fx.Node) or dst.op != "placeholder" or set(dst.users) != {reader, cp}:
        return None
    return cp


def _batch_norm(node: fx.Node) -> Optional[tuple]:
    """(getitem 4, getitem 5, copy 4, copy 5) of a BatchNorm that can update in place, or None."""
    if node.op != "call_function" or node.target not in IN_PLACE:
        return None
    items = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem:
            return None
        items[u.args[1]] = u
    copies = (_copy_into(items.get(4), node.args[3], node), _copy_into(items.get(5), node.args[4], node))
    if None in copies:
        return None
    return items[4], items[5], *copies


def _counter(node: fx.Node) -> Optional[fx.Node]:
    """The ``copy_(n, add(n, 1))`` of a counter ``n`` (a graph input read by nothing else), or None."""
    if not (node.op == "call_function" and node.target is aten.add.Tensor and len(node.args) == 2
            and node.args[1] == 1 and not node.kwargs):
        return None
    return _copy_into(node, node.args[0], node)


def update_in_place(gm: fx.GraphModule) -> dict:
    """Rewrite ``gm`` (a lowered training forward) as above; returns what changed."""
    graph = gm.graph
    bns = counters = 0
    for node in list(graph.nodes):
        found = _batch_norm(node)
        if found is None:
            continue
        for n in found[2:] + found[:2]:  # the copies, then the new statistics they read
            graph.erase_node(n)
        node.target = IN_PLACE[node.target]
        if isinstance(node.meta.get("val"), (tuple, list)):
            node.meta["val"] = tuple(node.meta["val"][:4])
        bns += 1
    adds = [(n, cp) for n in graph.nodes for cp in [_counter(n)] if cp is not None]
    if adds:
        with graph.inserting_before(adds[-1][1]):
            graph.call_function(aten._foreach_add_.Scalar, ([n.args[0] for n, _ in adds], 1))
        for n, cp in adds:
            graph.erase_node(cp)
            graph.erase_node(n)
        counters = len(adds)
    if bns or counters:
        graph.lint()
        gm.recompile()
    return {"batch_norms": bns, "counters": counters}
