"""pool_backward_layout: padded average-pool gradients on CUDA read NCHW copies.

Why: PyTorch's CUDA ``avg_pool2d_backward`` gives wrong gradients on channels_last tensors when
the pool pads. Measured on an H200 (torch 2.11.0+cu130): each of the 128 padded cases with more
than one channel was wrong, against the same call on NCHW tensors (kernels 2-4, strides 1-2,
padding 1-2, ``count_include_pad`` and ``ceil_mode`` both ways, inputs [2, C, 7, 6] and [2, C, 4, 4],
C = 2 or 8). Errors were 0.15 to 4.8 on unit-normal gradients; NCHW was within 2e-7 of float64.
None of the 256 cases without padding or with one channel were wrong. Against float64 on the CPU
(H200, 2026-12-03): channels_last 0.46 to 3.3 off in float32 *and* float64 ([1, 5, 6, 9] and
[2, 8, 7, 6], kernels 2-3, padding 1), NCHW 2e-7 and 0; so a float64 run in eager's layout on the
GPU shares eager's error (the fuzzer's reference runs on the CPU).

The layout reaches the call in two ways. The training layout pass makes convolutions
channels_last, and their activations flow into the pool's backward. A generated kernel may also
lay out a tensor with a dimension of size 1 so that ATen reads it as channels_last. For example, a
[1, 1, 6, 1] value with strides (6, 1, 1, 1) counts as contiguous *and* channels_last, and the
kernel then took the NHWC path (GPU fuzz 7c5eb76ce1: a weight gradient 267 off; eager's is 0.18).
So the traced strides cannot say whether the NHWC kernel will run. The copy is made whenever it
could. (``training_layout``'s copies for GroupNorm, ``NEEDS_NCHW``, go by the traced
layout and run only where that pass changed it: neither holds here, hence a pass of its own.)

Matches: ``aten.avg_pool2d_backward`` on a CUDA value with a padding above 0.

Produces: the gradient and the pool's input each through ``clone(memory_format=contiguous_format)``,
which gives fresh, canonical NCHW strides (eager's NCHW layout, which takes the NCHW kernel). Where
the traced gradient is channels_last, it is copied back to channels_last, so what reads it sees the
traced layout. The values are those of NCHW eager.

Illegal (kept, with the reason): a pool that does not pad; values not on CUDA, or of unknown
device; other than 4-D; one that reads such copies already (the pass is idempotent).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from fxopt.passinfra import PassContext, PassResult, is_call, val

aten = torch.ops.aten


def _is_nchw_copy(a) -> bool:
    return (isinstance(a, fx.Node) and is_call(a, aten.clone.default)
            and a.kwargs.get("memory_format") is torch.contiguous_format)


def illegal_reason(node: fx.Node) -> Optional[str]:
    """Why this pool gradient may run as it is, or None."""
    grad, x, padding = node.args[0], node.args[1], node.args[4]
    if _is_nchw_copy(grad) and _is_nchw_copy(x):
        return "it reads NCHW copies already"
    vx = val(x)
    if vx is None or vx.device.type != "cuda":
        return "not a CUDA value (or its device is unknown)"
    if vx.dim() != 4 or not isinstance(grad, fx.Node):
        return "not a 4-D pool"
    pads = list(padding) if isinstance(padding, (list, tuple)) else [padding]
    if not any(p != 0 for p in pads):
        return "the pool does not pad"
    return None


def _nchw(gm: fx.GraphModule, node: fx.Node, arg: fx.Node) -> fx.Node:
    with gm.graph.inserting_before(node):
        copy = gm.graph.call_function(aten.clone.default, (arg,), {"memory_format": torch.contiguous_format})
    v = val(arg)
    if v is not None:
        copy.meta["val"] = v.clone(memory_format=torch.contiguous_format)
    return copy


def run(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    changed = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, aten.avg_pool2d_backward.default):
            continue
        why = illegal_reason(node)
        if why:
            ctx.note(f"{node.name}: kept ({why})")
            continue
        node.update_arg(0, _nchw(gm, node, node.args[0]))
        node.update_arg(1, _nchw(gm, node, node.args[1]))
        out = val(node)
        if out is not None and not out.is_contiguous() and out.is_contiguous(memory_format=torch.channels_last):
            with gm.graph.inserting_after(node):
                back = gm.graph.call_function(aten.clone.default, (node,), {"memory_format": torch.channels_last})
            node.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)
            back.meta = dict(node.meta)
            node.meta["val"] = out.clone(memory_format=torch.contiguous_format)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
        ctx.note(f"{changed} padded average-pool gradient(s) read NCHW copies")
    return PassResult(gm, bool(changed))
