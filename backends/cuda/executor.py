"""The cuda executor's lowering: choose how each fused convolution runs on the GPU.

For a ``fused_conv`` with a ReLU epilogue (with or without residual add), cuDNN
has fused operators (``aten.cudnn_convolution_relu`` and
``aten.cudnn_convolution_add_relu``) that apply the epilogue inside the
convolution. Whether they beat convolution + separate epilogue depends on the
shape, so each eligible convolution is timed both ways once (CUDA events,
median) and the faster is kept; the decision is stored in the same autotuning
cache as the algorithm choice, so a second compile measures nothing.

Without a GPU nothing is measured and the reference implementation runs.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from fxopt.ops import fused_conv_ref


def cudnn_conv_relu(x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                    algorithm="direct", prepacked=None):
    """fused_conv with a ReLU epilogue, as one cuDNN fused operator."""
    if residual is None:
        return torch.ops.aten.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
    return torch.ops.aten.cudnn_convolution_add_relu(x, weight, residual, 1.0, bias, stride, padding, dilation,
                                                     groups)


def eligible(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not fused_conv_ref:
        return False
    x, w = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    return (x is not None and w is not None and x.dim() == 4 and x.is_cuda and node.args[8] == "relu"
            and node.args[10] == "direct" and x.dtype in (torch.float16, torch.float32)
            and torch.backends.cudnn.is_available() and isinstance(x.shape[0], int))


def _measure(node: fx.Node) -> dict:
    from fxopt.autotune import _time_ms

    x_v, w_v = node.args[0].meta["val"], node.args[1].meta["val"]
    r_v = node.args[3].meta["val"] if node.args[3] is not None else None

    def real(v):
        t = torch.randn(tuple(v.shape), device=v.device, dtype=v.dtype)
        return t.contiguous(memory_format=torch.channels_last) if v.is_contiguous(
            memory_format=torch.channels_last) and not v.is_contiguous() else t

    x, w = real(x_v), real(w_v) * 0.05
    b = torch.randn(w.shape[0], device=x.device, dtype=x.dtype) if node.args[2] is not None else None
    r = real(r_v) if r_v is not None else None
    rest = list(node.args[4:])
    inputs = [x, real(x_v), real(x_v)]
    with torch.no_grad():
        ref = fused_conv_ref(x, w, b, r, *rest)
        fused = cudnn_conv_relu(x, w, b, r, *rest)
        err = ((fused.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12)).item()
        t_ref = _time_ms(lambda t: fused_conv_ref(t, w, b, r, *rest), inputs, "cuda")
        t_fused = _time_ms(lambda t: cudnn_conv_relu(t, w, b, r, *rest), inputs, "cuda")
    tol = 1e-2 if x.dtype == torch.float16 else 1e-3
    return {"reference_ms": t_ref, "cudnn_fused_ms": t_fused, "rel_error": err,
            "use_cudnn_fused": bool(t_fused < t_ref and err <= tol)}


def attach_kernels(runnable: fx.GraphModule, ctx, info: dict) -> fx.GraphModule:
    """Switch eligible convolutions to cuDNN fused operators where measured faster."""
    if not torch.cuda.is_available():
        return runnable
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from fxopt.autotune import AutotuneCache, default_cache_path, device_fingerprint

    opt = ctx.options.autotune_cache
    cache = AutotuneCache(None if opt is False else (opt if isinstance(opt, str) else default_cache_path()))
    device = device_fingerprint("cuda")
    decisions = {}
    changed = False
    for node in runnable.graph.nodes:
        if not eligible(node):
            continue
        x_v, w_v = node.args[0].meta["val"], node.args[1].meta["val"]
        key = (f"cudnn_fusion|x={tuple(x_v.shape)}|w={tuple(w_v.shape)}|{x_v.dtype}|res={node.args[3] is not None}"
               f"|bias={node.args[2] is not None}|{node.args[4:8]}|cl={x_v.is_contiguous(memory_format=torch.channels_last)}")
        entry = cache.get(device, key)
        if entry is None:
            with unset_fake_temporarily():
                entry = _measure(node)
            ctx.measurements += 2
            cache.put(device, key, entry)
        decisions[node.name] = entry
        if entry["use_cudnn_fused"]:
            node.target = cudnn_conv_relu
            changed = True
    if changed:
        runnable.recompile()
    info["cudnn_fusions"] = decisions
    return runnable
