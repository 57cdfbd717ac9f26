"""layout: run 2-D convolutions in channels_last (NHWC) and hand outputs back as eager would.

Why: on NVIDIA GPUs cuDNN's fastest convolution kernels (tensor cores, fused
epilogues) are NHWC; an NCHW network pays a transpose inside every conv. Doing
the conversion once at the region boundary, and the weights once at compile
time, removes those transposes.

Matches: every 4-D ``fxopt::fused_conv``. Its input and residual are converted
to channels_last (``aten.clone(memory_format=channels_last)``) unless they
already are; its weight too (weight-only, so folded at compile time).

Produces: channels_last regions. Layout-agnostic ops (pointwise, pooling, BN,
concatenation, mean, and slicing views: slice / split / narrow) keep the NHWC strides flowing;
a slicing view that is a graph output does only where eager's value under it is NHWC too (a view
has eager's strides only on a base of eager's layout). Before any other consumer
(views, reshapes, matrix products, unknown ops) and at graph outputs, the value
is converted back to the memory format eager gives (recorded before the
pipeline), so outputs have exactly eager's strides. Conversions of values that
are already in the wanted format are dropped. Within a channels_last region the cuda
executor may still run one convolution channels-first where that measures
faster with its conversions (large-kernel depthwise convs: ``conv_in_nchw`` in
``backends/cuda/schedule/conv.py``).

On the CPU (``"auto"``) where the target's executor runs NHWC convolutions faster
(``ctx.target.cpu_channels_last``: the cpu executor, whose oneDNN convolutions with packed weights
take NHWC inputs): graphs with two or more 2-D convolutions of a dtype it has such kernels for
(float32 / bfloat16), however few channels (the small-CNN rule below is CUDA's).

Illegal / skipped: option ``layout="contiguous"``; ``"auto"`` on CPU for a target without NHWC
convolutions (another executor, or no oneDNN); graphs with fewer than two 2-D convolutions (not conv-heavy: the boundary copies
would cost more than they save); on CUDA graphs whose convolutions all have fewer than
``MIN_CHANNELS`` input (per group) or output channels (small CNNs: nothing for NHWC kernels to
vectorize over, only copies to pay); training graphs.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxopt.names import CL, NCHW, format_of, is_format  # noqa: F401  (re-exported)
from fxopt.ops import FUSED_CONV
from fxopt.passinfra import PassContext, PassResult, is_call, val

aten = torch.ops.aten

#: ops that are correct and efficient for any input strides and keep NHWC flowing
LAYOUT_AGNOSTIC = {
    FUSED_CONV, operator.getitem,
    aten.relu.default, aten.hardtanh.default, aten.leaky_relu.default, aten.silu.default, aten.gelu.default,
    aten.hardswish.default, aten.hardsigmoid.default, aten.sigmoid.default, aten.tanh.default,
    aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor, aten.clamp.default,
    aten.clamp_min.default, aten.clamp_max.default,
    aten.max_pool2d_with_indices.default, aten.avg_pool2d.default, aten._adaptive_avg_pool2d.default,
    aten.mean.dim, aten.cat.default, aten._native_batch_norm_legit_no_training.default,
    aten.clone.default,
}


#: views that slice (any strides in, the same strides out): they keep NHWC flowing unless eager's
#: result is a graph output viewing an NCHW value (its strides are eager's only on an NCHW base)
SLICING = {aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.narrow.default}


def _reaches_output(node: fx.Node) -> bool:
    """``node``, or an item of it (a split's getitem), is a graph output."""
    return any(u.op == "output" or (u.target is operator.getitem and any(v.op == "output" for v in u.users))
               for u in node.users)


def agnostic(node: fx.Node) -> bool:
    """Whether ``node`` keeps NHWC flowing. Decided before any metadata is re-propagated: a slicing
    view's input still has the strides eager gives it."""
    if node.op != "call_function":
        return False
    if node.target in LAYOUT_AGNOSTIC:
        return True
    if node.target in SLICING:
        src = val(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        return src is not None and (format_of(src) is CL or not _reaches_output(node))
    return False


def should_run(gm: fx.GraphModule, ctx: PassContext) -> str | None:
    """None when the pass applies, else the reason it does not."""
    if ctx.mode != "inference":
        return "training graph"
    choice = ctx.options.layout
    if choice == "contiguous":
        return "layout='contiguous'"
    convs = [n for n in gm.graph.nodes if is_call(n, FUSED_CONV) and val(n) is not None and val(n).dim() == 4]
    if not convs:
        return "no 2-D convolutions"
    if choice == "auto":
        if len(convs) < 2:
            return "not conv-heavy (fewer than two 2-D convolutions)"
        if ctx.device_type != "cuda":  # however few channels: see _cpu_nchw_reason
            return _cpu_nchw_reason(ctx, convs)
        if not any(_wide(n) for n in convs):
            return f"every convolution has fewer than {MIN_CHANNELS} input or output channels"
    return None


def _cpu_nchw_reason(ctx: PassContext, convs: list) -> str | None:
    """On the CPU, NHWC pays where the target's executor has NHWC convolutions (the cpu executor's
    oneDNN convolutions, whose packed weights need NHWC inputs); then even for few channels (3 -> 6
    and 6 -> 16 5x5 convolutions at batch 1: 46 and 35 us against ATen's NCHW 82 and 60 us, 2
    threads), so the CUDA rules for small CNNs do not apply. The executor's runner still times the
    result against the unoptimized graph."""
    why = ctx.target.cpu_channels_last_reason({val(n.args[0]).dtype for n in convs})
    return None if why is None else f"layout='auto' keeps NCHW on CPU: {why}"


#: NHWC pays where convs have channels to vectorize over (tensor-core kernels); a network whose
#: convs all have fewer in- or output channels (a small CNN) would only pay the boundary copies
MIN_CHANNELS = 16


def _wide(conv: fx.Node) -> bool:
    w = val(conv.args[1])
    return w is not None and w.dim() == 4 and min(int(w.shape[0]), int(w.shape[1])) >= MIN_CHANNELS


def _convert(g: fx.Graph, node: fx.Node, fmt, cache: dict) -> fx.Node:
    key = (node, fmt)
    if key not in cache:
        with g.inserting_after(node):
            cache[key] = g.call_function(aten.clone.default, (node,), {"memory_format": fmt})
            cache[key].meta["fxopt_layout"] = True
    return cache[key]


def to_channels_last(gm: fx.GraphModule, cache: dict) -> int:
    g, n_conv = gm.graph, 0
    for node in list(g.nodes):
        if not is_call(node, FUSED_CONV) or val(node) is None or val(node).dim() != 4:
            continue
        args = list(node.args)
        for i in (0, 1, 3):  # input, weight, residual
            a = args[i]
            # not where the strides already are channels_last (a 1x1 weight is both formats)
            if isinstance(a, fx.Node) and val(a) is not None and not is_format(val(a), CL):
                args[i] = _convert(g, a, CL, cache)
        node.args = tuple(args)
        n_conv += 1
    return n_conv


def maybe_channels_last(gm: fx.GraphModule) -> set:
    """Nodes whose value may now be NHWC: conv outputs and what flows through layout-agnostic ops.

    Computed from the graph's structure, before any metadata is re-propagated (a view of an NHWC
    value would fail there); conversions inserted for a superset are dropped later if redundant.
    """
    maybe: set = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        fmt = node.kwargs.get("memory_format") if node.target is aten.clone.default else None
        if fmt is NCHW:
            continue
        if fmt is CL or (is_call(node, FUSED_CONV) and val(node) is not None and val(node).dim() == 4):
            maybe.add(node)
        elif agnostic(node) and any(a in maybe for a in node.all_input_nodes):
            maybe.add(node)
    return maybe


def restore_formats(gm: fx.GraphModule, ctx: PassContext, cache: dict) -> int:
    """Convert possibly-NHWC values back before non-agnostic consumers and at outputs."""
    g, restored = gm.graph, 0
    out_node = next(n for n in g.nodes if n.op == "output")
    maybe = maybe_channels_last(gm)
    keep = {n for n in maybe if agnostic(n)}  # decided on eager's strides, before any conversion
    for node in list(g.nodes):
        if node not in maybe:
            continue
        for user in list(node.users):
            if user is out_node or user in keep or (user.op == "call_function" and agnostic(user)):
                continue
            user.replace_input_with(node, _convert(g, node, NCHW, cache))
            restored += 1
    outs = out_node.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for i, o in enumerate(flat):
        want = ctx.output_formats[i] if i < len(ctx.output_formats) else NCHW
        if want is None and _slice_of_nhwc(o):  # a view of a value eager has in NHWC too: eager's strides
            continue
        if o in maybe:
            flat[i] = _convert(g, o, want or NCHW, cache)
            restored += 1
    out_node.args = (type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0],)
    return restored


def _slice_of_nhwc(node) -> bool:
    """A slicing view (or a split's item) of a value whose eager strides are NHWC."""
    if isinstance(node, fx.Node) and node.target is operator.getitem:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target not in SLICING:
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and val(src) is not None and format_of(val(src)) is CL  # eager's meta still


def drop_redundant(gm: fx.GraphModule) -> int:
    """Remove layout conversions whose input already has the wanted format. A conversion that is a
    graph output stays unless its input has exactly the strides it would give: a format ignores
    the strides of size-1 dimensions (an NHWC ``(n, c, 1, 1)`` is also contiguous), eager's outputs
    do not."""
    dropped = 0
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    for node in list(gm.graph.nodes):
        if not is_call(node, aten.clone.default) or "memory_format" not in node.kwargs:
            continue
        src, converted = val(node.args[0]), val(node)
        if (out_node in node.users and src is not None and converted is not None
                and src.stride() != converted.stride()):
            continue
        if src is not None and is_format(src, node.kwargs["memory_format"]) and node.meta.get("fxopt_layout"):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            dropped += 1
    return dropped


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    reason = should_run(gm, ctx)
    if reason:
        ctx.note(f"skipped: {reason}")
        return PassResult(gm, False)
    cache: dict = {}
    n_conv = to_channels_last(gm, cache)
    restored = restore_formats(gm, ctx, cache)
    gm.recompile()
    # the metadata propagated, a view the new formats would refuse (a permute of an NHWC value that
    # eager had NCHW, viewed flat by a linear layer: CPU fuzz e64f6c30d5) reading a contiguous copy
    kept = views_in_eagers_format(gm, ctx)
    dropped = drop_redundant(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    kept += views_in_eagers_format(gm, ctx)
    ctx.note(f"{n_conv} convolutions in channels_last; {restored} conversions back to NCHW; {dropped} redundant dropped"
             + (f"; {kept} kept before views" if kept else ""))
    return PassResult(gm, n_conv > 0)


def views_in_eagers_format(gm: fx.GraphModule, ctx: PassContext) -> int:
    """A ``view`` reads its input contiguous where the propagated graph gives it strides ATen's view
    refuses. ``drop_redundant`` judges each conversion on the strides propagated before any was
    dropped; a dropped one changes the strides of a dimension of size 1 (a one-channel value is
    both formats), and PyTorch's convolution after it may then choose channels_last, whose result a
    ``flatten`` cannot view (GPU fuzz e489bb7fe8: [1, 2, 2, 1] as [1, 4]). Re-propagates until every
    view is taken; returns the conversions inserted."""
    from fxopt.fakeprop import view_refused

    inserted = 0
    for _ in range(8):
        try:
            ctx.refresh_meta(gm)
            error = None
        except Exception as e:  # noqa: BLE001 - a refused view stops propagation at that node
            error = e
        refused = [n for n in gm.graph.nodes if view_refused(n) is not None]
        if not refused:
            if error is not None:
                raise error
            return inserted
        for n in refused:
            src = n.args[0]
            with gm.graph.inserting_before(n):
                c = gm.graph.call_function(aten.clone.default, (src,), {"memory_format": NCHW})
            c.meta.update({k: v for k, v in src.meta.items() if k in ("stack_trace", "nn_module_stack")})
            n.replace_input_with(src, c)
            inserted += 1
        gm.recompile()
    raise RuntimeError("layout: views still refused after 8 re-propagations")
