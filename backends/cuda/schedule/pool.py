"""Template candidates for pooling nodes (measured by the executor against the reference and
against the fusion scheduler's generated kernel of the same node).

- ``plan_maxpool``: ``max_pool2d_with_indices`` whose indices nobody reads -> a max-pool kernel
  that writes no indices.
- ``plan_global_avgpool``: ``mean`` over both spatial dims of a 4-D tensor -> one reduction
  kernel per (n, c) block.

Each returns a candidate (``sources`` to compile, ``kernels`` filled by the executor, a
``__call__`` with the node's own signature that returns ``None`` when the tensors it gets at run
time do not fit what it was generated for) or ``None`` with the node left alone.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen import layout_name
from fxopt.backends.cuda.schedule import TemplateCandidate, dense_strides, ints, node_val

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dense(t: torch.Tensor, layout: str) -> bool:
    from fxopt.backends.cuda.runtime.launch import memory_layout_ok

    return memory_layout_ok(t, layout)


# ---------------------------------------------------------------------------- max pool
# ---------------------------------------------------------------------------- max pool
class MaxPool(TemplateCandidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor, k, stride, padding, ceil_mode):
        from fxopt.backends.cuda.codegen import generate_pool2d

        self.layout, self.k, self.stride, self.padding, self.ceil_mode = layout, k, stride, padding, ceil_mode
        super().__init__(f"maxpool_{node.name}", generate_pool2d("max", k, stride, padding, out.dtype, layout))

    def __call__(self, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
        from fxopt.backends.cuda.runtime.launch import launch_pool2d, pool2d_output_size

        if self.kernel is None or x.dim() != 4 or not _dense(x, self.layout):
            return None
        oh, ow = pool2d_output_size(x.shape[2], x.shape[3], self.k, self.stride, self.padding, self.ceil_mode)
        shape = (x.shape[0], x.shape[1], oh, ow)
        out = torch.empty_strided(shape, dense_strides(self.layout, shape), dtype=x.dtype, device=x.device)
        return launch_pool2d(self.sources[0], x, out, kernel=self.kernel), None  # (values, no indices)


def plan_maxpool(node: fx.Node) -> Optional[MaxPool]:
    if node.op != "call_function" or node.target is not aten.max_pool2d_with_indices.default:
        return None
    if any(u.target is not operator.getitem or u.args[1] != 0 for u in node.users):
        return None  # the indices are used (training, max_unpool)
    x, out = node_val(node.args[0]), node.meta.get("val")
    out = out[0] if isinstance(out, (tuple, list)) else None
    if x is None or out is None or x.dim() != 4 or x.dtype not in _DTYPES:
        return None
    args = list(node.args) + [None] * (6 - len(node.args))
    k = ints(args[1])
    stride = ints(args[2]) if args[2] else k
    padding = ints(args[3] if args[3] is not None else 0)
    dilation = ints(args[4] if args[4] is not None else 1)
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
class GlobalAvgPool(TemplateCandidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor):
        from fxopt.backends.cuda.codegen import generate_global_avgpool

        self.layout, self.out_meta = layout, out
        super().__init__(f"gap_{node.name}", generate_global_avgpool(out.dtype, layout))

    def __call__(self, x, dim, keepdim=False, dtype=None):
        from fxopt.backends.cuda.runtime.launch import launch_global_avgpool

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
    x, out = node_val(node.args[0]), node.meta.get("val")
    if x is None or out is None or x.dim() != 4 or x.dtype not in _DTYPES or out.dtype != x.dtype:
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if not isinstance(dims, (list, tuple)) or sorted(d % 4 for d in dims) != [2, 3]:
        return None  # not a mean over both spatial dims
    if node.kwargs.get("dtype") not in (None, x.dtype):
        return None
    layout = layout_name(x)
    return GlobalAvgPool(node, layout, out) if layout is not None else None
