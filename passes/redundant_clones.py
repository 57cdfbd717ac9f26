"""redundant_clones: drop the copies autograd makes of values an in-place op used to overwrite.

Why: an in-place activation whose gradient reads its *input* (``ReLU6(inplace=True)``, i.e.
``hardtanh_``; ``SiLU`` and ``Hardswish`` in place) makes autograd keep a copy of that input
before the op overwrites it. AOTAutograd traces the copy as ``clone`` into the joint graph and then
functionalizes the in-place op, so nothing overwrites the original any more, but the copy stays:
one more read and write of a whole activation per such op in the forward, and the partition
saves the copy for backward instead of the original. MobileNetV2 trained through fxopt spent
0.4 ms of a 13 ms step (H200, fp16, batch 64) in 35 such clones of BatchNorm outputs.

Runs on AOTAutograd's joint graph, before the partition, so that the backward reads the original.

Matches: ``clone(x)`` (no memory format, or ``preserve_format``) whose result has ``x``'s strides,
read only by ops that do not write it.
Produces: every use of the clone reads ``x``; the clone is gone.

Illegal (kept, with the reason): a clone the graph returns (a forward output or a gradient: the
caller gets a tensor of its own, as eager gives it), of a graph input or a view of one (a
buffer the graph writes at its end would be read after the write), of a tensor something in the graph writes, a
clone that something writes, or one changing the layout. The values are the same tensors' values
(a functional graph never changes a tensor after it is computed), bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fxopt.passinfra import PassContext, PassResult, finish, is_call, storage_root, val, written_in_place

aten = torch.ops.aten


def illegal_reason(node: fx.Node, returned: set) -> Optional[str]:
    """Why this clone must stay, or None."""
    x = node.args[0]
    if node.kwargs.get("memory_format", torch.preserve_format) is not torch.preserve_format:
        return "it sets a memory format"
    if node in returned:
        return "the graph returns it"
    if not isinstance(x, fx.Node) or storage_root(x).op == "placeholder":
        return "it copies (a view of) a graph input"
    if written_in_place(x) or written_in_place(node):
        return "something in the graph writes it or its source"
    vx, vc = val(x), val(node)
    if vx is None or vc is None or vx.stride() != vc.stride() or vx.dtype != vc.dtype:
        return "its layout differs from its source's (or is unknown)"
    return None


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    returned = set(out.all_input_nodes)
    changed = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, aten.clone.default):
            continue
        why = illegal_reason(node, returned)
        if why:
            ctx.note(f"kept {node.name}: {why}")
            continue
        node.replace_all_uses_with(node.args[0])
        gm.graph.erase_node(node)
        changed += 1
    return finish(gm, ctx, changed, "clone(s) of values nothing overwrites dropped (their readers read the original)")
