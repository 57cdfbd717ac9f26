"""What the lowering rules share: a node's value at a logical index (``Value``), the reader of a
node's arguments (``Args``), broadcasting, and ``Decline`` (a rule does not cover a node).

A rule turns a node into a ``Value``: its shape and dtype and a ``load(index)`` giving the
expression of the element at a logical index (one ``Ix`` per dim) in terms of its inputs'
``load``s. ``Args.value`` asks the scheduler how each input is available: computed inline (its
own rule, recursively) or read from a tensor (a kernel input).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.ir import Const, Ix
from fxopt.backends.cuda.kernels.common import meta

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


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


def norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def reduced_dims(dims, n: int) -> tuple:
    """The dims a reduction's ``dim`` argument names, sorted (all of them for None or [])."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(n))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({norm_dim(int(d), n) for d in dims}))


def row_major(shape) -> list:
    """The strides of a dense row-major tensor of ``shape``."""
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= int(n)
    return list(reversed(st))


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

