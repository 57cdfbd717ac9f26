"""The pooling family: template kernels for pooling nodes (measured by the executor against the reference and
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

import math
import operator
from typing import Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.c import act_lines, ctype as _ctype, decompose as _decompose, norm_acts as _norm_acts, prelude as _prelude
from fxopt.backends.cuda.codegen.source import KernelSource, DTYPE_SHORT, c_comment, index_type, checked_layout, int_pair, unique_name, layout_name
from fxopt.backends.cuda.kernels.common import (TemplateCandidate, check_layout, compiled_kernel, dense_strides, ints, load,
                        memory_layout_ok, node_val)

aten = torch.ops.aten


def generate_pool2d(kind: str, k, stride=None, padding=0, dtype: torch.dtype = torch.float32,
                    layout: str = "nchw", pre_activation=None, count_include_pad: bool = True,
                    index64: bool = False, block: int = 256) -> KernelSource:
    """max/avg pool2d (pool(act(x)), PyTorch semantics incl. ceil_mode windows). Launch args:
    x, y, N, C, H, W, OH, OW; one thread per output element."""
    if kind not in ("max", "avg"):
        raise ValueError(f"pool kind must be 'max' or 'avg', not {kind!r}")
    (KH, KW), (PH, PW) = int_pair(k), int_pair(padding)
    SH, SW = int_pair(stride if stride is not None else k)
    if PH > KH // 2 or PW > KW // 2 or min(KH, KW, SH, SW) < 1:
        raise ValueError("pool2d: padding must be at most half the kernel size")
    lay, ct = checked_layout(layout), _ctype(dtype)
    acts = _norm_acts(pre_activation)
    name = unique_name(f"fx_{kind}pool{KH}x{KW}_s{SH}x{SW}_{DTYPE_SHORT[dtype]}_{lay}", KH, KW, SH, SW, PH, PW,
                  acts, count_include_pad, index64, block)
    decompose, in_at = _decompose(lay)
    finish = "" if kind == "max" else load("avg_finish.cu").substitute(
        KH=KH, KW=KW, PH=PH, PW=PW, count_include_pad="true" if count_include_pad else "false")
    src = load("pool2d.cu").substitute(
        prelude=_prelude({dtype}), kind=kind, KH=KH, KW=KW, SH=SH, SW=SW, PH=PH, PW=PW, layout=lay,
        act_name=c_comment(acts or "none"), block=block, name=name, T=ct,
        idx=index_type(index64), decompose=decompose, in_at=in_at,
        init="(-__int_as_float(0x7f800000))" if kind == "max" else "0.f",
        act=act_lines(acts, "v", " " * 8),
        accumulate="if (v > acc || v != v) acc = v;" if kind == "max" else "acc += v;", finish=finish)
    params = (("x", f"const {ct}*"), ("y", f"{ct}*")) + tuple((n, "long long") for n in
                                                              ("N", "C", "H", "W", "OH", "OW"))
    meta = {"layout": lay, "kind": kind, "k": (KH, KW), "stride": (SH, SW), "padding": (PH, PW)}
    return KernelSource(name, src, params, "pool2d", meta, (block, 1, 1), index64)


def generate_global_avgpool(dtype: torch.dtype = torch.float32, layout: str = "nchw",
                            index64: bool = False) -> KernelSource:
    """Global average pool + flatten: (N, C, H, W) -> (N, C). Launch args: x, y, N, C, HW;
    ``grid_block(N=..., C=...)``."""
    lay, ct = checked_layout(layout), _ctype(dtype)
    name = f"fx_gap_{DTYPE_SHORT[dtype]}_{lay}{'_i64' if index64 else ''}"
    tmpl = load("global_avgpool_nchw.cu") if lay == "nchw" else load("global_avgpool_nhwc.cu")
    src = tmpl.substitute(prelude=_prelude({dtype}), name=name, T=ct, idx=index_type(index64))
    params = (("x", f"const {ct}*"), ("y", f"{ct}*"), ("N", "long long"), ("C", "long long"),
              ("HW", "long long"))
    return KernelSource(name, src, params, "global_avgpool", {"layout": lay}, (32, 8, 1), index64)


def pool2d_output_size(H: int, W: int, k, stride=None, padding=0, ceil_mode: bool = False):
    """PyTorch's pooling output size (incl. ceil_mode's last-window rule)."""
    def one(n, k, s, p):
        o = (n + 2 * p - k + ((s - 1) if ceil_mode else 0)) // s + 1
        return o - 1 if ceil_mode and (o - 1) * s >= n + p else o
    kh, kw = (k, k) if isinstance(k, int) else k
    stride = k if stride is None else stride
    sh, sw = (stride, stride) if isinstance(stride, int) else stride
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    return one(H, kh, sh, ph), one(W, kw, sw, pw)


def launch_pool2d(ks: KernelSource, x: torch.Tensor, out: torch.Tensor, kernel=None) -> torch.Tensor:
    lay = ks.meta["layout"]
    check_layout(x, lay, f"{ks.name}: x")
    check_layout(out, lay, f"{ks.name}: out", x.dtype)
    N, C, H, W = x.shape
    OH, OW = out.shape[2:]
    if out.numel() == 0:
        return out
    grid, block = ks.grid_block(out.numel(), extent=x.numel())
    compiled_kernel(ks, kernel).launch(grid, block, [x, out, N, C, H, W, OH, OW])
    return out


def launch_global_avgpool(ks: KernelSource, x: torch.Tensor, out: torch.Tensor | None = None,
                          kernel=None) -> torch.Tensor:
    """(N, C, H, W) -> (N, C)."""
    check_layout(x, ks.meta["layout"], f"{ks.name}: x")
    N, C = x.shape[:2]
    HW = math.prod(x.shape[2:])
    out = torch.empty((N, C), dtype=x.dtype, device=x.device) if out is None else out
    if out.numel() == 0:
        return out
    grid, block = ks.grid_block(x.numel(), N=N, C=C)
    compiled_kernel(ks, kernel).launch(grid, block, [x, out, N, C, HW])
    return out


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dense(t: torch.Tensor, layout: str) -> bool:
    return memory_layout_ok(t, layout)


class MaxPool(TemplateCandidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor, k, stride, padding, ceil_mode):
        self.layout, self.k, self.stride, self.padding, self.ceil_mode = layout, k, stride, padding, ceil_mode
        super().__init__(f"maxpool_{node.name}", generate_pool2d("max", k, stride, padding, out.dtype, layout))

    def __call__(self, x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
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


class GlobalAvgPool(TemplateCandidate):
    def __init__(self, node: fx.Node, layout: str, out: torch.Tensor):
        self.layout, self.out_meta = layout, out
        super().__init__(f"gap_{node.name}", generate_global_avgpool(out.dtype, layout))

    def __call__(self, x, dim, keepdim=False, dtype=None):
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
