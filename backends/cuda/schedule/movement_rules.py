"""Lowering rules of views and data movement: index maps, no arithmetic.

``VIEWS`` (view / reshape / permute / transpose / expand / slice / select / squeeze / unsqueeze /
channel shuffle / as_strided of a tensor that fills its storage), the items of ``MULTI_VIEWS``
(split / chunk / unbind: a slice or select of their input), and ``MOVEMENT``: ``cat`` a choice
among its inputs by index range (``stack`` by index), ``constant_pad_nd`` a range test, reflection
and replication padding a choice by range among mirrored / clamped index maps, ``repeat`` a modulo,
and the window ops (max / average pooling) unrolling their window.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.fx as fx

from fxopt.backends.cuda.ir import Const, InRange, Ix, Where, op
from fxopt.backends.cuda.kernels.common import meta
from .values import Decline, Value, broadcast, norm_dim, row_major, static_shape

aten = torch.ops.aten
NEG_INF = float("-inf")


def _reshape(base: Value, shape: tuple) -> Callable:
    """Element ``idx`` of ``base`` reshaped to ``shape`` (logical, row-major order)."""
    if math.prod(shape) != math.prod(base.shape):
        raise Decline("reshape changes the number of elements")
    out_st, in_st = row_major(shape), row_major(base.shape)

    def load(idx):
        flat = Ix()
        for i, n, s in zip(idx, shape, out_st):
            if n != 1:
                flat = flat + Ix.of(i) * s
        return base.load([Ix() if n == 1 else flat.floordiv(s).mod(n) for n, s in zip(base.shape, in_st)])
    return load


def _view_rule(fn: Callable) -> Callable:
    """A rule from fn(node, base Value, out shape) -> load over the view's index."""
    def rule(node: fx.Node, value_of: Callable) -> Value:
        out = meta(node)
        if out is None:
            raise Decline("no metadata")
        base = value_of(node.args[0])
        return Value(static_shape(out), out.dtype, fn(node, base, static_shape(out)))
    return rule


def _permute(node, base, shape):
    dims = [norm_dim(int(d), len(base.shape)) for d in node.args[1]]
    inv = {d: i for i, d in enumerate(dims)}
    return lambda idx: base.load([idx[inv[d]] for d in range(len(base.shape))])


def _transpose(node, base, shape):
    n = len(base.shape)
    if n < 2:
        return base.load
    a, b = (norm_dim(int(d), n) for d in node.args[1:3]) if len(node.args) >= 3 else (0, 1)
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return lambda idx: base.load([idx[perm[d]] for d in range(n)])


def _expand(node, base, shape):
    return broadcast(base, shape)


def _slice(node, base, shape):
    n = len(base.shape)
    dim = norm_dim(int(node.args[1]) if len(node.args) > 1 else 0, n)
    start = node.args[2] if len(node.args) > 2 else 0
    step = int(node.args[4]) if len(node.args) > 4 else 1
    start = 0 if start is None else int(start)
    start = max(0, min(start + base.shape[dim] if start < 0 else start, base.shape[dim]))
    return lambda idx: base.load([Ix.of(idx[d]) * step + start if d == dim else idx[d] for d in range(n)])


def _select(node, base, shape):
    n = len(base.shape)
    dim = norm_dim(int(node.args[1]), n)
    i = int(node.args[2])
    i = i + base.shape[dim] if i < 0 else i
    return lambda idx: base.load(list(idx[:dim]) + [Ix.of(i)] + list(idx[dim:]))


def _same_elements(node, base, shape):
    """unsqueeze / squeeze / view / reshape / flatten: the same elements in row-major order."""
    return _reshape(base, shape)


def _channel_shuffle(node, base, shape):
    g = int(node.args[1])
    c = base.shape[1]
    if c % g:
        raise Decline("channels not divisible by groups")
    cg = c // g
    return lambda idx: base.load([idx[0], idx[1].mod(g) * cg + idx[1].floordiv(g)] + list(idx[2:]))


def _identity(node, base, shape):
    return base.load


def _as_strided(node, base, shape):
    """``as_strided(x, size, stride, offset)`` reads x's storage at ``offset + sum(idx * stride)``.
    Where x fills its storage exactly (offset 0, its elements dense and non-overlapping: any
    memory format), that address is one element of x, found by x's own strides (largest first);
    a restride that only relabels size-1 dims (a pooled value made channels_last) is the common
    case. Declined where x is itself a part of its storage or the view reads outside it."""
    x = meta(node.args[0])
    size, stride = [int(d) for d in node.args[1]], [int(d) for d in node.args[2]]
    offset = int(node.args[3]) if len(node.args) > 3 and node.args[3] is not None else 0
    if x is None or int(x.storage_offset()) != 0:
        raise Decline("as_strided of a tensor that does not start its storage")
    xs = [(int(st), int(n), d) for d, (n, st) in enumerate(zip(x.shape, x.stride())) if int(n) != 1]
    xs.sort(reverse=True)
    acc = 1
    for st, n, _ in reversed(xs):  # dense and non-overlapping: strides are the sizes' running products
        if st != acc:
            raise Decline("as_strided of a tensor that is not dense in its storage")
        acc *= n
    if any(st < 0 for st in stride) or offset < 0:
        raise Decline("negative strides or offset")
    if offset + sum((n - 1) * st for n, st in zip(size, stride) if n > 0) >= max(acc, 1):
        raise Decline("as_strided reads outside its input")

    def load(idx):
        flat = Ix.of(offset) if offset else Ix()
        for i, n, st in zip(idx, size, stride):
            if n != 1 and st:
                flat = flat + Ix.of(i) * st
        where = [Ix()] * len(base.shape)
        for st, n, d in xs:
            where[d] = flat.floordiv(st).mod(n)
        return base.load(where)
    return load


VIEWS: dict = {
    aten.view.default: _view_rule(_same_elements), aten._unsafe_view.default: _view_rule(_same_elements),
    aten.reshape.default: _view_rule(_same_elements), aten.unsqueeze.default: _view_rule(_same_elements),
    aten.squeeze.dim: _view_rule(_same_elements), aten.squeeze.dims: _view_rule(_same_elements),
    aten.squeeze.default: _view_rule(_same_elements), aten.flatten.using_ints: _view_rule(_same_elements),
    aten.permute.default: _view_rule(_permute), aten.transpose.int: _view_rule(_transpose),
    aten.t.default: _view_rule(_transpose), aten.expand.default: _view_rule(_expand),
    aten.slice.Tensor: _view_rule(_slice), aten.select.int: _view_rule(_select),
    aten.alias.default: _view_rule(_identity), aten.detach.default: _view_rule(_identity),
    aten.as_strided.default: _view_rule(_as_strided),
    aten.channel_shuffle.default: _view_rule(_channel_shuffle),
    aten.native_channel_shuffle.default: _view_rule(_channel_shuffle),
}


def split_item(node: fx.Node, value_of: Callable) -> Value:
    """getitem i of split / split_with_sizes / chunk / unbind: a slice (or select) of the input."""
    src, i = node.args
    base = value_of(src.args[0])
    n = len(base.shape)
    out = meta(node)
    shape = static_shape(out)
    if src.target is aten.unbind.int:
        dim = norm_dim(int(src.args[1]) if len(src.args) > 1 else 0, n)
        return Value(shape, out.dtype, lambda idx: base.load(list(idx[:dim]) + [Ix.of(i)] + list(idx[dim:])))
    dim = norm_dim(int(src.args[2]) if len(src.args) > 2 else int(src.kwargs.get("dim", 0)), n)
    sizes = [int(n) for n in _split_sizes(src, base.shape[dim])]
    start = sum(sizes[:i])
    return Value(shape, out.dtype, lambda idx: base.load([idx[d] + start if d == dim else idx[d] for d in range(n)]))


def _split_sizes(src: fx.Node, extent: int) -> list:
    if src.target is aten.split.Tensor:
        size = int(src.args[1])
        return [min(size, extent - s) for s in range(0, extent, size)] or [0]
    return list(src.args[1])


MULTI_VIEWS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)


# ---------------------------------------------------------------------------- data movement
def _cat(node: fx.Node, value_of: Callable) -> Value:
    out = meta(node)
    shape = static_shape(out)
    dim = norm_dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(shape))
    pieces, start = [], 0
    for t in node.args[0]:
        v = value_of(t)
        if len(v.shape) != len(shape):
            if math.prod(v.shape) == 0:
                continue  # legacy empty (0,) inputs are skipped by cat
            raise Decline("cat of different ranks")
        if v.shape[dim]:
            pieces.append((start, v))
        start += v.shape[dim]
    if not pieces:
        raise Decline("empty cat")

    def load(idx):
        s0, v0 = pieces[-1]
        e = v0.load([idx[d] - s0 if d == dim else idx[d] for d in range(len(shape))])
        for s, v in reversed(pieces[:-1]):
            inner = v.load([idx[d] - s if d == dim else idx[d] for d in range(len(shape))])
            e = Where(InRange(Ix.of(idx[dim]), s, s + v.shape[dim]), inner, e)
        return e
    return Value(shape, out.dtype, load)


def _stack(node: fx.Node, value_of: Callable) -> Value:
    """``stack``: a choice among its inputs by the new dimension's index (a concatenation of the inputs
    each unsqueezed there), so its readers read the inputs where they are, in whatever strides."""
    out = meta(node)
    shape = static_shape(out)
    dim = norm_dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(shape))
    pieces = [value_of(t) for t in node.args[0]]
    if not pieces or any(list(v.shape) != list(shape[:dim]) + list(shape[dim + 1:]) for v in pieces):
        raise Decline("stack of inputs of other shapes")

    def load(idx):
        rest = [idx[d] for d in range(len(shape)) if d != dim]
        e = pieces[-1].load(rest)
        for i in range(len(pieces) - 2, -1, -1):
            e = Where(InRange(Ix.of(idx[dim]), i, i + 1), pieces[i].load(rest), e)
        return e
    return Value(shape, out.dtype, load)


def _pad(node: fx.Node, value_of: Callable) -> Value:
    out = meta(node)
    shape = static_shape(out)
    base = value_of(node.args[0])
    pad = [int(p) for p in node.args[1]]
    fill = float(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else 0.0
    lo = [0] * len(shape)
    for k in range(len(pad) // 2):
        lo[len(shape) - 1 - k] = pad[2 * k]

    def load(idx):
        src = [Ix.of(i) - l for i, l in zip(idx, lo)]
        cond = None
        for d, (s, l) in enumerate(zip(src, lo)):
            if l > 0 or shape[d] - l > base.shape[d]:
                t = InRange(s, 0, base.shape[d])
                cond = t if cond is None else op("and", cond, t)
        inner = base.load(src)
        return inner if cond is None else Where(cond, inner, Const(fill))
    return Value(shape, out.dtype, load)


def _edge_pad(kind: str) -> Callable:
    """``reflection_pad{1,2,3}d`` (``kind`` "reflect") and ``replication_pad{1,2,3}d`` ("edge"): per
    padded dimension a choice by index range among three index maps of the input (below the input:
    ``l - i`` mirrored / 0; inside: ``i - l``; above: ``2 (n - 1) + l - i`` / ``n - 1``), so the
    padded value is read where its consumer reads it, with no padded copy."""
    def rule(node: fx.Node, value_of: Callable) -> Value:
        out = meta(node)
        shape = static_shape(out)
        base = value_of(node.args[0])
        pad = [int(p) for p in node.args[1]]
        lo = {len(shape) - 1 - k: pad[2 * k] for k in range(len(pad) // 2)}
        hi = {len(shape) - 1 - k: pad[2 * k + 1] for k in range(len(pad) // 2)}
        for d in lo:
            n = base.shape[d]
            if lo[d] < 0 or hi[d] < 0 or n < 1 or (kind == "reflect" and max(lo[d], hi[d]) >= n):
                raise Decline(f"{kind} padding {lo[d]}, {hi[d]} of a dimension of {n}")
        dims = sorted(lo)

        def load(idx):
            def piece(rest: list, chosen: dict):
                if not rest:
                    return base.load([chosen.get(d, Ix.of(idx[d])) for d in range(len(shape))])
                d, i, n, l = rest[0], Ix.of(idx[rest[0]]), base.shape[rest[0]], lo[rest[0]]
                below, above = (i * -1 + l, i * -1 + (2 * (n - 1) + l)) if kind == "reflect" else (Ix(), Ix.of(n - 1))
                e = piece(rest[1:], {**chosen, d: i - l})
                if hi[d]:
                    e = Where(InRange(i, l + n, shape[d]), piece(rest[1:], {**chosen, d: above}), e)
                if l:
                    e = Where(InRange(i, 0, l), piece(rest[1:], {**chosen, d: below}), e)
                return e
            return piece(dims, {})
        return Value(shape, out.dtype, load)
    return rule


def _repeat(node: fx.Node, value_of: Callable) -> Value:
    out = meta(node)
    shape = static_shape(out)
    base = value_of(node.args[0])
    lead = len(shape) - len(base.shape)
    return Value(shape, out.dtype, lambda idx: base.load([Ix.of(idx[lead + d]).mod(n) if n != 1 else Ix()
                                                          for d, n in enumerate(base.shape)]))


def _pool_window(node, base, k, stride, padding, dilation, shape):
    """(positions of the window of output (oh, ow): [(ih, iw)] for each tap, in-bounds test)."""
    def taps(idx):
        oh, ow = Ix.of(idx[-2]), Ix.of(idx[-1])
        out = []
        for kh in range(k[0]):
            for kw in range(k[1]):
                ih = oh * stride[0] + (kh * dilation[0] - padding[0])
                iw = ow * stride[1] + (kw * dilation[1] - padding[1])
                out.append((ih, iw))
        return out
    return taps


def _pair(v, default=None) -> tuple:
    if v is None or (isinstance(v, (list, tuple)) and len(v) == 0):
        return default
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return (int(v[0]), int(v[-1]))


def _maxpool_values(node: fx.Node, value_of: Callable) -> Value:
    src = node.args[0]
    x = value_of(src.args[0])
    out = meta(node)
    shape = static_shape(out)
    a = list(src.args) + [None] * (6 - len(src.args))
    k = _pair(a[1])
    stride, padding, dilation = _pair(a[2], k), _pair(a[3], (0, 0)), _pair(a[4], (1, 1))
    H, W = x.shape[-2:]
    taps = _pool_window(src, x, k, stride, padding, dilation, shape)

    def load(idx):
        best = None
        for ih, iw in taps(idx):
            v = x.load(list(idx[:-2]) + [ih, iw])
            conds = []
            lo_h, hi_h = ih.bounds()
            lo_w, hi_w = iw.bounds()
            if lo_h < 0 or hi_h >= H:
                conds.append(InRange(ih, 0, H))
            if lo_w < 0 or hi_w >= W:
                conds.append(InRange(iw, 0, W))
            if conds:
                c = conds[0] if len(conds) == 1 else op("and", *conds)
                v = Where(c, v, Const(NEG_INF))
            best = v if best is None else op("fmax_nan", best, v)
        return best
    return Value(shape, out.dtype, load)


def _avgpool(node: fx.Node, value_of: Callable) -> Value:
    x = value_of(node.args[0])
    out = meta(node)
    shape = static_shape(out)
    a = list(node.args) + [None] * (7 - len(node.args))
    k = _pair(a[1])
    stride, padding = _pair(a[2], k), _pair(a[3], (0, 0))
    count_include_pad = True if a[5] is None else bool(a[5])
    divisor = a[6]
    H, W = x.shape[-2:]
    taps = _pool_window(node, x, k, stride, padding, (1, 1), shape)

    def load(idx):
        total, count = None, None
        for ih, iw in taps(idx):
            inside = op("and", InRange(ih, 0, H), InRange(iw, 0, W))
            v = Where(inside, x.load(list(idx[:-2]) + [ih, iw]), Const(0.0))
            total = v if total is None else op("add", total, v)
            if divisor is None:
                cnt_cond = (op("and", InRange(ih, -padding[0], H + padding[0]), InRange(iw, -padding[1], W + padding[1]))
                            if count_include_pad else inside)
                c = Where(cnt_cond, Const(1.0), Const(0.0))
                count = c if count is None else op("add", count, c)
        return op("div", total, Const(float(divisor)) if divisor is not None else count)
    return Value(shape, out.dtype, load)


def _adaptive_avgpool(node: fx.Node, value_of: Callable) -> Value:
    x = value_of(node.args[0])
    out = meta(node)
    shape = static_shape(out)
    H, W = x.shape[-2:]
    OH, OW = shape[-2:]
    if H % OH or W % OW:
        raise Decline("uneven adaptive pooling windows")
    kh, kw = H // OH, W // OW
    if kh * kw > 64:
        raise Decline("large adaptive pooling window (a reduction)")

    def load(idx):
        total = None
        for i in range(kh):
            for j in range(kw):
                v = x.load(list(idx[:-2]) + [Ix.of(idx[-2]) * kh + i, Ix.of(idx[-1]) * kw + j])
                total = v if total is None else op("add", total, v)
        return op("mul", total, Const(1.0 / (kh * kw)))
    return Value(shape, out.dtype, load)


MOVEMENT: dict = {
    aten.cat.default: _cat, aten.stack.default: _stack, aten.constant_pad_nd.default: _pad,
    aten.repeat.default: _repeat, aten.avg_pool2d.default: _avgpool, aten._adaptive_avg_pool2d.default: _adaptive_avgpool,
    **{op: _edge_pad("reflect") for op in (aten.reflection_pad1d.default, aten.reflection_pad2d.default,
                                           aten.reflection_pad3d.default)},
    **{op: _edge_pad("edge") for op in (aten.replication_pad1d.default, aten.replication_pad2d.default,
                                        aten.replication_pad3d.default)},
}
#: rules the executor applies in inference graphs only (a training graph runs these ops as PyTorch
#: does): ``stack``'s, checked on the GPU in inference; the GPU fuzzer found two training programs
#: with a stack whose gradients were wrong (cause not located: the rule or the backward around it)
INFERENCE_ONLY = frozenset({aten.stack.default})
#: (multi-output target, item) -> rule taking the getitem node
MOVEMENT_ITEMS: dict = {
    (aten.max_pool2d_with_indices.default, 0): _maxpool_values,
}

