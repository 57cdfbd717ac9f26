"""ATen ops as loop-level IR: what each node computes at a logical index.

Every op the fusion scheduler can put in a generated kernel has a rule here. A rule turns a
node into a ``Value``: its shape and dtype and a ``load(index)`` giving the expression of the
element at a logical index (one ``Ix`` per dim) in terms of its inputs' ``load``s (Inductor's
inner functions over indices). There are three kinds:

- pointwise (``POINTWISE``): arithmetic, activations, comparisons, ``where``, dtype casts,
  eval BatchNorm; inputs broadcast by index (a size-1 dim reads index 0);
- views and data movement (``VIEWS``, ``MOVEMENT``): view/reshape/permute/transpose/expand/
  slice/select/squeeze/unsqueeze/split/chunk/unbind/channel shuffle/repeat are index maps,
  ``cat`` a choice among its inputs by index range, ``constant_pad_nd`` a range test,
  ``clone`` the identity (the copy happens only where the value is stored);
  window ops (max / average pooling) unroll their window;
- reductions (``REDUCTIONS``): sum / mean / amax / amin / var / var_mean / std, softmax and
  log-softmax, LayerNorm, GroupNorm, batch-statistics BatchNorm (instance norm). A rule
  returns a ``RowSpec``: the (virtual) input index space, which of its dims are reduced, the
  reduction phases, and each output's value and where it is stored.

A rule returns ``None`` (with the node left to PyTorch) for what it does not cover: other
dtypes than float32/float16/bfloat16 in memory, symbolic sizes, rounding modes, indices
that are used. ``Values.value(node)`` asks the scheduler how each input is available: computed
inline (its own rule, recursively) or read from a tensor (a kernel input).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.ops import conv_epilogue_ref

from fxopt.backends.cuda.ir import Cast, Const, Expr, InRange, Ix, Load, Red, Where, op
from fxopt.backends.cuda.kernels.common import meta

aten = torch.ops.aten
prims = torch.ops.prims
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
NEG_INF = float("-inf")


class Decline(Exception):
    """A rule does not cover this node (the message says why)."""


@dataclass
class Value:
    shape: tuple
    dtype: torch.dtype
    load: Callable  # list[Ix] -> Expr


def static_shape(t: torch.Tensor) -> tuple:
    if not all(isinstance(d, int) for d in t.shape) or not all(isinstance(s, int) for s in t.stride()):
        raise Decline("symbolic sizes")
    return tuple(int(d) for d in t.shape)


def broadcast(v: Value, shape: tuple) -> Callable:
    """load of ``v`` at an index of the (larger) broadcast ``shape``."""
    lead = len(shape) - len(v.shape)
    if lead < 0:
        raise Decline("broadcast to fewer dims")

    def load(idx):
        sub = [Ix() if n == 1 else idx[lead + i] for i, n in enumerate(v.shape)]
        return v.load(sub)
    return load


def _norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def _dims(dims, n: int) -> tuple:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(n))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({_norm_dim(int(d), n) for d in dims}))


# ---------------------------------------------------------------------------- the reader of arguments
class Args:
    """Arguments of one node: tensors as Values (through the scheduler), scalars as they are."""

    def __init__(self, node: fx.Node, value_of: Callable, out: Optional[torch.Tensor] = None):
        self.node, self._value_of = node, value_of
        out = meta(node) if out is None else out
        self.shape = static_shape(out) if out is not None else None
        self.dtype = out.dtype if out is not None else None

    def arg(self, i: int, name: str, default=None):
        n = self.node
        if i < len(n.args):
            return n.args[i]
        return n.kwargs.get(name, default)

    def value(self, a) -> Value:
        if isinstance(a, fx.Node):
            return self._value_of(a)
        if isinstance(a, (int, float, bool)):
            return Value((), torch.float32, lambda idx, c=float(a): Const(c))
        raise Decline(f"unsupported argument {type(a).__name__}")

    def bload(self, a) -> Callable:
        """load of tensor/scalar argument ``a`` at an index of this node's output shape."""
        return broadcast(self.value(a), self.shape)


def _pointwise(fn: Callable, item: bool = False) -> Callable:
    """A rule from fn(args, idx) -> Expr over the node's output index (``item``: the node is
    getitem of a multi-output op, whose arguments ``args`` reads)."""
    def rule(node: fx.Node, value_of: Callable) -> Value:
        a = Args(node.args[0], value_of, meta(node)) if item else Args(node, value_of)
        if a.dtype not in FLOATS + (torch.bool,):
            raise Decline(f"dtype {a.dtype}")
        return Value(a.shape, a.dtype, lambda idx: fn(a, idx))
    return rule


def _unary(name: str, params: Callable = lambda a: ()) -> Callable:
    return _pointwise(lambda a, idx: op(name, a.bload(a.arg(0, "self"))(idx), params=tuple(params(a))))


def _binary(name: str, alpha: bool = False, swap: bool = False) -> Callable:
    def fn(a, idx):
        x, y = a.bload(a.arg(0, "self"))(idx), a.bload(a.arg(1, "other"))(idx)
        if alpha:
            al = a.arg(2, "alpha", 1)
            if al != 1:
                y = op("mul", y, Const(float(al)))
        return op(name, y, x) if swap else op(name, x, y)
    return _pointwise(fn)


def _cmp(name: str) -> Callable:
    return _pointwise(lambda a, idx: op(name, a.bload(a.arg(0, "self"))(idx), a.bload(a.arg(1, "other"))(idx)))


def _clamp(a, idx):
    lo, hi = a.arg(1, "min"), a.arg(2, "max")
    x = a.bload(a.arg(0, "self"))(idx)
    if isinstance(lo, fx.Node) or isinstance(hi, fx.Node):
        if lo is not None:
            x = op("maximum", x, a.bload(lo)(idx))
        if hi is not None:
            x = op("minimum", x, a.bload(hi)(idx))
        return x
    return op("clamp", x, params=(None if lo is None else float(lo), None if hi is None else float(hi)))


def _gelu(a, idx):
    approx = a.arg(1, "approximate", "none")
    return op("gelu_tanh" if approx == "tanh" else "gelu", a.bload(a.arg(0, "self"))(idx))


def _cast(a, idx):
    x = a.bload(a.arg(0, "self"))(idx)
    return x if a.dtype == torch.float32 else Cast(x, a.dtype)


def _to_copy(node: fx.Node, value_of: Callable) -> Value:
    src = meta(node.args[0])
    out = meta(node)
    if src is None or out is None or src.device != out.device:
        raise Decline("device copy")
    if out.dtype not in FLOATS or src.dtype not in FLOATS:
        raise Decline(f"conversion {src.dtype} -> {out.dtype}")
    return _pointwise(_cast)(node, value_of)


def _where(a, idx):
    c = a.bload(a.arg(0, "condition"))(idx)
    if c.kind != "bool":
        c = op("ne", c, Const(0.0))
    return Where(c, a.bload(a.arg(1, "self"))(idx), a.bload(a.arg(2, "other"))(idx))


def _bn_eval(a, idx):
    """_native_batch_norm_legit_no_training: (x - mean) * rsqrt(var + eps) * w + b, per channel."""
    x, w, b, mean, var = (a.arg(i, n) for i, n in enumerate(("input", "weight", "bias", "running_mean",
                                                                "running_var")))
    eps = float(a.arg(6, "eps"))
    c = [idx[1]] if len(idx) > 1 else [Ix()]
    y = op("mul", op("sub", a.value(x).load(idx), a.value(mean).load(c)),
           op("rsqrt", op("add", a.value(var).load(c), Const(eps))))
    if w is not None:
        y = op("mul", y, a.value(w).load(c))
    if b is not None:
        y = op("add", y, a.value(b).load(c))
    return y


#: fused_conv's activation names as IR ops: name -> fn(x, params) -> Expr
_ACTIVATION_IR = {
    "none": lambda x, p: x, "relu": lambda x, p: op("relu", x), "silu": lambda x, p: op("silu", x),
    "gelu": lambda x, p: op("gelu", x), "gelu_tanh": lambda x, p: op("gelu_tanh", x),
    "hardswish": lambda x, p: op("hardswish", x), "hardsigmoid": lambda x, p: op("hardsigmoid", x),
    "sigmoid": lambda x, p: op("sigmoid", x), "tanh": lambda x, p: op("tanh", x),
    "hardtanh": lambda x, p: op("clamp", x, params=(float(p[0]), float(p[1]))),
    "leaky_relu": lambda x, p: op("leaky_relu", x, params=(float(p[0]),)),
}


def _conv_epilogue(a, idx):
    """fxopt.ops.conv_epilogue_ref: act(y + bias[c] (+ residual))."""
    y = a.value(a.arg(0, "y")).load(idx)
    bias, res, act, params = a.arg(1, "bias"), a.arg(2, "residual"), a.arg(3, "activation"), a.arg(4, "act_params")
    if bias is not None:
        y = op("add", y, a.value(bias).load([idx[1]] if len(idx) > 1 else [Ix()]))
    if res is not None:
        y = op("add", y, a.bload(res)(idx))
    if act not in _ACTIVATION_IR:
        raise Decline(f"activation {act}")
    return _ACTIVATION_IR[act](y, tuple(params or ()))


def _softplus(a, idx):
    beta, threshold = float(a.arg(1, "beta", 1.0)), float(a.arg(2, "threshold", 20.0))
    x = a.bload(a.arg(0, "self"))(idx)
    return op("softplus_beta", x, params=(beta, threshold))


def _pow_scalar(a, idx):
    e = a.arg(1, "exponent")
    if isinstance(e, fx.Node):
        raise Decline("tensor exponent")
    return op("pow", a.bload(a.arg(0, "self"))(idx), params=(float(e),))


def _div_mode(a, idx):
    if a.arg(2, "rounding_mode") is not None:
        raise Decline("rounding division")
    return op("div", a.bload(a.arg(0, "self"))(idx), a.bload(a.arg(1, "other"))(idx))


def _elu(a, idx):
    alpha, scale, iscale = (float(a.arg(i, n, 1.0)) for i, n in ((1, "alpha"), (2, "scale"), (3, "input_scale")))
    if scale != 1.0 or iscale != 1.0:
        raise Decline("scaled elu")
    return op("elu", a.bload(a.arg(0, "self"))(idx), params=(alpha,))


def _hardtanh(a, idx):
    return op("clamp", a.bload(a.arg(0, "self"))(idx),
              params=(float(a.arg(1, "min_val", -1.0)), float(a.arg(2, "max_val", 1.0))))


def _threshold_backward(a, idx):
    """ReLU's gradient: 0 where the input was <= threshold, else the incoming gradient."""
    x = a.bload(a.arg(1, "self"))(idx)
    dead = op("le", x, Const(float(a.arg(2, "threshold"))))
    return Where(dead, Const(0.0), a.bload(a.arg(0, "grad_output"))(idx))


def _hardtanh_backward(a, idx):
    """hardtanh's (ReLU6's) gradient: 0 where the input was outside (min, max), else the gradient."""
    x = a.bload(a.arg(1, "self"))(idx)
    lo, hi = float(a.arg(2, "min_val")), float(a.arg(3, "max_val"))
    clipped = op("or", op("le", x, Const(lo)), op("ge", x, Const(hi)))
    return Where(clipped, Const(0.0), a.bload(a.arg(0, "grad_output"))(idx))


POINTWISE: dict = {
    aten.threshold_backward.default: _pointwise(_threshold_backward),
    aten.hardtanh_backward.default: _pointwise(_hardtanh_backward),
    aten.add.Tensor: _binary("add", alpha=True), aten.add.Scalar: _binary("add", alpha=True),
    aten.sub.Tensor: _binary("sub", alpha=True), aten.sub.Scalar: _binary("sub", alpha=True),
    aten.rsub.Scalar: _binary("sub", alpha=True, swap=True), aten.rsub.Tensor: _binary("sub", alpha=True, swap=True),
    aten.mul.Tensor: _binary("mul"), aten.mul.Scalar: _binary("mul"),
    aten.div.Tensor: _binary("div"), aten.div.Scalar: _binary("div"), aten.div.Tensor_mode: _pointwise(_div_mode),
    aten.maximum.default: _binary("maximum"), aten.minimum.default: _binary("minimum"),
    aten.pow.Tensor_Tensor: _binary("pow"), aten.pow.Tensor_Scalar: _pointwise(_pow_scalar),
    aten.relu.default: _unary("relu"), aten.sigmoid.default: _unary("sigmoid"), aten.tanh.default: _unary("tanh"),
    aten.silu.default: _unary("silu"), aten.gelu.default: _pointwise(_gelu),
    aten.hardswish.default: _unary("hardswish"), aten.hardsigmoid.default: _unary("hardsigmoid"),
    aten.hardtanh.default: _pointwise(_hardtanh), aten.mish.default: _unary("mish"),
    aten.leaky_relu.default: _unary("leaky_relu", lambda a: (float(a.arg(1, "negative_slope", 0.01)),)),
    aten.elu.default: _pointwise(_elu), aten.softplus.default: _pointwise(_softplus),
    aten.exp.default: _unary("exp"), aten.log.default: _unary("log"), aten.sqrt.default: _unary("sqrt"),
    aten.rsqrt.default: _unary("rsqrt"), aten.reciprocal.default: _unary("reciprocal"),
    aten.neg.default: _unary("neg"), aten.abs.default: _unary("abs"), aten.erf.default: _unary("erf"),
    aten.sin.default: _unary("sin"), aten.cos.default: _unary("cos"),
    aten.clamp.default: _pointwise(_clamp), aten.clamp.Tensor: _pointwise(_clamp),
    aten.clamp_min.default: _pointwise(lambda a, idx: op("clamp", a.bload(a.arg(0, "self"))(idx),
                                                          params=(float(a.arg(1, "min")), None))),
    aten.clamp_max.default: _pointwise(lambda a, idx: op("clamp", a.bload(a.arg(0, "self"))(idx),
                                                          params=(None, float(a.arg(1, "max"))))),
    aten.where.self: _pointwise(_where),
    aten.gt.Tensor: _cmp("gt"), aten.gt.Scalar: _cmp("gt"), aten.lt.Tensor: _cmp("lt"), aten.lt.Scalar: _cmp("lt"),
    aten.ge.Tensor: _cmp("ge"), aten.ge.Scalar: _cmp("ge"), aten.le.Tensor: _cmp("le"), aten.le.Scalar: _cmp("le"),
    aten.eq.Tensor: _cmp("eq"), aten.eq.Scalar: _cmp("eq"), aten.ne.Tensor: _cmp("ne"), aten.ne.Scalar: _cmp("ne"),
    aten._to_copy.default: _to_copy, prims.convert_element_type.default: _to_copy,
    aten.clone.default: _pointwise(lambda a, idx: a.bload(a.arg(0, "self"))(idx)),
}
#: multi-output pointwise ops: (target, output index) -> rule
POINTWISE_ITEMS: dict = {
    (aten._native_batch_norm_legit_no_training.default, 0): _pointwise(_bn_eval, item=True),
}


# ---------------------------------------------------------------------------- views (logical index maps)
def _row_major(shape) -> list:
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= int(n)
    return list(reversed(st))


def _reshape(base: Value, shape: tuple) -> Callable:
    """Element ``idx`` of ``base`` reshaped to ``shape`` (logical, row-major order)."""
    if math.prod(shape) != math.prod(base.shape):
        raise Decline("reshape changes the number of elements")
    out_st, in_st = _row_major(shape), _row_major(base.shape)

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
    dims = [_norm_dim(int(d), len(base.shape)) for d in node.args[1]]
    inv = {d: i for i, d in enumerate(dims)}
    return lambda idx: base.load([idx[inv[d]] for d in range(len(base.shape))])


def _transpose(node, base, shape):
    n = len(base.shape)
    if n < 2:
        return base.load
    a, b = (_norm_dim(int(d), n) for d in node.args[1:3]) if len(node.args) >= 3 else (0, 1)
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return lambda idx: base.load([idx[perm[d]] for d in range(n)])


def _expand(node, base, shape):
    return broadcast(base, shape)


def _slice(node, base, shape):
    n = len(base.shape)
    dim = _norm_dim(int(node.args[1]) if len(node.args) > 1 else 0, n)
    start = node.args[2] if len(node.args) > 2 else 0
    step = int(node.args[4]) if len(node.args) > 4 else 1
    start = 0 if start is None else int(start)
    start = max(0, min(start + base.shape[dim] if start < 0 else start, base.shape[dim]))
    return lambda idx: base.load([Ix.of(idx[d]) * step + start if d == dim else idx[d] for d in range(n)])


def _select(node, base, shape):
    n = len(base.shape)
    dim = _norm_dim(int(node.args[1]), n)
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


VIEWS: dict = {
    aten.view.default: _view_rule(_same_elements), aten._unsafe_view.default: _view_rule(_same_elements),
    aten.reshape.default: _view_rule(_same_elements), aten.unsqueeze.default: _view_rule(_same_elements),
    aten.squeeze.dim: _view_rule(_same_elements), aten.squeeze.dims: _view_rule(_same_elements),
    aten.squeeze.default: _view_rule(_same_elements), aten.flatten.using_ints: _view_rule(_same_elements),
    aten.permute.default: _view_rule(_permute), aten.transpose.int: _view_rule(_transpose),
    aten.t.default: _view_rule(_transpose), aten.expand.default: _view_rule(_expand),
    aten.slice.Tensor: _view_rule(_slice), aten.select.int: _view_rule(_select),
    aten.alias.default: _view_rule(_identity), aten.detach.default: _view_rule(_identity),
    aten.channel_shuffle.default: _view_rule(_channel_shuffle),
    aten.native_channel_shuffle.default: _view_rule(_channel_shuffle),
}


def _split_item(node: fx.Node, value_of: Callable) -> Value:
    """getitem i of split / split_with_sizes / chunk / unbind: a slice (or select) of the input."""
    src, i = node.args
    base = value_of(src.args[0])
    n = len(base.shape)
    out = meta(node)
    shape = static_shape(out)
    if src.target is aten.unbind.int:
        dim = _norm_dim(int(src.args[1]) if len(src.args) > 1 else 0, n)
        return Value(shape, out.dtype, lambda idx: base.load(list(idx[:dim]) + [Ix.of(i)] + list(idx[dim:])))
    dim = _norm_dim(int(src.args[2]) if len(src.args) > 2 else int(src.kwargs.get("dim", 0)), n)
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
    dim = _norm_dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(shape))
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
    aten.cat.default: _cat, aten.constant_pad_nd.default: _pad, aten.repeat.default: _repeat,
    aten.avg_pool2d.default: _avgpool, aten._adaptive_avg_pool2d.default: _adaptive_avgpool,
}
#: (multi-output target, item) -> rule taking the getitem node
MOVEMENT_ITEMS: dict = {
    (aten.max_pool2d_with_indices.default, 0): _maxpool_values,
}


# ---------------------------------------------------------------------------- reductions
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
            dims = _dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), n)
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
    dims = _dims(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim"), n)
    corr = node.kwargs.get("correction", 1)
    corr = 1.0 if corr is None else float(corr)
    keepdim = bool(node.kwargs.get("keepdim", False))
    r = math.prod(x.shape[d] for d in dims)
    if r == 0:
        raise Decline("empty reduction")
    mean = op("mul", Red("sum"), Const(1.0 / r))
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


def _sq(e: Expr) -> Expr:
    return op("mul", e, e)


def _softmax(log: bool):
    def rule(node: fx.Node, value_of: Callable) -> RowSpec:
        x = _float_input(node, value_of)
        out = meta(node)
        if out.dtype not in FLOATS:
            raise Decline("softmax dtype")
        dim = _norm_dim(int(node.args[1]), len(x.shape))
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
    mean = op("mul", Red("sum"), Const(1.0 / r))
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
    sp_st = _row_major(spatial)
    wv = value_of(w) if w is not None else None
    bv = value_of(b) if b is not None else None

    def x_index(idx):
        n, g, c, s = idx
        return [n, Ix.of(g) * cg + c] + [Ix.of(s).floordiv(st).mod(m) if m != 1 else Ix() for m, st in zip(spatial, sp_st)]
    r = cg * HW
    mean = op("mul", Red("sum"), Const(1.0 / r))
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
    mean = op("mul", Red("sum"), Const(1.0 / r))
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
    if node.op != "call_function":
        return None
    if node.target is aten._adaptive_avg_pool2d.default and adaptive_is_global(node):
        return _adaptive_global
    return REDUCTIONS.get(node.target)


def value_rule(node: fx.Node) -> Optional[Callable]:
    """The rule computing ``node`` inline (pointwise, view, data movement), or None."""
    if node.op != "call_function":
        return None
    t = node.target
    if t is conv_epilogue_ref:
        return _pointwise(_conv_epilogue)
    if t is operator.getitem:
        src = node.args[0]
        if not isinstance(src, fx.Node) or src.op != "call_function":
            return None
        if src.target in MULTI_VIEWS:
            return _split_item
        return POINTWISE_ITEMS.get((src.target, node.args[1])) or MOVEMENT_ITEMS.get((src.target, node.args[1]))
    if t is aten._adaptive_avg_pool2d.default and adaptive_is_global(node):
        return None  # a reduction
    return POINTWISE.get(t) or VIEWS.get(t) or MOVEMENT.get(t)


def is_view(node: fx.Node) -> bool:
    """A node whose value aliases its input (torch computes it without a kernel)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        src = node.args[0]
        return isinstance(src, fx.Node) and src.op == "call_function" and src.target in MULTI_VIEWS
    return node.target in VIEWS


def maxpool_indices_unused(node: fx.Node) -> bool:
    return all(u.target is operator.getitem and u.args[1] == 0 for u in node.users)


__all__ = ["Value", "Decline", "RowSpec", "OutputSpec", "value_rule", "reduction_rule", "is_view",
           "meta", "static_shape", "FLOATS", "Load", "maxpool_indices_unused"]
