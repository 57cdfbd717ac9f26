"""Generated-kernel candidates for graph nodes other than a conv's epilogue.

Each ``plan_*`` function looks at one node of the optimized graph and returns a candidate
(or ``None`` with the node left alone): an object with ``sources`` (the KernelSources to
compile), ``kernels`` (filled by the executor with the compiled ones), a ``name`` and a
``__call__`` with the node's own signature that returns ``None`` when the tensors it gets at
run time do not fit what it was generated for (the executor then runs the reference).

- ``plan_depthwise``: a ``fused_conv`` with groups == C_in == C_out, kernel 1..7, stride 1..2,
  algorithm ``direct`` -> one direct depthwise kernel with bias, residual and activation fused
  (cuDNN runs such a conv and its epilogue as two kernels). It reads the conv weight
  (C, 1, KH, KW) as it is, so folded weights refreshed in place are seen by CUDA graph replays.
- ``plan_maxpool``: ``max_pool2d_with_indices`` whose indices nobody reads -> a max-pool kernel
  that writes no indices.
- ``plan_global_avgpool``: ``mean`` over both spatial dims of a 4-D tensor -> one reduction
  kernel per (n, c) block.

Which implementation runs is measured per node by the executor (``executor.py``), exactly
like conv epilogues; a candidate is only a candidate.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.ops import fused_conv_ref

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def layout_name(v) -> Optional[str]:
    """The codegen layout name ("nchw" / "nhwc") of a value's memory format (the layout pass's
    notion of it), or None (other strides, not a tensor)."""
    from fxopt.passes.layout import CL, NCHW, format_of

    return {NCHW: "nchw", CL: "nhwc"}.get(format_of(v)) if isinstance(v, torch.Tensor) else None


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _ints(v, n=2):
    v = list(v) if isinstance(v, (list, tuple)) else [v] * n
    return tuple(int(x) for x in v) if all(isinstance(x, int) for x in v) else None


def _dense(t: torch.Tensor, layout: str) -> bool:
    from fxopt.backends.cuda.launch import memory_layout_ok

    return memory_layout_ok(t, layout)


def _empty_like_meta(meta: torch.Tensor, device) -> torch.Tensor:
    return torch.empty_strided(tuple(meta.shape), meta.stride(), dtype=meta.dtype, device=device)


class _Candidate:
    def __init__(self, name: str, source):
        self.name = name
        self.sources = {0: source}
        self.kernels: dict = {}

    @property
    def kernel(self):
        return self.kernels.get(0)


# ---------------------------------------------------------------------------- depthwise conv
class DepthwiseConv(_Candidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor, k, stride, padding, dilation):
        from fxopt.backends.cuda.codegen import Epilogue, generate_depthwise_conv2d

        bias, res, act, act_params = node.args[2], node.args[3], node.args[8], node.args[9]
        activation = None if act == "none" else (act, tuple(act_params))
        self.epilogue = Epilogue(bias is not None, res is not None, activation)
        self.layout, self.out_meta = layout, out
        self.x_shape = tuple(_val(node.args[0]).shape[1:])
        super().__init__(f"dw_{node.name}", generate_depthwise_conv2d(
            k, stride, padding, out.dtype, layout, self.epilogue, dilation, weight_layout="ckk"))

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        from fxopt.backends.cuda.launch import launch_depthwise_conv2d

        if self.kernel is None or not _dense(x, self.layout) or not _ckk(weight):
            return None  # not the layout this kernel was generated for: the reference runs
        if tuple(x.shape[1:]) != self.x_shape or x.dtype != self.out_meta.dtype or weight.dtype != x.dtype:
            return None
        if residual is not None and not _dense(residual, self.layout):
            return None
        out = torch.empty_strided((x.shape[0], *self.out_meta.shape[1:]),
                                  _strides(self.layout, (x.shape[0], *self.out_meta.shape[1:])),
                                  dtype=x.dtype, device=x.device)
        return launch_depthwise_conv2d(self.sources[0], x, weight, out, bias, residual, kernel=self.kernel)


def _ckk(w: torch.Tensor) -> bool:
    """A (C, 1, KH, KW) weight whose memory is (C, KH, KW) dense (contiguous or channels_last)."""
    c, _, kh, kw = w.shape
    return (w.stride(3) == 1 or kw == 1) and (w.stride(2) == kw or kh == 1) and (w.stride(0) == kh * kw or c == 1)


def _strides(layout: str, shape) -> tuple:
    n, c, h, w = shape
    return (c * h * w, h * w, w, 1) if layout == "nchw" else (h * w * c, 1, w * c, c)


def plan_depthwise(node: fx.Node) -> Optional[DepthwiseConv]:
    if node.op != "call_function" or node.target is not fused_conv_ref:
        return None
    x, w, out = _val(node.args[0]), _val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 4 or out.dtype not in _DTYPES:
        return None  # only 2-D convolutions in fp32/fp16/bf16
    if not all(isinstance(d, int) for d in (*x.shape[1:], *w.shape, *out.shape[1:])):
        return None  # symbolic sizes
    groups, algorithm = node.args[7], node.args[10]
    if algorithm != "direct" or not isinstance(groups, int) or w.shape[1] != 1:
        return None  # not a plain depthwise conv
    if not (groups == x.shape[1] == w.shape[0] == out.shape[1]):
        return None  # channel multiplier != 1
    k, stride, padding, dilation = _ints(w.shape[2:]), _ints(node.args[4]), _ints(node.args[5]), _ints(node.args[6])
    if None in (k, stride, padding, dilation) or max(k) > 7 or max(stride) > 2:
        return None  # outside the template's range
    layout = layout_name(out)
    if layout is None or layout_name(x) != layout:
        return None
    for t in (node.args[2], node.args[3]):
        if t is not None and (_val(t) is None or _val(t).dtype != out.dtype):
            return None
    return DepthwiseConv(node, layout, out, k, stride, padding, dilation)


# ---------------------------------------------------------------------------- max pool
class MaxPool(_Candidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor, k, stride, padding, ceil_mode):
        from fxopt.backends.cuda.codegen import generate_pool2d

        self.layout, self.k, self.stride, self.padding, self.ceil_mode = layout, k, stride, padding, ceil_mode
        super().__init__(f"maxpool_{node.name}", generate_pool2d("max", k, stride, padding, out.dtype, layout))

    def __call__(self, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        from fxopt.backends.cuda.launch import launch_pool2d, pool2d_output_size

        if self.kernel is None or x.dim() != 4 or not _dense(x, self.layout):
            return None
        oh, ow = pool2d_output_size(x.shape[2], x.shape[3], self.k, self.stride, self.padding, self.ceil_mode)
        shape = (x.shape[0], x.shape[1], oh, ow)
        out = torch.empty_strided(shape, _strides(self.layout, shape), dtype=x.dtype, device=x.device)
        return launch_pool2d(self.sources[0], x, out, kernel=self.kernel), None  # (values, no indices)


def plan_maxpool(node: fx.Node) -> Optional[MaxPool]:
    if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices.default:
        return None
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return None  # the indices are used (training, max_unpool)
    x, out = _val(node.args[0]), node.meta.get("val")
    out = out[0] if isinstance(out, (tuple, list)) else None
    if x is None or out is None or x.dim() != 4 or x.dtype not in _DTYPES:
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    k = _ints(args[1])
    stride = _ints(args[2]) if args[2] else k
    padding = _ints(args[3] if args[3] is not None else 0)
    dilation = _ints(args[4] if args[4] is not None else 1)
    ceil_mode = bool(args[5]) if args[5] is not None else False
    if None in (k, stride, padding, dilation) or dilation != (1, 1):
        return None  # dilated pooling: not in the template
    if padding[0] > k[0] // 2 or padding[1] > k[1] // 2:
        return None  # eager raises; let it
    layout = layout_name(x)
    if layout is None or layout_name(out) != layout:
        return None
    return MaxPool(node, layout, out, k, stride, padding, ceil_mode)


# ---------------------------------------------------------------------------- global average pool
class GlobalAvgPool(_Candidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor):
        from fxopt.backends.cuda.codegen import generate_global_avgpool

        self.layout, self.out_meta = layout, out
        super().__init__(f"gap_{node.name}", generate_global_avgpool(out.dtype, layout))

    def __call__(self, x, dim, keepdim=False, dtype=None):
        from fxopt.backends.cuda.launch import launch_global_avgpool

        if self.kernel is None or x.dim() != 4 or not _dense(x, self.layout) or dtype not in (None, x.dtype):
            return None
        n, c = x.shape[:2]
        y = launch_global_avgpool(self.sources[0], x, kernel=self.kernel)
        if not keepdim:
            return y
        # (N, C, 1, 1) with the strides eager gives (size-1 dims: any stride is the same memory)
        return y.as_strided((n, c, 1, 1), (c, 1, c, c) if self.layout == "nhwc" else (c, 1, 1, 1))


def plan_global_avgpool(node: fx.Node) -> Optional[GlobalAvgPool]:
    if node.op != "call_function" or node.target is not aten.mean.dim:
        return None
    x, out = _val(node.args[0]), node.meta.get("val")
    if x is None or out is None or x.dim() != 4 or x.dtype not in _DTYPES or out.dtype != x.dtype:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dims, (list, tuple)) or sorted(d % 4 for d in dims) != [2, 3]:
        return None  # not a mean over both spatial dims
    if node.kwargs.get("dtype") not in (None, x.dtype):
        return None
    layout = layout_name(x)
    return GlobalAvgPool(node, layout, out) if layout is not None else None


PLANNERS = (plan_depthwise, plan_maxpool, plan_global_avgpool)
