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
where the parameter is contiguous, so ``.grad`` keeps the parameter's layout. The graph was traced
on NCHW values, so the ``.contiguous()`` eager calls in front of kernels that take NCHW only were
no-ops and left nothing in it: where the new layouts reach such an argument (``NEEDS_NCHW``:
GroupNorm's input, its gradient's incoming gradient and input; CUDA's kernels refuse or misread
channels_last there), a contiguous copy of the value is put in front of it (one per value).

Every ``view`` of the graph becomes a ``reshape`` (``_views_to_reshapes`` says why): a flatten of a
channels_last activation (``x.view(n, -1)`` into a linear head) then copies where it must.

Illegal (the graph is left as it was, with the reason): option ``layout="contiguous"``; fewer than
``MIN_CONVS`` matching convolutions; not CUDA; a graph in which the new layouts do not propagate
(FakeTensor propagation fails) or in which a ``view`` ATen's kernel refuses remains
(``fxopt.fakeprop.view_problem``, checked by the joint pipeline). Values equal those of the NCHW graph up to the order of cuDNN's
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


#: ops whose CUDA kernels take these tensor arguments in NCHW only (``native_group_norm`` checks
#: ``X.is_contiguous()``; its backward raised "view size is not compatible" on a channels_last
#: ``dY``): eager's ``group_norm`` and its gradient formula make them contiguous first
NEEDS_NCHW = {aten.native_group_norm.default: (0,), aten.native_group_norm_backward.default: (0, 1)}


def _nchw_copies(gm: fx.GraphModule, ctx: PassContext) -> int:
    """Contiguous copies in front of the ``NEEDS_NCHW`` arguments the new layouts made other than
    contiguous (propagated on ``ctx.fake_inputs``); how many arguments now read one."""
    from fxopt.fakeprop import propagate

    if not any(n.target in NEEDS_NCHW for n in gm.graph.nodes):
        return 0
    if ctx.fake_inputs is None:
        raise ValueError("no fake inputs to propagate the new layouts to GroupNorm's arguments")
    try:
        propagate(gm, ctx.fake_inputs)
    except Exception:  # noqa: BLE001 - the joint pipeline's own propagation declines the rewrite
        return 0
    copies: dict = {}
    for node in list(gm.graph.nodes):
        for i in NEEDS_NCHW.get(node.target, ()):
            a = node.args[i]
            v = val(a)
            if v is None or v.is_contiguous():
                continue
            if a not in copies:
                with gm.graph.inserting_after(a):
                    copies[a] = gm.graph.call_function(aten.clone.default, (a,),
                                                       {"memory_format": torch.contiguous_format})
            node.update_arg(i, copies[a])
    return sum(len(c.users) for c in copies.values())


#: views whose input the new layouts may reach: each becomes a reshape (a view where the strides allow it)
_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _views_to_reshapes(gm: fx.GraphModule) -> int:
    """Every ``view`` becomes a ``reshape`` (as Inductor's ``view_to_reshape``): the graph was traced
    on NCHW values, where a flatten is a view; on channels_last values it may need a copy, and
    whether it does can depend on strides of size-1 dimensions, which the kernels that run
    (cuDNN's BatchNorm among them) may set otherwise than FakeTensor propagation predicts (a
    ``[1, 2, 1, 2]`` activation flattened into a linear head raised at run time on the GPU). A
    reshape is the view where the strides allow it and one copy where they do not; the values are
    the view's (the graph is functional: no op writes through a view)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS:
            node.target = aten.reshape.default
            n += 1
    return n


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
    reshapes = _views_to_reshapes(gm)
    gm.recompile()
    nchw = _nchw_copies(gm, ctx)
    if nchw:
        gm.graph.lint()
        gm.recompile()
    ctx.note(f"{len(casts)} cast(s) to channels_last before convolutions; "
             f"{len(grads)} weight gradient(s) cast back contiguous"
             + (f"; {nchw} GroupNorm argument(s) read a contiguous copy" if nchw else "")
             + (f"; {reshapes} view(s) made reshapes" if reshapes else ""))
    return PassResult(gm, True)
