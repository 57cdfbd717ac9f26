"""Lowering rules of pointwise ops (``POINTWISE``, ``POINTWISE_ITEMS``): arithmetic, activations,
comparisons, ``where``, dtype casts, eval BatchNorm, a convolution's epilogue
(``conv_epilogue_ref``) and ReLU's / hardtanh's gradients. Inputs broadcast by index (a size-1 dim
reads index 0); ``clone`` is the identity (the copy happens only where the value is stored).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from fxopt.backends.cuda.ir import ACTIVATIONS, Cast, Const, Ix, Where, epilogue_expr, op
from fxopt.backends.cuda.kernels.common import meta
from .values import FLOATS, Args, Decline, Value

aten = torch.ops.aten
prims = torch.ops.prims


def pointwise(fn: Callable, item: bool = False) -> Callable:
    """A rule from fn(args, idx) -> Expr over the node's output index (``item``: the node is
    getitem of a multi-output op, whose arguments ``args`` reads)."""
    def rule(node: fx.Node, value_of: Callable) -> Value:
        a = Args(node.args[0], value_of, meta(node)) if item else Args(node, value_of)
        if a.dtype not in FLOATS + (torch.bool,):
            raise Decline(f"dtype {a.dtype}")
        return Value(a.shape, a.dtype, lambda idx: fn(a, idx))
    return rule


def _unary(name: str, params: Callable = lambda a: ()) -> Callable:
    return pointwise(lambda a, idx: op(name, a.bload(a.arg(0, "self"))(idx), params=tuple(params(a))))


def _binary(name: str, alpha: bool = False, swap: bool = False) -> Callable:
    def fn(a, idx):
        x, y = a.bload(a.arg(0, "self"))(idx), a.bload(a.arg(1, "other"))(idx)
        if alpha:
            al = a.arg(2, "alpha", 1)
            if al != 1:
                y = op("mul", y, Const(float(al)))
        return op(name, y, x) if swap else op(name, x, y)
    return pointwise(fn)


def _cmp(name: str) -> Callable:
    return pointwise(lambda a, idx: op(name, a.bload(a.arg(0, "self"))(idx), a.bload(a.arg(1, "other"))(idx)))


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
    return pointwise(_cast)(node, value_of)


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


def _conv_epilogue(a, idx):
    """fxopt.ops.conv_epilogue_ref: act(y + bias[c] (+ residual)), as ``ir.epilogue_expr`` builds it."""
    bias, res, act, params = a.arg(1, "bias"), a.arg(2, "residual"), a.arg(3, "activation"), a.arg(4, "act_params")
    if act not in ACTIVATIONS:
        raise Decline(f"activation {act}")
    return epilogue_expr(a.value(a.arg(0, "y")).load(idx),
                         None if bias is None else a.value(bias).load([idx[1]] if len(idx) > 1 else [Ix()]),
                         None if res is None else a.bload(res)(idx), act, tuple(params or ()))


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
    aten.threshold_backward.default: pointwise(_threshold_backward),
    aten.hardtanh_backward.default: pointwise(_hardtanh_backward),
    aten.add.Tensor: _binary("add", alpha=True), aten.add.Scalar: _binary("add", alpha=True),
    aten.sub.Tensor: _binary("sub", alpha=True), aten.sub.Scalar: _binary("sub", alpha=True),
    aten.rsub.Scalar: _binary("sub", alpha=True, swap=True), aten.rsub.Tensor: _binary("sub", alpha=True, swap=True),
    aten.mul.Tensor: _binary("mul"), aten.mul.Scalar: _binary("mul"),
    aten.div.Tensor: _binary("div"), aten.div.Scalar: _binary("div"), aten.div.Tensor_mode: pointwise(_div_mode),
    aten.maximum.default: _binary("maximum"), aten.minimum.default: _binary("minimum"),
    aten.pow.Tensor_Tensor: _binary("pow"), aten.pow.Tensor_Scalar: pointwise(_pow_scalar),
    aten.relu.default: _unary("relu"), aten.sigmoid.default: _unary("sigmoid"), aten.tanh.default: _unary("tanh"),
    aten.silu.default: _unary("silu"), aten.gelu.default: pointwise(_gelu),
    aten.hardswish.default: _unary("hardswish"), aten.hardsigmoid.default: _unary("hardsigmoid"),
    aten.hardtanh.default: pointwise(_hardtanh), aten.mish.default: _unary("mish"),
    aten.leaky_relu.default: _unary("leaky_relu", lambda a: (float(a.arg(1, "negative_slope", 0.01)),)),
    aten.elu.default: pointwise(_elu), aten.softplus.default: pointwise(_softplus),
    aten.exp.default: _unary("exp"), aten.log.default: _unary("log"), aten.sqrt.default: _unary("sqrt"),
    aten.rsqrt.default: _unary("rsqrt"), aten.reciprocal.default: _unary("reciprocal"),
    aten.neg.default: _unary("neg"), aten.abs.default: _unary("abs"), aten.erf.default: _unary("erf"),
    aten.sin.default: _unary("sin"), aten.cos.default: _unary("cos"),
    aten.clamp.default: pointwise(_clamp), aten.clamp.Tensor: pointwise(_clamp),
    aten.clamp_min.default: pointwise(lambda a, idx: op("clamp", a.bload(a.arg(0, "self"))(idx),
                                                          params=(float(a.arg(1, "min")), None))),
    aten.clamp_max.default: pointwise(lambda a, idx: op("clamp", a.bload(a.arg(0, "self"))(idx),
                                                          params=(None, float(a.arg(1, "max"))))),
    aten.where.self: pointwise(_where),
    aten.gt.Tensor: _cmp("gt"), aten.gt.Scalar: _cmp("gt"), aten.lt.Tensor: _cmp("lt"), aten.lt.Scalar: _cmp("lt"),
    aten.ge.Tensor: _cmp("ge"), aten.ge.Scalar: _cmp("ge"), aten.le.Tensor: _cmp("le"), aten.le.Scalar: _cmp("le"),
    aten.eq.Tensor: _cmp("eq"), aten.eq.Scalar: _cmp("eq"), aten.ne.Tensor: _cmp("ne"), aten.ne.Scalar: _cmp("ne"),
    aten._to_copy.default: _to_copy, prims.convert_element_type.default: _to_copy,
    aten.clone.default: pointwise(lambda a, idx: a.bload(a.arg(0, "self"))(idx)),
}
#: multi-output pointwise ops: (target, output index) -> rule
POINTWISE_ITEMS: dict = {
    (aten._native_batch_norm_legit_no_training.default, 0): pointwise(_bn_eval, item=True),
}


#: the rule of ``fxopt.ops.conv_epilogue_ref`` (a convolution's epilogue split off by ``rewrite.py``)
CONV_EPILOGUE = pointwise(_conv_epilogue)
