"""training_layout: channels_last convolutions in mixed-precision training, through autocast's casts.

Why: under autocast every convolution weight (and the batch) reaches the convolution through a
``_to_copy`` to float16 / bfloat16 that autocast inserted. cuDNN's tensor-core kernels work in
NHWC; fed NCHW tensors it transposes them in and out of every convolution, forward and
backward. When the cast writes its result channels_last instead, the convolution's output is
channels_last, and so (PyTorch keeps the memory format of elementwise ops, BatchNorm, pooling
and their gradients) is every activation after it: the layout changes with no extra copy, the
cast was a copy anyway. On the H100, eager ResNet-50 (fp16, batch 64) spent 27 ms of GPU time
per training step in NCHW and 18 ms with channels_last weights.

Runs on AOTAutograd's joint graph (before the partition), so that forward and backward agree on
the layouts of the values the backward reads.

Matches: ``_to_copy(t, dtype=float16 | bfloat16)`` of a 4-D tensor on CUDA whose users are all
2-D convolutions (as their input or weight) and their gradients (``convolution_backward``).
Produces: the same cast with ``memory_format=torch.channels_last``. A weight's gradient leaves
through the cast back to float32; that cast is given ``memory_format=torch.contiguous_format``
where the parameter is contiguous, so ``.grad`` keeps the parameter's layout.

Illegal (the graph is left as it was, with the reason): option ``layout="contiguous"``; fewer than
``MIN_CONVS`` matching convolutions; not CUDA; a graph in which the new layouts do not propagate
(FakeTensor propagation fails, e.g. a ``view`` that needs the NCHW strides: ``x.view(n, -1)``
of a spatial activation). Values equal those of the NCHW graph up to the order of cuDNN's
accumulation (the documented float16 tolerance).
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.passinfra import PassContext, PassResult, is_call, val

aten = torch.ops.aten

#: below this many convolutions the layout change is not worth the risk of a transposing op
MIN_CONVS = 2
_LOW = (torch.float16, torch.bfloat16)
_CONV_USERS = (aten.convolution.default, aten.convolution_backward.default)


def _is_conv_cast(node: fx.Node) -> bool:
    """A cast to float16/bfloat16 of a 4-D CUDA tensor feeding only 2-D convolutions."""
    if not is_call(node, aten._to_copy.default) or node.kwargs.get("dtype") not in _LOW:
        return False
    if "memory_format" in node.kwargs or set(node.kwargs) - {"dtype"}:
        return False
    v = val(node.args[0])
    if v is None or v.dim() != 4 or v.device.type != "cuda":
        return False
    for u in node.users:
        if not is_call(u, *_CONV_USERS):
            return False
        forward = u.target is aten.convolution.default
        transposed, stride = (u.args[6], u.args[3]) if forward else (u.args[7], u.args[4])
        if transposed or len(stride) != 2:
            return False
    return bool(node.users)


def illegal_reason(gm: fx.GraphModule, ctx: PassContext, casts: list) -> Optional[str]:
    if ctx.options.layout == "contiguous":
        return "option layout='contiguous'"
    convs = {u for c in casts for u in c.users if u.target is aten.convolution.default}
    if len(convs) < MIN_CONVS:
        return f"{len(convs)} convolution(s) fed by autocast casts (< {MIN_CONVS})"
    return None


def _grad_casts(gm: fx.GraphModule) -> list[fx.Node]:
    """The casts back to float32 that return the gradient of a contiguous 4-D weight (a
    ``convolution_backward`` result) from the joint graph."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    found = []
    for n in out.all_input_nodes:
        if not (is_call(n, aten._to_copy.default) and n.kwargs.get("dtype") == torch.float32
                and "memory_format" not in n.kwargs):
            continue
        src = n.args[0]
        if not (is_call(src, operator.getitem) and is_call(src.args[0], aten.convolution_backward.default)):
            continue
        weight = src.args[0].args[2]  # the weight's cast, from the parameter
        param = val(weight.args[0]) if is_call(weight, aten._to_copy.default) else None
        if param is not None and param.dim() == 4 and param.is_contiguous():
            found.append(n)
    return found


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    casts = [n for n in gm.graph.nodes if _is_conv_cast(n)]
    why = illegal_reason(gm, ctx, casts)
    if why:
        ctx.note(f"skipped: {why}")
        return PassResult(gm, False)
    for c in casts:
        c.kwargs = {**c.kwargs, "memory_format": torch.channels_last}
    grads = _grad_casts(gm)
    for g in grads:
        g.kwargs = {**g.kwargs, "memory_format": torch.contiguous_format}
    gm.recompile()
    ctx.note(f"{len(casts)} cast(s) to channels_last before convolutions; "
             f"{len(grads)} weight gradient(s) cast back contiguous")
    return PassResult(gm, True)
