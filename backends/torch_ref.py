"""The torch reference executor: runs the optimized FX graph with PyTorch operators.

It is the executor on CPU and the semantic reference for every other one. The
fused custom ops are called through their Python implementations directly
(skipping the dispatcher round trip, which costs microseconds per node); what
they compute is unchanged.
"""
from __future__ import annotations

import torch.fx as fx

from fxopt.lowered import Lowered
from fxopt.ops import FUSED_CONV, FUSED_LINEAR, fused_conv_ref, fused_linear_ref

EXECUTOR = "torch"

DIRECT_IMPLS = {FUSED_CONV: fused_conv_ref, FUSED_LINEAR: fused_linear_ref}


def lower(gm: fx.GraphModule) -> fx.GraphModule:
    """A runnable copy of `gm` whose fused nodes call their implementations directly."""
    from fxopt.pipeline import copy_graph_module

    runnable = copy_graph_module(gm)
    for node in runnable.graph.nodes:
        if node.op == "call_function" and node.target in DIRECT_IMPLS:
            node.target = DIRECT_IMPLS[node.target]
    runnable.recompile()
    return runnable


def lower_graph(gm: fx.GraphModule, ctx, kind: str) -> Lowered:
    """The torch executor for CPU inputs (on CUDA inputs it is ``cuda_entry.lower_graph`` without
    generated kernels: CUDA graphs replay the reference graph)."""
    from fxopt.autotune import cudnn_choice

    why = "option cudagraphs=False" if ctx.options.cudagraphs is False else "inputs are not on CUDA"
    # cuDNN (a CPU graph may still call it through a CUDA op) chooses as option cudnn_search says
    # in inference, as the user set it in training (fxopt.autotune.cudnn_choice)
    fn = cudnn_choice(lower(gm), ctx.options.cudnn_search or kind != "inference")
    return Lowered(fn=fn, executor=EXECUTOR, cudagraphs=f"off ({why})")
