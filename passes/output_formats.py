"""output_formats: hand every output back in the memory format eager gives it.

Why: AOTAutograd decomposes some ops whose eager kernels keep their input's memory format into
ops that do not. ``upsample_nearest2d`` of a channels_last input is channels_last in eager, but its
decomposition (index arithmetic and ``aten._unsafe_index``) is contiguous on CUDA; returned as is,
the compiled model hands out other strides than the model does. The layout pass restores the
format of the values it made NHWC; this pass covers every other output.

Matches: the inference graph's outputs whose eager memory format (``ctx.output_formats``: recorded
from Dynamo's graph, before any decomposition, where its outputs are AOTAutograd's) is dense
NCHW or dense channels_last and whose value has other strides.

Produces: ``aten.clone(memory_format=eager's)`` of such an output (the cuda executor stores that
copy in the format; fused into the kernel that produces the value where it can).

Illegal / skipped: training graphs (the forward's outputs include what it saves for the backward);
an output whose eager strides are a view's (no dense format to give it); a value that has no
metadata; 4-D values only (memory formats are 4-D).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.names import format_of
from fxopt.passinfra import PassContext, PassResult, val

aten = torch.ops.aten


def wrong_formats(gm: fx.GraphModule, ctx: PassContext) -> list:
    """(output index, output node, eager's format) of every output to convert."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    found = []
    for i, (o, want) in enumerate(zip(flat, ctx.output_formats)):
        if want is None or not isinstance(o, fx.Node):
            continue  # eager's output is a view (or no tensor): no format to restore
        v = val(o)
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            continue
        if format_of(v) is not want and not v.is_contiguous(memory_format=want):
            found.append((i, o, want))
    return found


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.mode != "inference":
        ctx.note("skipped: training graph")
        return PassResult(gm, False)
    wrong = wrong_formats(gm, ctx)
    if not wrong:
        return PassResult(gm, False)
    g = gm.graph
    out_node = next(n for n in g.nodes if n.op == "output")
    outs = out_node.args[0]
    flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for i, o, want in wrong:
        with g.inserting_before(out_node):
            conv = g.call_function(aten.clone.default, (o,), {"memory_format": want})
        conv.meta.update({k: v for k, v in o.meta.items() if k in ("stack_trace", "nn_module_stack")})
        flat[i] = conv
        ctx.note(f"output {i} ({o.name}) back to {'channels_last' if want is torch.channels_last else 'NCHW'} "
                 f"as eager gives it")
    out_node.args = (type(outs)(flat) if isinstance(outs, (list, tuple)) else flat[0],)
    gm.graph.lint()
    gm.recompile()
    ctx.refresh_meta(gm)
    return PassResult(gm, True)
