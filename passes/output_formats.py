"""output_formats: hand every output back in the memory format eager gives it.

Why: AOTAutograd decomposes some ops whose eager kernels keep their input's memory format into
ops that do not. ``upsample_nearest2d`` of a channels_last input is channels_last in eager, but its
decomposition (index arithmetic and ``aten._unsafe_index``) is contiguous on CUDA; returned as is,
the compiled model hands out other strides than the model does. The layout pass restores the
format of the values it made NHWC; this pass covers every other output.

Matches: the inference graph's outputs whose eager memory format (``ctx.output_formats``: recorded
from Dynamo's graph, before any decomposition, where its outputs are AOTAutograd's) is dense
NCHW or dense channels_last and whose value has other strides; and the outputs that are views
(``x.transpose(2, 3)``, ``x[:, :1]``) whose strides differ from eager's (``ctx.output_strides``)
where the value they view, laid out in the other format, gives eager's strides.

Produces: ``aten.clone(memory_format=eager's)`` of such an output, or of the value such a view
reads, which the view then reads (``fxopt.eager_formats.restore_output_formats``; the cuda
executor stores that copy in the format, fused into the kernel that produces the value where it
can). The runners' unoptimized baseline gets the same copies.

Illegal / skipped: training graphs (the forward's outputs include what it saves for the backward);
a view of a graph input (its strides are the input's); a value that has no metadata; 4-D values
only (memory formats are 4-D).
"""
from __future__ import annotations

import torch.fx as fx

from fxopt.eager_formats import needs_format, restore_output_formats
from fxopt.passinfra import PassContext, PassResult, val


def wrong_formats(gm: fx.GraphModule, ctx: PassContext) -> list:
    """(output index, output node, eager's format) of every dense output to convert."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    flat = list(out) if isinstance(out, (list, tuple)) else [out]
    found = []
    for i, (o, want) in enumerate(zip(flat, ctx.output_formats)):
        if needs_format(val(o), want):
            found.append((i, o, want))
    return found


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    if ctx.mode != "inference":
        ctx.note("skipped: training graph")
        return PassResult(gm, False)
    notes = restore_output_formats(gm, ctx.output_formats, ctx.output_strides)
    if not notes:
        return PassResult(gm, False)
    for line in notes:
        ctx.note(line)
    gm.graph.lint()
    gm.recompile()
    ctx.refresh_meta(gm)
    return PassResult(gm, True)
