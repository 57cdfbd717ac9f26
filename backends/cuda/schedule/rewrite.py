"""The graph rewrites around the fusion scheduler.

Before it, ``split_conv_epilogues``: a fused convolution whose readers are all generated kernels
becomes the bare convolution and its epilogue (``conv_epilogue_ref``), which the scheduler then
computes inside those kernels; ``split_linear_epilogues`` does the same for a linear layer over
many rows where the bare product measured faster (cuBLAS chooses its kernel by whether a bias is
fused; in float32 a ConvNeXt MLP's products were slower with it). After it, ``rewrite``: each
region becomes one node (its outputs' users read that node's items), and ``reference_module``: a
region's nodes as PyTorch runs them, the reference every generated kernel is checked and measured
against (with the constant index arithmetic a kernel folded into an index map recomputed in it).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxopt.backends.cuda.kernels.common import meta
from .fusion import Region
from .index_rules import is_constant
from .lowering import container_items, is_view, value_rule
from .reduction_rules import reduction_rule
from .values import Decline

aten = torch.ops.aten


def _only_fusible_readers(node: fx.Node, skip: set) -> bool:
    """Every reader of ``node`` (through views) is an op a generated kernel computes."""
    if not node.users:
        return False
    for u in node.users:
        if u in skip or u.op != "call_function":
            return False
        if is_view(u) or u.target in (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int):
            if not _only_fusible_readers(u, skip):
                return False
        elif value_rule(u) is None and reduction_rule(u) is None:
            items = container_items(u)
            if items is None or any(value_rule(i) is None for i in items):
                return False
    return True


def _split(node: fx.Node, bare_target, bare_args: tuple, epilogue_args: tuple) -> None:
    """Replace ``node`` by ``bare_target(*bare_args)`` followed by ``conv_epilogue_ref(bare,
    *epilogue_args)``; both carry the node's name (the report's regions name it)."""
    from fxopt.ops import conv_epilogue_ref

    g = node.graph
    with g.inserting_before(node):
        bare = g.call_function(bare_target, bare_args)
        epi = g.call_function(conv_epilogue_ref, (bare,) + tuple(epilogue_args))
    bare.meta = dict(node.meta, fxopt_split_from=node.meta.get("fxopt_split_from", node.name))
    epi.meta = dict(bare.meta)
    node.replace_all_uses_with(epi)
    g.erase_node(node)


def split_conv_epilogues(gm: fx.GraphModule, skip: set = frozenset(), recompile: bool = True) -> int:
    """Split each fused conv with an epilogue (bias, residual, activation) whose readers are all
    generated kernels into the bare convolution and ``conv_epilogue_ref``: the scheduler then
    computes the epilogue inside those kernels, where they read the conv's output, instead of in a
    pass of its own over the whole activation (one write and one read less; a squeeze-excite block
    reads a SiLU conv's output twice and writes it never). ``recompile`` False: the caller
    regenerates the module's code once after its further rewrites (as the cuda executor does)."""
    from fxopt.ops import fused_conv_ref

    g, count = gm.graph, 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not fused_conv_ref or len(node.args) < 10:
            continue
        args = list(node.args)
        bias, res, act, params = args[2], args[3], args[8], args[9]
        if bias is None and res is None and act == "none":
            continue  # nothing to move
        if meta(node) is None or not _only_fusible_readers(node, skip):
            continue
        _split(node, fused_conv_ref, tuple(args[:2] + [None, None] + args[4:8] + ["none", []] + args[10:]),
               (bias, res, act, list(params)))
        count += 1
    if count and recompile:
        gm.recompile()
    return count


def linear_then_epilogue(x, weight, bias, activation, act_params):
    """``fused_linear`` as the bare product followed by its epilogue in a pass of its own: what a
    split linear layer costs at most (the scheduler moves the epilogue into its readers' kernels)."""
    from fxopt.ops import conv_epilogue_ref, fused_linear_ref

    return conv_epilogue_ref(fused_linear_ref(x, weight, None, "none", []), bias, None, activation, act_params)


def split_linear_epilogues(gm: fx.GraphModule, skip: set = frozenset(), choose=None, recompile: bool = True) -> dict:
    """Split each ``fused_linear`` over more rows than the linear family's kernels take, with a bias
    or an activation, whose readers are all generated kernels, into the bare product and
    ``conv_epilogue_ref`` (on a 2-D output the bias is per column, as the rule loads it) where
    ``choose(node)`` (the executor's measurement of ``linear_then_epilogue`` against the fused
    call) says so: {node name: what ``choose`` returned} for the nodes asked."""
    from fxopt.backends.cuda.kernels.linear import MAX_ROWS
    from fxopt.ops import fused_linear_ref

    g, asked, count = gm.graph, {}, 0
    for node in list(g.nodes):
        if node.op != "call_function" or node.target is not fused_linear_ref or len(node.args) != 5:
            continue
        x, w, bias, act, params = node.args
        out = meta(node)
        if bias is None and act == "none":
            continue  # nothing to move
        if out is None or out.dim() != 2 or not isinstance(out.shape[0], int) or out.shape[0] <= MAX_ROWS:
            continue  # few rows: the linear family fuses the epilogue into its own kernel
        if not _only_fusible_readers(node, skip):
            continue
        if choose is None:
            continue
        entry = asked[node.name] = choose(node)
        if entry.get("choice") != "split":
            continue
        _split(node, fused_linear_ref, (x, w, None, "none", []), (bias, None, act, list(params)))
        count += 1
    if count and recompile:
        gm.recompile()
    return asked


def reference_module(gm: fx.GraphModule, region: Region) -> fx.GraphModule:
    """The region's nodes as PyTorch runs them: a module from its inputs to the tuple of its
    outputs (the reference every generated kernel is measured and checked against)."""
    covered = set(region.covered) | set(region.outputs)
    for n in list(covered):
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node):
            covered.add(n.args[0])  # the op whose item it is
    g = fx.Graph()
    env: dict = {}
    for i, n in enumerate(region.inputs):
        env[n] = g.placeholder(f"in{i}")
        env[n].meta = dict(n.meta)

    def arg(a):
        if a not in env:
            if not is_constant(a):
                raise Decline(f"{a.name} is neither computed by the region nor one of its inputs")
            env[a] = g.node_copy(a, arg)  # index arithmetic the kernel folded into an index map
        return env[a]
    for n in gm.graph.nodes:
        if n in covered and n not in env:
            env[n] = g.node_copy(n, arg)
    g.output(tuple(env[o] for o in region.outputs))
    return fx.GraphModule(gm, g, class_name="RegionReference")


def rewrite(gm: fx.GraphModule, regions: list, targets: list, recompile: bool = True) -> list:
    """Replace each region by one node calling ``targets[i](*inputs) -> tuple of outputs``,
    placed after its last input; the outputs' users read its items. Returns the new nodes.
    ``recompile`` False: the caller regenerates the module's code (``split_conv_epilogues``)."""
    g = gm.graph
    replaced: dict = {}
    nodes = []
    for region, target in zip(regions, targets):
        inputs = [replaced.get(n, n) for n in region.inputs]
        pos = {n: i for i, n in enumerate(g.nodes)}
        anchor = max(inputs, key=lambda n: pos[n]) if inputs else None
        where = g.inserting_after(anchor) if anchor is not None else g.inserting_before(region.outputs[0])
        with where:
            node = g.create_node("call_function", target, tuple(inputs), {}, name=region.name)
        node.meta["val"] = tuple(meta(o) for o in region.outputs)
        node.meta["fxopt_region"] = region.name
        prev = node
        for i, o in enumerate(region.outputs):
            with g.inserting_after(prev):
                item = g.call_function(operator.getitem, (node, i))
            item.meta = dict(o.meta)
            o.replace_all_uses_with(item)
            replaced[o] = item
            prev = item
        nodes.append(node)
    g.eliminate_dead_code()
    g.lint()
    if recompile:
        gm.recompile()
    return nodes
