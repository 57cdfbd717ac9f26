"""The cuda executor's entry: what it offers the passes, and its lowering into a ``Lowered``.

- ``capabilities()``: the ``fxopt.target.Target`` fields for CUDA graphs. It registers the CUDA
  kernels of fxopt's fused training ops (cuDNN's extended BatchNorm for ``fxopt::batch_norm_relu``
  and its backward, ``torch.library.register_kernel`` for the "cuda" dispatch key) and hands the
  passes cuDNN's probe. Called by the backend entry when it builds a CUDA target, never on import.
- ``lower_graph(gm, ctx, kind)``: the reference graph, with the generated kernels of
  ``backends/cuda/runtime/executor.py`` (``attach_kernels``, which still writes an ``info`` dict:
  it becomes the ``Lowered`` record here) for the cuda executor, and replayed as CUDA graphs per
  input signature (``backends/cuda/runtime/cudagraphs.py``), with option ``streams`` the graph's
  branches on several streams as a measured alternative of each capture
  (``backends/cuda/runtime/stream_capture.py``). The torch executor on CUDA inputs lowers here too,
  without generated kernels.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from fxopt.autotune import cudnn_choice
from fxopt.backends import torch_ref
from fxopt.backends.cuda.runtime.cudagraphs import CudaGraphRunner, unsafe_reason
from fxopt.backends.cuda.runtime.stream_capture import not_run, stream_alternative
from fxopt.backends.lowering import (constants_refresher, decisions_cache, placeholder_indices, read_params,
                                     unoptimized_baseline)
from fxopt.lowered import Lowered
from fxopt.passinfra import written_in_place

EXECUTOR = "cuda"


def _cudnn_batchnorm():
    from fxopt.backends.cuda.kernels import batchnorm_train as cudnn_batchnorm

    return cudnn_batchnorm


def _batch_norm_relu_cuda(x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes, backend):
    from fxopt import ops

    if backend != "cudnn":
        return ops.batch_norm_relu_native(x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes)
    cb = _cudnn_batchnorm()
    out = cb.forward(x, z, weight, bias, running_mean, running_var, momentum, eps)
    if out[3].numel() != reserve_bytes:  # the graph was traced with another reserve size
        raise cb.CudnnError(f"cuDNN's reserve space is {out[3].numel()} bytes, the graph's {reserve_bytes}")
    return out


def _batch_norm_relu_update_cudnn(x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes):
    cb = _cudnn_batchnorm()
    out = cb.forward(x, z, weight, bias, running_mean, running_var, momentum, eps, in_place=True)
    if out[3].numel() != reserve_bytes:
        raise cb.CudnnError(f"cuDNN's reserve space is {out[3].numel()} bytes, the graph's {reserve_bytes}")
    return out[:4]


def _batch_norm_relu_backward_cuda(grad, x, y, weight, bias, save_mean, save_invstd, reserve, eps, with_add,
                                   backend):
    from fxopt import ops

    if backend != "cudnn":
        return ops.batch_norm_relu_backward_native(grad, x, y, weight, bias, save_mean, save_invstd, eps, with_add)
    return _cudnn_batchnorm().backward(grad, x, y, weight, bias, save_mean, save_invstd, reserve, eps, with_add)


@functools.cache
def register_kernels() -> None:
    """The CUDA kernels of ``fxopt::batch_norm_relu`` / ``fxopt::batch_norm_relu_backward`` (their
    ``backend="cudnn"`` form: cuDNN's extended BatchNorm; ``"native"`` stays PyTorch's kernels), and
    the in-place form the cuda executor's last step runs (``ops.batch_norm_relu_update``). Once per
    process, when a CUDA target is built."""
    from fxopt import ops

    torch.library.register_kernel("fxopt::batch_norm_relu", "cuda", _batch_norm_relu_cuda)
    torch.library.register_kernel("fxopt::batch_norm_relu_backward", "cuda", _batch_norm_relu_backward_cuda)
    ops.register_batch_norm_relu_update("cudnn", _batch_norm_relu_update_cudnn)


def capabilities(executor: str) -> dict:
    """``Target`` fields for CUDA inputs run by ``executor`` ("cuda", or "torch": both run fxopt's
    ops through PyTorch's dispatcher, so both get the registered cuDNN kernels)."""
    register_kernels()
    return {"batch_norm_relu": "cudnn", "batch_norm_relu_probe": _cudnn_batchnorm().probe,
            "fused_ops": ("cudnn_batch_norm_relu",) + (("generated_kernels",) if executor == EXECUTOR else ())}


def lower_graph(gm: fx.GraphModule, ctx, kind: str, kernels: bool = True) -> Lowered:
    """``gm`` for CUDA inputs: generated kernels (``kernels``: the cuda executor; the torch executor
    runs the reference graph) and CUDA graphs where safe."""
    runnable = torch_ref.lower(gm)
    info = {"executor": EXECUTOR if kernels else "torch", "cudagraphs": "off", "kernels": []}
    if kernels:
        from fxopt.backends.cuda.runtime.executor import attach_kernels

        runnable = attach_kernels(runnable, ctx, info)
    low = Lowered.from_info(None, info)
    training = kind != "inference"
    reason = unsafe_reason(gm, kind, ctx.device_type, ctx.param_placeholders)
    if training and ctx.training_link is None and not reason:
        reason = "training graph compiled without its forward/backward link"
    # cuDNN chooses as the user set it in training (fxopt measures no conv algorithms there); in
    # inference by its heuristics unless option cudnn_search (fxopt.autotune.cudnn_choice)
    search = ctx.options.cudnn_search or training
    low.fn = cudnn_choice(runnable, search)
    off = "option cudagraphs=False" if ctx.options.cudagraphs is False else reason
    planned = low.details.get("streams") if kernels and not training else None  # option streams' listing
    if off:
        low.cudagraphs = f"off ({off})"
        if ctx.device_type == "cuda":
            not_run(planned, off)
        return low
    streams = (stream_alternative(runnable, ctx.options.streams, lambda f: cudnn_choice(f, search), planned)
               if planned else None)
    baseline = unoptimized_baseline(gm, ctx, deferred=True)  # made where a signature measures it
    refresh, folded_from = constants_refresher(runnable)
    written = [n.name for n in gm.graph.nodes if n.op == "placeholder" and written_in_place(n)]
    # fixed weights: nothing watched per call (folded constants made on the first call, kept)
    fixed = ctx.fixed_weights and not training and not written
    low.fn = low.cudagraph_runner = CudaGraphRunner(
        low.fn, placeholder_indices(gm, ctx.param_placeholders), refresh=refresh,
        versioned=[] if fixed else folded_from, max_graphs=ctx.options.cudagraph_max_signatures,
        watched=[] if fixed else read_params(runnable, ctx.param_placeholders),
        baseline=None if baseline is None else cudnn_choice(baseline, search),
        baseline_watched=(None if baseline is None else
                          [] if fixed else read_params(baseline, ctx.param_placeholders)),
        decisions_cache=decisions_cache(ctx, runnable, baseline),
        training=ctx.training_link if training else None, written=placeholder_indices(gm, written),
        streams=streams, inputs_move=ctx.per_size,
        # a size of a symbolic graph: one warm-up before its capture (a library's lazy set-up, the new
        # shapes' cuDNN plans, happens in the first; a second is one more run in each new size's first call)
        warmup=1 if ctx.per_size else 2)
    low.cudagraphs = f"on (up to {ctx.options.cudagraph_max_signatures} signatures)"
    low.baseline_check = baseline is not None
    return low
