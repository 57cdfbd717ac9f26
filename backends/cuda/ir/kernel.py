"""The kernels of the loop-level IR: ``Buffer`` (a kernel argument with its run-time shape,
strides and dtype), ``Store``, ``PointwiseKernel``, ``ReductionKernel`` and its ``Phase``; and the
walks over their expressions (``walk``, ``substitute``, ``simplify``, ``specialize``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from fxopt.backends.cuda.ir.expr import FALSE, TRUE, BoolConst, Cast, Const, Expr, InRange, Load, Op, Where, op
from fxopt.backends.cuda.ir.index import Ix


@dataclass
class Buffer:
    """A kernel argument: a tensor of the graph (``name``) with the shape, strides and dtype it
    has at run time (checked before every launch)."""
    name: str
    shape: tuple
    strides: tuple
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def span(self) -> int:
        """Elements from the first to one past the last addressed element."""
        if self.numel == 0:
            return 0
        return 1 + sum((n - 1) * abs(s) for n, s in zip(self.shape, self.strides))


@dataclass
class Store:
    """Output ``buf`` written at ``offset`` with ``value`` (a float expression)."""
    buf: int
    offset: Ix
    value: Expr


@dataclass
class PointwiseKernel:
    name: str
    vars: list            # loop variables, outermost first (their product: the work items)
    inputs: list          # Buffer
    outputs: list         # Buffer
    stores: list          # Store
    ops: list = field(default_factory=list)  # the ATen ops this kernel covers (report)
    #: the loop nest split where concatenation / padding boundaries fall: sub-kernels over the
    #: same buffers, each with its conditions decided (one launch runs them all); empty: unsplit
    parts: list = field(default_factory=list)

    @property
    def numel(self) -> int:
        return math.prod(v.size for v in self.vars)


@dataclass
class Phase:
    """One reduction over the row: ``op`` (sum/max/min) of ``value`` (may use earlier phases)."""
    name: str
    op: str
    value: Expr


@dataclass
class ReductionKernel:
    name: str
    outer: list           # loop variables of the row index
    reduced: list         # loop variables of the reduced index
    inputs: list
    outputs: list
    phases: list          # Phase
    row_stores: list      # Store over (outer, reduced) after the last phase
    outer_stores: list    # Store over outer only
    ops: list = field(default_factory=list)
    #: "inner": the reduced index runs across threads (rows contiguous in memory);
    #: "outer": each thread owns outer indices and loops over the reduced one (columns contiguous)
    strategy: str = "inner"

    @property
    def rows(self) -> int:
        return math.prod(v.size for v in self.outer)

    @property
    def row_size(self) -> int:
        return math.prod(v.size for v in self.reduced)


Kernel = (PointwiseKernel, ReductionKernel)


def walk(e: Expr, seen: Optional[set] = None):
    """Every node of an expression DAG once, children first."""
    seen = set() if seen is None else seen
    stack = [(e, False)]
    while stack:
        node, done = stack.pop()
        if node in seen:
            continue
        if done:
            seen.add(node)
            yield node
            continue
        stack.append((node, True))
        for ch in children(node):
            if ch not in seen:
                stack.append((ch, False))


def children(e: Expr) -> tuple:
    if isinstance(e, Op):
        return e.args
    if isinstance(e, Where):
        return (e.cond, e.a, e.b)
    if isinstance(e, Cast):
        return (e.arg,)
    return ()


def _map_leaves(e: Expr, leaf, memo: dict) -> Expr:
    """``e`` rebuilt bottom-up, each node ``leaf`` maps (a Load, an InRange) replaced by its result
    (None: kept, its operands rebuilt); shared subexpressions stay shared (``memo``)."""
    hit = memo.get(e)
    if hit is not None:
        return hit
    out = leaf(e)
    if out is None:
        if isinstance(e, Op):
            out = Op(e.op, tuple(_map_leaves(a, leaf, memo) for a in e.args), e.params)
        elif isinstance(e, Where):
            out = Where(_map_leaves(e.cond, leaf, memo), _map_leaves(e.a, leaf, memo), _map_leaves(e.b, leaf, memo))
        elif isinstance(e, Cast):
            out = Cast(_map_leaves(e.arg, leaf, memo), e.dtype)
        else:
            out = e
    memo[e] = out
    return out


def _substituted(x, mapping: dict):
    """A load or range test with its index's loop variables replaced (``mapping``), else None."""
    if isinstance(x, Load):
        return Load(x.buf, x.offset.substitute(mapping))
    if isinstance(x, InRange):
        return InRange(x.index.substitute(mapping), x.lo, x.hi)
    return None


def substitute(e: Expr, mapping: dict, memo: Optional[dict] = None) -> Expr:
    """``e`` with loop variables replaced by index expressions (``mapping``: Var -> Ix)."""
    return _map_leaves(e, lambda x: _substituted(x, mapping), {} if memo is None else memo)


def map_leaves(e: Expr, leaf, memo: Optional[dict] = None) -> Expr:
    """``e`` rebuilt bottom-up with each node ``leaf`` maps replaced by its result (None: kept, its
    operands rebuilt); shared subexpressions stay shared."""
    return _map_leaves(e, leaf, {} if memo is None else memo)


def remap_buffers(e: Expr, mapping: dict, memo: Optional[dict] = None) -> Expr:
    """``e`` with each load's input buffer ``i`` read from buffer ``mapping[i]`` (kernels merged
    into one over the union of their inputs)."""
    def leaf(x):
        return Load(mapping[x.buf], x.offset) if isinstance(x, Load) else None
    return _map_leaves(e, leaf, {} if memo is None else memo)


def simplify(e: Expr, memo: Optional[dict] = None) -> Expr:
    """Decide range tests the loop bounds already answer and drop the branches they exclude (the
    concatenation inputs and padding a split loop nest never reaches)."""
    return _rebuild(e, lambda x: x, {} if memo is None else memo)


def specialize(e: Expr, mapping: dict, memo: Optional[dict] = None) -> Expr:
    """``simplify(substitute(e, mapping))``, without substituting the branches that the decided
    range tests drop (a loop box of a concatenation reads one of its inputs)."""
    return _rebuild(e, lambda x: _substituted(x, mapping) or x, {} if memo is None else memo)


def _rebuild(e: Expr, leaf: Callable, memo: dict) -> Expr:
    """``e`` with ``leaf`` applied to its loads and range tests, simplified bottom-up: a ``Where``
    whose condition is decided keeps (and rebuilds) only the branch taken."""
    hit = memo.get(e)
    if hit is not None:
        return hit
    if isinstance(e, (Load, InRange)):
        out = leaf(e)
        if isinstance(out, InRange):
            lo, hi = out.index.bounds()
            out = TRUE if lo >= out.lo and hi < out.hi else FALSE if hi < out.lo or lo >= out.hi else out
    elif isinstance(e, Where):
        c = _rebuild(e.cond, leaf, memo)
        out = (_rebuild(e.a, leaf, memo) if c is TRUE else _rebuild(e.b, leaf, memo) if c is FALSE
               else Where(c, _rebuild(e.a, leaf, memo), _rebuild(e.b, leaf, memo)))
    elif isinstance(e, Op) and e.op in ("and", "or"):
        args = [_rebuild(a, leaf, memo) for a in e.args]
        absorbing, neutral = (FALSE, TRUE) if e.op == "and" else (TRUE, FALSE)
        if any(a is absorbing for a in args):
            out = absorbing
        else:
            rest = [a for a in args if a is not neutral]
            out = neutral if not rest else rest[0] if len(rest) == 1 else Op(e.op, tuple(rest), e.params)
    elif isinstance(e, Op) and e.op == "not":
        a = _rebuild(e.args[0], leaf, memo)
        out = FALSE if a is TRUE else TRUE if a is FALSE else Op("not", (a,))
    elif isinstance(e, Op):
        args = [_rebuild(a, leaf, memo) for a in e.args]
        args = [Const(1.0 if a.value else 0.0) if isinstance(a, BoolConst) else a for a in args]
        out = op(e.op, *args, params=e.params)
    elif isinstance(e, Cast):
        out = Cast(_rebuild(e.arg, leaf, memo), e.dtype)
    else:
        out = e
    memo[e] = out
    return out


def kernel_exprs(k) -> list:
    if isinstance(k, PointwiseKernel):
        if k.parts:
            return [s.value for p in k.parts for s in p.stores]
        return [s.value for s in k.stores]
    return [p.value for p in k.phases] + [s.value for s in k.row_stores + k.outer_stores]


def index_exprs(k) -> list:
    """Every index expression a kernel evaluates: load and store offsets, range tests."""
    out = []
    for e in kernel_exprs(k):
        for node in walk(e):
            if isinstance(node, Load):
                out.append(node.offset)
            elif isinstance(node, InRange):
                out.append(node.index)
    if isinstance(k, PointwiseKernel):
        stores = [s for p in k.parts for s in p.stores] if k.parts else k.stores
    else:
        stores = k.row_stores + k.outer_stores
    return out + [s.offset for s in stores]
