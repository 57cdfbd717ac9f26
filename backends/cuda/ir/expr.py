"""Value expressions of the loop-level IR (``Load``, ``Const``, ``Op``, ``Where``, ``InRange``,
``BoolConst``, ``Cast``, ``Red``): immutable and hashable, so equal subtrees are one node, which the
code generator emits once; ``op`` builds a float operation, folding constants."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fxopt.backends.cuda.ir.index import Ix, hash_once


class Expr:
    """Base of the value expression nodes (frozen dataclasses: structural equality and hashing)."""
    kind = "float"  # or "bool"


@hash_once
@dataclass(frozen=True)
class Load(Expr):
    """Element ``offset`` (elements from the tensor's data pointer) of kernel input ``buf``."""
    buf: int
    offset: Ix


@hash_once
@dataclass(frozen=True)
class Const(Expr):
    value: float


@hash_once
@dataclass(frozen=True)
class Op(Expr):
    """A float operation (``UNARY``/``BINARY`` names) or a comparison (``COMPARE``, bool)."""
    op: str
    args: tuple
    params: tuple = ()

    @property
    def kind(self):  # type: ignore[override]
        return "bool" if self.op in COMPARE or self.op in LOGICAL else "float"


@hash_once
@dataclass(frozen=True)
class Where(Expr):
    cond: Expr
    a: Expr
    b: Expr


@hash_once
@dataclass(frozen=True)
class InRange(Expr):
    """``lo <= index < hi`` (bool)."""
    index: Ix
    lo: int
    hi: int
    kind = "bool"


@hash_once
@dataclass(frozen=True)
class BoolConst(Expr):
    value: bool
    kind = "bool"


TRUE, FALSE = BoolConst(True), BoolConst(False)


@hash_once
@dataclass(frozen=True)
class Cast(Expr):
    """Round through ``dtype`` (an explicit conversion in the graph), keep computing in float."""
    arg: Expr
    dtype: torch.dtype


@hash_once
@dataclass(frozen=True)
class Red(Expr):
    """The result of reduction phase ``name`` for the current row (reduction kernels only)."""
    name: str


def _erf(x):
    return torch.erf(x)


#: unary float ops: name -> torch function of a float32 tensor (and its params)
UNARY: dict[str, Callable] = {
    "neg": lambda a: -a, "abs": torch.abs, "relu": torch.relu, "exp": torch.exp, "log": torch.log,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "sigmoid": torch.sigmoid,
    "tanh": torch.tanh, "erf": _erf, "sin": torch.sin, "cos": torch.cos, "floor": torch.floor,
    "ceil": torch.ceil, "round": torch.round,
    "silu": lambda a: a * torch.sigmoid(a),
    "gelu": lambda a: 0.5 * a * (1 + torch.erf(a * 0.7071067811865476)),
    "gelu_tanh": lambda a: 0.5 * a * (1 + torch.tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))),
    "hardswish": lambda a: a * torch.clamp(a + 3, 0, 6) / 6,
    "hardsigmoid": lambda a: torch.clamp(a + 3, 0, 6) / 6,
    "mish": lambda a: a * torch.tanh(torch.nn.functional.softplus(a)),
    "softplus": lambda a: torch.nn.functional.softplus(a),
    "isnan": torch.isnan,
}
#: unary ops with float params: name -> torch function (a, *params)
UNARY_P: dict[str, Callable] = {
    "clamp": lambda a, lo, hi: a.clamp(lo, hi),  # lo/hi may be None
    "leaky_relu": lambda a, slope: torch.where(a > 0, a, a * slope),
    "elu": lambda a, alpha: torch.where(a > 0, a, alpha * torch.expm1(a)),  # (as the source: expm1f)
    "pow": lambda a, e: torch.pow(a, e),
    "softplus_beta": lambda a, beta, threshold: torch.nn.functional.softplus(a, beta, threshold),
}
BINARY: dict[str, Callable] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
    "maximum": torch.maximum, "minimum": torch.minimum, "pow": torch.pow,
    "fmax_nan": torch.maximum,  # max that propagates NaN (pooling)
}
COMPARE: dict[str, Callable] = {
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
}
LOGICAL: dict[str, Callable] = {"and": torch.logical_and, "or": torch.logical_or, "not": torch.logical_not,
                                "isnan": torch.isnan}
REDUCE_OPS = ("sum", "max", "min")


def op(name: str, *args, params: tuple = ()) -> Expr:
    """Build an ``Op``, folding constants."""
    args = tuple(a if isinstance(a, Expr) else Const(float(a)) for a in args)
    if all(isinstance(a, Const) for a in args) and name not in COMPARE and name not in LOGICAL:
        vals = [torch.tensor(a.value, dtype=torch.float32) for a in args]
        return Const(float(apply_op(name, vals, params)))
    return Op(name, args, tuple(params))


def apply_op(name: str, vals: list, params: tuple):
    if name in UNARY and len(vals) == 1 and not params:
        return UNARY[name](vals[0])
    if name in UNARY_P and len(vals) == 1:
        return UNARY_P[name](vals[0], *params)
    if name in BINARY:
        return BINARY[name](vals[0], vals[1])
    if name in COMPARE:
        return COMPARE[name](vals[0], vals[1])
    if name in LOGICAL:
        return LOGICAL[name](*vals)
    raise NotImplementedError(f"unknown op {name!r}")
