"""dead_code: remove nodes whose values nobody uses, and no-op conversions.

Why: rewrites leave orphans behind (a BatchNorm's statistics outputs, a
linear layer's transposed weight), and AOTAutograd graphs contain conversions
that do nothing for the dtypes at hand. Dead nodes cost kernel launches and
make the graph harder to read.

Matches: pure nodes without users (``Graph.eliminate_dead_code``, which keeps
anything impure or mutating); ``aten._to_copy`` / ``prims.convert_element_type``
to the dtype, device and layout the value already has, when the value is not a
graph output (an output must not alias an input).

Produces: the same graph without those nodes.

Illegal: removing an impure node (random ops, in-place ops, prints); removing
a copy whose result is returned (the caller could observe aliasing).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.passinfra import PassContext, PassResult, is_call, val

aten = torch.ops.aten
prims = torch.ops.prims


def is_noop_copy(node: fx.Node) -> bool:
    if is_call(node, aten._to_copy.default):
        allowed = {"dtype", "device", "layout"}
        if set(node.kwargs) - allowed:
            return False  # memory_format / non_blocking / pin_memory: a real change or not provably none
    elif not is_call(node, prims.convert_element_type.default):
        return False
    src, out = val(node.args[0]), val(node)
    if src is None or out is None:
        return False
    if any(u.op == "output" for u in node.users):
        return False
    return (src.dtype, src.device, src.layout, src.stride()) == (out.dtype, out.device, out.layout, out.stride())


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    removed_copies = 0
    for node in list(gm.graph.nodes):
        if is_noop_copy(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed_copies += 1
    before = len(gm.graph.nodes)
    changed = gm.graph.eliminate_dead_code()
    dead = before - len(gm.graph.nodes)
    if removed_copies or changed:
        gm.recompile()
        ctx.note(f"removed {dead} dead nodes and {removed_copies} no-op conversions")
    return PassResult(gm, bool(removed_copies or changed))
