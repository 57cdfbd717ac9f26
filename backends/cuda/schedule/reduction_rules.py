"""Lowering rules of reductions (``REDUCTIONS``): sum / mean / amax / amin / var / var_mean / std,
softmax and log-softmax, LayerNorm, GroupNorm, batch-statistics BatchNorm (instance norm) and a
global average pool.

A rule returns a ``RowSpec``: the (virtual) input index space, which of its dims are reduced, the
reduction phases (softmax's max then sum, LayerNorm's mean then variance), and each output's value
and where it is stored (``OutputSpec``: at every index of the row, or once per row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.ir import Const, Expr, Ix, Red, op
from fxopt.backends.cuda.kernels.common import meta
from .values import FLOATS, Decline, Value, norm_dim, reduced_dims, row_major

aten = torch.ops.aten


@dataclass
class OutputSpec:
    """Output ``item`` of a reduction node (None: the node itself; else its getitem index):
    ``row`` outputs are stored at every index of the virtual input space, ``outer`` ones once
    per row. ``value(idx)`` over the virtual input index; ``index(idx)`` the output's logical
    index for it."""
    item: Optional[int]
    kind: str
    value: Callable
    index: Callable


@dataclass
class RowSpec:
    shape: tuple            # virtual input index space
    reduced: tuple          # which of its dims are reduced
    phases: list            # (name, op, fn(idx) -> Expr)
    outputs: list = field(default_factory=list)  # OutputSpec

    @property
    def row_size(self) -> int:
        return math.prod(self.shape[d] for d in self.reduced)


def _keep_or_drop(shape_in: tuple, reduced: tuple, out_rank: int) -> Callable:
    """Output index of a reduction over ``reduced`` with or without keepdim."""
    keep = out_rank == len(shape_in)

    def index(idx):
        if keep:
            return [Ix() if d in reduced else idx[d] for d in range(len(shape_in))]
        return [idx[d] for d in range(len(shape_in)) if d not in reduced]
    return index


def _float_input(node: fx.Node, value_of: Callable, i: int = 0) -> Value:
    v = value_of(node.args[i])
    if v.dtype not in FLOATS:
        raise Decline(f"reduction over {v.dtype}")
    return v


def _simple_reduction(kind: str):
    def rule(node: fx.Node, value_of: Callable) -> RowSpec:
        x = _float_input(node, value_of)
        out = meta(node)
        n = len(x.shape)
        if node.target in (aten.sum.default, aten.mean.default):
            dims = tuple(range(n))
        else:
            dims = reduced_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), n)
        if node.kwargs.get("dtype") not in (None, out.dtype) or out.dtype not in FLOATS:
            raise Decline("reduction to another dtype")
        r = math.prod(x.shape[d] for d in dims)
        if r == 0:
            raise Decline("empty reduction")
        red_op = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min"}[kind]
        phases = [("acc", red_op, lambda idx: x.load(idx))]
        scale = 1.0 / r if kind == "mean" else None
        value = (lambda idx: op("mul", Red("acc"), Const(scale))) if scale else (lambda idx: Red("acc"))
        spec = RowSpec(x.shape, dims, phases)
        spec.outputs.append(OutputSpec(None, "outer", value, _keep_or_drop(x.shape, dims, out.dim())))
        return spec
    return rule


def _variance(node: fx.Node, value_of: Callable) -> RowSpec:
    """var / var_mean / std (.correction): the mean, then the sum of squared deviations."""
    x = _float_input(node, value_of)
    n = len(x.shape)
    dims = reduced_dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), n)
    corr = node.kwargs.get("correction", 1)
    corr = 1.0 if corr is None else float(corr)
    keepdim = bool(node.kwargs.get("keepdim", False))
    r = math.prod(x.shape[d] for d in dims)
    if r == 0:
        raise Decline("empty reduction")
    mean = _row_mean(r)
    phases = [("sum", "sum", lambda idx: x.load(idx)),
              ("m2", "sum", lambda idx: _sq(op("sub", x.load(idx), mean)))]
    var = op("div", Red("m2"), Const(max(r - corr, 0.0)))
    index = _keep_or_drop(x.shape, dims, n if keepdim else n - len(dims))
    spec = RowSpec(x.shape, dims, phases)
    if node.target is aten.var_mean.correction:
        spec.outputs += [OutputSpec(0, "outer", lambda idx: var, index), OutputSpec(1, "outer", lambda idx: mean, index)]
    elif node.target is aten.std.correction:
        spec.outputs.append(OutputSpec(None, "outer", lambda idx: op("sqrt", var), index))
    else:
        spec.outputs.append(OutputSpec(None, "outer", lambda idx: var, index))
    return spec


def _row_mean(r: int) -> Expr:
    """The mean of a statistics row: its sum divided by ``r`` (IEEE division, not a product with
    ``1 / r``), so that a constant row's mean is that constant, as eager's Welford statistics give:
    ``-10.5 * float32(1 / 7)`` is ``-1.5000001``, and its deviation 1.2e-7, scaled by
    ``rsqrt(eps = 1e-5)``, was a normalized value of 3.8e-5 where eager's is 0."""
    return op("div", Red("sum"), Const(float(r)))


def _sq(e: Expr) -> Expr:
    return op("mul", e, e)


def _softmax(log: bool):
    def rule(node: fx.Node, value_of: Callable) -> RowSpec:
        x = _float_input(node, value_of)
        out = meta(node)
        if out.dtype not in FLOATS:
            raise Decline("softmax dtype")
        dim = norm_dim(int(node.args[1]), len(x.shape))
        if x.shape[dim] == 0:
            raise Decline("empty softmax")
        phases = [("max", "max", lambda idx: x.load(idx)),
                  ("sum", "sum", lambda idx: op("exp", op("sub", x.load(idx), Red("max"))))]
        if log:
            value = lambda idx: op("sub", op("sub", x.load(idx), Red("max")), op("log", Red("sum")))  # noqa: E731
        else:
            value = lambda idx: op("div", op("exp", op("sub", x.load(idx), Red("max"))), Red("sum"))  # noqa: E731
        spec = RowSpec(x.shape, (dim,), phases)
        spec.outputs.append(OutputSpec(None, "row", value, lambda idx: list(idx)))
        return spec
    return rule


def _layer_norm(node: fx.Node, value_of: Callable) -> RowSpec:
    x = _float_input(node, value_of)
    n = len(x.shape)
    k = len(node.args[1])
    w, b = node.args[2], node.args[3]
    eps = float(node.args[4])
    dims = tuple(range(n - k, n))
    r = math.prod(x.shape[d] for d in dims)
    if r == 0:
        raise Decline("empty layer norm")
    wv = value_of(w) if w is not None else None
    bv = value_of(b) if b is not None else None
    mean = _row_mean(r)
    rstd = op("rsqrt", op("add", op("mul", Red("m2"), Const(1.0 / r)), Const(eps)))
    phases = [("sum", "sum", lambda idx: x.load(idx)),
              ("m2", "sum", lambda idx: _sq(op("sub", x.load(idx), mean)))]

    def value(idx):
        y = op("mul", op("sub", x.load(idx), mean), rstd)
        if wv is not None:
            y = op("mul", y, wv.load(list(idx[n - k:])))
        if bv is not None:
            y = op("add", y, bv.load(list(idx[n - k:])))
        return y
    keep = lambda idx: [Ix() if d in dims else idx[d] for d in range(n)]  # noqa: E731
    spec = RowSpec(x.shape, dims, phases)
    spec.outputs += [OutputSpec(0, "row", value, lambda idx: list(idx)),
                     OutputSpec(1, "outer", lambda idx: mean, keep),
                     OutputSpec(2, "outer", lambda idx: rstd, keep)]
    return spec


def _group_norm(node: fx.Node, value_of: Callable) -> RowSpec:
    """native_group_norm(x, w, b, N, C, HxW, group, eps) over the virtual (N, G, C/G, HxW)."""
    x = _float_input(node, value_of)
    w, b = node.args[1], node.args[2]
    N, C, HW, G = (int(a) for a in node.args[3:7])
    eps = float(node.args[7])
    if C % G or N * C * HW == 0:
        raise Decline("group norm shape")
    cg = C // G
    spatial = x.shape[2:]
    sp_st = row_major(spatial)
    wv = value_of(w) if w is not None else None
    bv = value_of(b) if b is not None else None

    def x_index(idx):
        n, g, c, s = idx
        return [n, Ix.of(g) * cg + c] + [Ix.of(s).floordiv(st).mod(m) if m != 1 else Ix() for m, st in zip(spatial, sp_st)]
    r = cg * HW
    mean = _row_mean(r)
    rstd = op("rsqrt", op("add", op("mul", Red("m2"), Const(1.0 / r)), Const(eps)))
    phases = [("sum", "sum", lambda idx: x.load(x_index(idx))),
              ("m2", "sum", lambda idx: _sq(op("sub", x.load(x_index(idx)), mean)))]

    def value(idx):
        ch = [Ix.of(idx[1]) * cg + idx[2]]
        y = op("mul", op("sub", x.load(x_index(idx)), mean), rstd)
        if wv is not None:
            y = op("mul", y, wv.load(ch))
        if bv is not None:
            y = op("add", y, bv.load(ch))
        return y
    spec = RowSpec((N, G, cg, HW), (2, 3), phases)
    spec.outputs += [OutputSpec(0, "row", value, x_index),
                     OutputSpec(1, "outer", lambda idx: mean, lambda idx: [idx[0], idx[1]]),
                     OutputSpec(2, "outer", lambda idx: rstd, lambda idx: [idx[0], idx[1]])]
    return spec


def _batch_stats_norm(node: fx.Node, value_of: Callable) -> RowSpec:
    """_native_batch_norm_legit.no_stats (training=True): statistics per channel over (N, spatial)
    (InstanceNorm lowers to this on a (1, N*C, ...) view)."""
    x = _float_input(node, value_of)
    w, b = node.args[1], node.args[2]
    if not bool(node.args[3]):
        raise Decline("no statistics to normalize with")
    eps = float(node.args[5])
    n = len(x.shape)
    if n < 2:
        raise Decline("batch norm of a vector")
    # virtual space: (C, N, *spatial) with everything but C reduced
    perm = [1, 0] + list(range(2, n))
    shape = tuple(x.shape[p] for p in perm)
    r = math.prod(shape[1:])
    if r == 0:
        raise Decline("empty batch norm")
    wv = value_of(w) if w is not None else None
    bv = value_of(b) if b is not None else None

    def x_index(idx):
        return [idx[1], idx[0]] + list(idx[2:])
    mean = _row_mean(r)
    rstd = op("rsqrt", op("add", op("mul", Red("m2"), Const(1.0 / r)), Const(eps)))
    phases = [("sum", "sum", lambda idx: x.load(x_index(idx))),
              ("m2", "sum", lambda idx: _sq(op("sub", x.load(x_index(idx)), mean)))]

    def value(idx):
        y = op("mul", op("sub", x.load(x_index(idx)), mean), rstd)
        if wv is not None:
            y = op("mul", y, wv.load([idx[0]]))
        if bv is not None:
            y = op("add", y, bv.load([idx[0]]))
        return y
    spec = RowSpec(shape, tuple(range(1, n)), phases)
    spec.outputs += [OutputSpec(0, "row", value, x_index),
                     OutputSpec(1, "outer", lambda idx: mean, lambda idx: [idx[0]]),
                     OutputSpec(2, "outer", lambda idx: rstd, lambda idx: [idx[0]])]
    return spec


def _adaptive_global(node: fx.Node, value_of: Callable) -> RowSpec:
    """_adaptive_avg_pool2d to (1, 1): the mean over the spatial dims, kept as size-1 dims."""
    x = _float_input(node, value_of)
    out = meta(node)
    if tuple(out.shape[-2:]) != (1, 1):
        raise Decline("not a global pool")
    n = len(x.shape)
    dims = (n - 2, n - 1)
    r = x.shape[-1] * x.shape[-2]
    if r == 0:
        raise Decline("empty pool")
    spec = RowSpec(x.shape, dims, [("acc", "sum", lambda idx: x.load(idx))])
    spec.outputs.append(OutputSpec(None, "outer", lambda idx: op("mul", Red("acc"), Const(1.0 / r)),
                                   _keep_or_drop(x.shape, dims, n)))
    return spec


REDUCTIONS: dict = {
    aten.sum.dim_IntList: _simple_reduction("sum"), aten.sum.default: _simple_reduction("sum"),
    aten.mean.dim: _simple_reduction("mean"), aten.mean.default: _simple_reduction("mean"),
    aten.amax.default: _simple_reduction("amax"), aten.amin.default: _simple_reduction("amin"),
    aten.var.correction: _variance, aten.var_mean.correction: _variance, aten.std.correction: _variance,
    aten._softmax.default: _softmax(False), aten._log_softmax.default: _softmax(True),
    aten.native_layer_norm.default: _layer_norm, aten.native_group_norm.default: _group_norm,
    aten._native_batch_norm_legit.no_stats: _batch_stats_norm,
}


def adaptive_is_global(node: fx.Node) -> bool:
    out = meta(node)
    return out is not None and out.dim() >= 2 and tuple(out.shape[-2:]) == (1, 1)


def reduction_rule(node: fx.Node) -> Optional[Callable]:
    """The rule of a reduction node (it returns a ``RowSpec``), or None."""
    if node.op != "call_function":
        return None
    if node.target is aten._adaptive_avg_pool2d.default and adaptive_is_global(node):
        return _adaptive_global
    return REDUCTIONS.get(node.target)

