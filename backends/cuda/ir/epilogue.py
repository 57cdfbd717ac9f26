"""A convolution's (or linear layer's) fused epilogue as an IR expression: ``act(acc + bias[c]
(+ residual))``, the adds in that order, then the activation ops (``epilogue_expr``). The fusion
scheduler builds it over loads (``conv_epilogue_ref`` computed inside a generated kernel); the
template families build it over ``Arg`` leaves (``ACC``, ``BIAS``, ``RES``: values their C code
names) and ``codegen.epilogue`` renders it as statements. ``epilogue_parts`` reads such a chain back
(the inverse of ``epilogue_expr``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .expr import Expr, Op, op
from .index import hash_once


@hash_once
@dataclass(frozen=True)
class Arg(Expr):
    """A float value the code around an epilogue provides by name (a template's accumulator, its
    bias and residual reads); never part of a generated kernel's IR."""
    name: str


ACC, BIAS, RES = Arg("acc"), Arg("bias"), Arg("res")


def _bounds(p: tuple, lo: float, hi: float) -> tuple:
    lo_, hi_ = (tuple(p) + (None, None))[:2]
    return (lo if lo_ is None else float(lo_)), (hi if hi_ is None else float(hi_))


#: the fused activations (fxopt.passes.fuse_conv_epilogue's names, and ``clamp``) as IR:
#: name -> fn(x, params) -> Expr
ACTIVATIONS = {
    "none": lambda x, p: x, "relu": lambda x, p: op("relu", x), "silu": lambda x, p: op("silu", x),
    "gelu": lambda x, p: op("gelu", x), "gelu_tanh": lambda x, p: op("gelu_tanh", x),
    "hardswish": lambda x, p: op("hardswish", x), "hardsigmoid": lambda x, p: op("hardsigmoid", x),
    "sigmoid": lambda x, p: op("sigmoid", x), "tanh": lambda x, p: op("tanh", x),
    "hardtanh": lambda x, p: op("clamp", x, params=_bounds(p, -1.0, 1.0)),
    "leaky_relu": lambda x, p: op("leaky_relu", x, params=(float(p[0]) if p else 0.01,)),
    "clamp": lambda x, p: op("clamp", x, params=tuple(None if v is None else float(v) for v in p)),
}
#: IR op -> fused activation name (``clamp`` with both bounds is hardtanh)
_ACTIVATION_OF = {n: n for n in ACTIVATIONS if n not in ("none", "hardtanh")}


def activation_chain(act) -> list[tuple[str, tuple]]:
    """None | 'none' | 'relu' | ('hardtanh', (0., 6.)) | a list of those -> [(name, params)]."""
    if act is None or act == "none":
        return []
    if isinstance(act, str):
        return [(act, ())]
    if isinstance(act, tuple) and len(act) == 2 and isinstance(act[0], str):
        return [(act[0], tuple(act[1]))]
    return [x for a in act for x in activation_chain(a)]


def epilogue_expr(acc: Expr = ACC, bias: Optional[Expr] = None, residual: Optional[Expr] = None,
                  activation=None, params=()) -> Expr:
    """``act(acc + bias (+ residual))``: ``activation`` is a fused activation name with its
    ``params`` (fused_conv's arguments), or a chain as ``activation_chain`` reads it."""
    y = acc
    if bias is not None:
        y = op("add", y, bias)
    if residual is not None:
        y = op("add", y, residual)
    chain = [(activation, tuple(params or ()))] if isinstance(activation, str) else activation_chain(activation)
    for name, p in chain:
        if name not in ACTIVATIONS:
            raise ValueError(f"unknown epilogue activation {name!r}")
        y = ACTIVATIONS[name](y, tuple(p))
    return y


@dataclass(frozen=True)
class EpilogueParts:
    """What ``epilogue_expr`` was given: its leaves (None where absent) and the activation chain."""
    acc: Expr
    bias: Optional[Expr]
    residual: Optional[Expr]
    activations: tuple  # ((name, params), ...), applied in order


def epilogue_parts(e: Expr, bias: Expr = BIAS, residual: Expr = RES) -> Optional[EpilogueParts]:
    """The parts of an ``epilogue_expr`` chain whose bias and residual leaves are ``bias`` and
    ``residual``, or None where ``e`` is no such chain."""
    acts = []
    while isinstance(e, Op) and len(e.args) == 1 and e.op in _ACTIVATION_OF:
        name = _ACTIVATION_OF[e.op]
        if e.op == "clamp" and None not in e.params and len(e.params) == 2:
            name = "hardtanh"
        acts.append((name, tuple(e.params)))
        e = e.args[0]
    found = {}
    for key, leaf in (("residual", residual), ("bias", bias)):
        if isinstance(e, Op) and e.op == "add" and len(e.args) == 2 and e.args[1] == leaf:
            found[key], e = leaf, e.args[0]
    if isinstance(e, Op) and e.op == "add" and e.args[1] in (bias, residual):
        return None  # the adds in another order
    return EpilogueParts(e, found.get("bias"), found.get("residual"), tuple(reversed(acts)))
