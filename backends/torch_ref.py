"""The torch reference executor: runs the optimized FX graph with PyTorch operators.

It is the executor on CPU and the semantic reference for every other one. The
fused custom ops are called through their Python implementations directly
(skipping the dispatcher round trip, which costs microseconds per node); what
they compute is unchanged. Every ``view`` runs as a ``reshape`` (as Inductor's
``view_to_reshape``): the graph's views were traced on eager's strides, and the
values they meet at run time may have others (the layout pass's channels_last
values; a size-1 dimension's stride that a library kernel sets otherwise than
FakeTensor propagation predicts), where a view raises and a reshape copies once
(GPU fuzz seeds 41, 51, 63: "view size is not compatible with input tensor's
size and stride"). Where the strides allow it a reshape is the same view. For the same reason
GroupNorm's gradient gets its ``dY`` and ``X`` laid out at run time as eager's gradient formula lays
them out (``group_norm_backward_nchw``, a no-op where they are): its CUDA kernel views them as NCHW,
and a ``[1, 2, 1, 2]`` gradient whose metadata said contiguous came channels_last from the kernel
before it (GPU fuzz c0a961fbcc).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.lowered import Lowered
from fxopt.ops import FUSED_CONV, FUSED_LINEAR, fused_conv_ref, fused_linear_ref

EXECUTOR = "torch"



def group_norm_backward_nchw(grad, x, *args):
    """``native_group_norm_backward`` on ``grad`` and ``x`` laid out as eager's gradient formula hands
    them: contiguous on CUDA (its kernel views them as NCHW), on the CPU dense in the format ``x``
    suggests (its kernel has a channels_last path, and a contiguous copy sums in another order: under
    bfloat16 autocast, a step's bias gradient 0.43 off where eager's was 0.05, CPU fuzz e171964d6b),
    elsewhere as they are; ``contiguous()`` returns a tensor so laid out itself."""
    if x.device.type == "cpu":
        fmt = _suggested_format(x)
        grad, x = grad.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt)
    elif x.device.type == "cuda":
        grad, x = grad.contiguous(), x.contiguous()
    return torch.ops.aten.native_group_norm_backward.default(grad, x, *args)


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    """``Tensor::suggest_memory_format()``, which Python does not expose."""
    try:
        from torch._prims_common import suggest_memory_format

        return suggest_memory_format(x)
    except (ImportError, AttributeError, TypeError):
        cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
        return torch.channels_last if cl else torch.contiguous_format


DIRECT_IMPLS = {FUSED_CONV: fused_conv_ref, FUSED_LINEAR: fused_linear_ref,
                torch.ops.aten.native_group_norm_backward.default: group_norm_backward_nchw}
#: views the runnable graph runs as reshapes (see the module's docstring)
VIEWS_AS_RESHAPE = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def lower(gm: fx.GraphModule) -> fx.GraphModule:
    """A runnable copy of `gm` whose fused nodes call their implementations directly."""
    from fxopt.pipeline import copy_graph, module_of

    graph = copy_graph(gm)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in DIRECT_IMPLS:
            node.target = DIRECT_IMPLS[node.target]
        elif node.op == "call_function" and node.target in VIEWS_AS_RESHAPE:
            node.target = torch.ops.aten.reshape.default
    return module_of(gm, graph)


def lower_graph(gm: fx.GraphModule, ctx, kind: str) -> Lowered:
    """The torch executor for CPU inputs (on CUDA inputs it is ``cuda_entry.lower_graph`` without
    generated kernels: CUDA graphs replay the reference graph)."""
    from fxopt.autotune import cudnn_choice

    why = "option cudagraphs=False" if ctx.options.cudagraphs is False else "inputs are not on CUDA"
    # cuDNN (a CPU graph may still call it through a CUDA op) chooses as option cudnn_search says
    # in inference, as the user set it in training (fxopt.autotune.cudnn_choice)
    fn = cudnn_choice(lower(gm), ctx.options.cudnn_search or kind != "inference")
    return Lowered(fn=fn, executor=EXECUTOR, cudagraphs=f"off ({why})")
