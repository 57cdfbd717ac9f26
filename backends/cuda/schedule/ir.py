"""The loop-level IR the fusion scheduler builds and the code generator reads.

A generated kernel is a loop nest over integer index variables whose body is an expression
tree over loads of its input tensors. Two kernel shapes exist:

- ``PointwiseKernel``: one loop over ``ranges`` (the logical shape of its outputs); every output
  is an expression of the loop variables, stored at the output's own strides. Views (permute,
  slice, expand, reshape...) are index arithmetic inside the loads, concatenation and padding
  are ``Where`` / ``InRange`` selections, never copies of their own.
- ``ReductionKernel``: an outer loop (one "row" per outer index) and an inner reduced loop.
  ``phases`` are reductions over the row (sum / max / min), each able to use the results of the
  phases before it (softmax: max, then the sum of ``exp(x - max)``; LayerNorm: the mean, then
  the sum of squared deviations); ``row_outputs`` are stored at every (outer, reduced) index
  after the last phase (the normalized tensor), ``outer_outputs`` once per row (a mean).

Index expressions (``Ix``) are affine sums ``const + sum(coef * atom)`` whose atoms are loop
variables or floor-divisions / moduli of such sums by constants; ``floordiv``/``mod`` simplify
when the bounds of the terms allow (``(8*i + j) // 8 == i`` for ``0 <= j < 8``), so a chain of
views of a dense tensor usually folds back to plain strides. Every atom's argument is known to
be non-negative, so C's truncating ``/`` and ``%`` equal floor division and modulo.

Value expressions (``Load``, ``Const``, ``Op``, ``Where``, ``InRange``, ``Cast``, ``Red``) are
immutable and hashable: equal subtrees are one node, which the code generator emits once.
All arithmetic is float32 (loads widen, stores round once); ``Cast`` rounds through a dtype
where the graph converts explicitly.

``evaluate`` runs a kernel with torch on any device, index for index as the generated code
does (the same loads at the same offsets): the CPU-testable semantics of every kernel.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch


def _hash_once(cls):
    """A frozen dataclass whose hash is computed once per object: expression trees are dict keys
    at every level (memos of ``substitute``/``simplify``, the emitter's common subexpressions), and
    the generated hash would walk the whole subtree at each lookup."""
    names = tuple(f.name for f in dataclasses.fields(cls))

    def __hash__(self):
        try:
            return self.__dict__["_hash"]
        except KeyError:
            h = hash(tuple(getattr(self, n) for n in names))
            object.__setattr__(self, "_hash", h)
            return h

    def __getstate__(self):  # copies and pickles carry the fields, not this process's caches
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_key")}

    cls.__hash__, cls.__getstate__ = __hash__, __getstate__
    return cls


# ---------------------------------------------------------------------------- index expressions


@_hash_once
@dataclass(frozen=True)
class Var:
    """A loop variable ranging over [0, size)."""
    name: str
    size: int

    def bounds(self) -> tuple[int, int]:
        return 0, max(self.size - 1, 0)


@_hash_once
@dataclass(frozen=True)
class FloorDiv:
    arg: "Ix"
    div: int

    def bounds(self) -> tuple[int, int]:
        lo, hi = self.arg.bounds()
        return lo // self.div, hi // self.div


@_hash_once
@dataclass(frozen=True)
class Mod:
    arg: "Ix"
    div: int

    def bounds(self) -> tuple[int, int]:
        lo, hi = self.arg.bounds()
        return (lo, hi) if 0 <= lo and hi < self.div else (0, self.div - 1)


Atom = (Var, FloorDiv, Mod)


@_hash_once
@dataclass(frozen=True)
class Ix:
    """``const + sum(coef * atom)``; terms sorted, no zero coefficients."""
    terms: tuple = ()
    const: int = 0

    @staticmethod
    def of(x) -> "Ix":
        if isinstance(x, Ix):
            return x
        if isinstance(x, int):
            return Ix((), int(x))
        if isinstance(x, Atom):
            return Ix(((x, 1),), 0)
        raise TypeError(f"not an index expression: {x!r}")

    @staticmethod
    def _make(terms: dict, const: int) -> "Ix":
        items = tuple(sorted(((a, c) for a, c in terms.items() if c), key=lambda t: _atom_key(t[0])))
        return Ix(items, int(const))

    def __add__(self, other) -> "Ix":
        other = Ix.of(other)
        terms = dict(self.terms)
        for a, c in other.terms:
            terms[a] = terms.get(a, 0) + c
        return Ix._make(terms, self.const + other.const)

    __radd__ = __add__

    def __sub__(self, other) -> "Ix":
        return self + Ix.of(other) * -1

    def __mul__(self, k: int) -> "Ix":
        k = int(k)
        return Ix._make({a: c * k for a, c in self.terms}, self.const * k)

    __rmul__ = __mul__

    def bounds(self) -> tuple[int, int]:
        lo = hi = self.const
        for a, c in self.terms:
            alo, ahi = a.bounds()
            lo += min(c * alo, c * ahi)
            hi += max(c * alo, c * ahi)
        return lo, hi

    def _split(self, d: int) -> tuple["Ix", "Ix"]:
        """(Q, R) with self == d * Q + R: Q takes the terms whose coefficient d divides."""
        q, r = {}, {}
        for a, c in self.terms:
            if c % d == 0:
                q[a] = c // d
            else:
                r[a] = c
        return Ix._make(q, self.const // d), Ix._make(r, self.const % d)

    def floordiv(self, d: int) -> "Ix":
        d = int(d)
        if d <= 0:
            raise ValueError("floordiv by a non-positive constant")
        if d == 1:
            return self
        q, r = self._split(d)
        rlo, rhi = r.bounds()
        if 0 <= rlo and rhi < d:
            return q
        lo, hi = self.bounds()
        if lo >= 0 and hi < d:
            return Ix()
        if rlo >= 0:  # (d*Q + R) // d == Q + R // d for R >= 0
            return q + Ix.of(FloorDiv(r, d))
        if lo < 0:
            raise ValueError(f"floordiv of a possibly negative index {self}")
        return Ix.of(FloorDiv(self, d))

    def mod(self, d: int) -> "Ix":
        d = int(d)
        if d <= 0:
            raise ValueError("mod by a non-positive constant")
        if d == 1:
            return Ix()
        _, r = self._split(d)
        rlo, rhi = r.bounds()
        if 0 <= rlo and rhi < d:
            return r
        if rlo >= 0:
            return Ix.of(Mod(r, d))
        lo, hi = self.bounds()
        if lo < 0:
            raise ValueError(f"mod of a possibly negative index {self}")
        return Ix.of(Mod(self, d))

    def coef(self, v: Var) -> int:
        return next((c for a, c in self.terms if a == v), 0)

    def is_const(self) -> bool:
        return not self.terms

    def vars_inside_atoms(self) -> set:
        """Loop variables used inside a floordiv/mod atom (not affinely)."""
        out: set = set()
        for a, _ in self.terms:
            if not isinstance(a, Var):
                out |= all_vars(a.arg)
        return out

    def substitute(self, mapping: dict) -> "Ix":
        """Replace loop variables by index expressions (re-simplifying div/mod atoms)."""
        out = Ix.of(self.const)
        for a, c in self.terms:
            if isinstance(a, Var):
                out = out + Ix.of(mapping.get(a, a)) * c
            elif isinstance(a, FloorDiv):
                out = out + a.arg.substitute(mapping).floordiv(a.div) * c
            else:
                out = out + a.arg.substitute(mapping).mod(a.div) * c
        return out

    def __repr__(self) -> str:
        parts = [f"{c}*{_atom_repr(a)}" if c != 1 else _atom_repr(a) for a, c in self.terms]
        if self.const or not parts:
            parts.append(str(self.const))
        return " + ".join(parts)


def _atom_key(a) -> str:
    """The order of an index expression's terms: the atom's repr, computed once per atom."""
    try:
        return a.__dict__["_key"]
    except KeyError:
        key = repr(a)
        object.__setattr__(a, "_key", key)
        return key


def _atom_repr(a) -> str:
    if isinstance(a, Var):
        return a.name
    return f"({a.arg!r}){'//' if isinstance(a, FloorDiv) else '%'}{a.div}"


def all_vars(ix: Ix) -> set:
    out: set = set()
    for a, _ in ix.terms:
        out |= {a} if isinstance(a, Var) else all_vars(a.arg)
    return out


def strided(index: Sequence, shape: Sequence[int], strides: Sequence[int], offset: int = 0) -> Ix:
    """The element offset of ``index`` (one Ix per dim) in a tensor of this shape and these
    strides; dims of size 1 contribute nothing (any stride is the same memory)."""
    out = Ix.of(int(offset))
    for ix, n, s in zip(index, shape, strides):
        if int(n) != 1 and int(s) != 0:
            out = out + Ix.of(ix) * int(s)
    return out


def unravel(flat: Ix, shape: Sequence[int], strides: Sequence[int]) -> list[Ix]:
    """The logical index of element offset ``flat`` in a dense, non-overlapping tensor of this
    shape and these strides (the inverse of ``strided``)."""
    out = []
    for n, s in zip(shape, strides):
        n, s = int(n), int(s)
        out.append(Ix() if n == 1 else flat.floordiv(s).mod(n))
    return out


# ---------------------------------------------------------------------------- value expressions
class Expr:
    """Base of the value expression nodes (frozen dataclasses: structural equality and hashing)."""
    kind = "float"  # or "bool"


@_hash_once
@dataclass(frozen=True)
class Load(Expr):
    """Element ``offset`` (elements from the tensor's data pointer) of kernel input ``buf``."""
    buf: int
    offset: Ix


@_hash_once
@dataclass(frozen=True)
class Const(Expr):
    value: float


@_hash_once
@dataclass(frozen=True)
class Op(Expr):
    """A float operation (``UNARY``/``BINARY`` names) or a comparison (``COMPARE``, bool)."""
    op: str
    args: tuple
    params: tuple = ()

    @property
    def kind(self):  # type: ignore[override]
        return "bool" if self.op in COMPARE or self.op in LOGICAL else "float"


@_hash_once
@dataclass(frozen=True)
class Where(Expr):
    cond: Expr
    a: Expr
    b: Expr


@_hash_once
@dataclass(frozen=True)
class InRange(Expr):
    """``lo <= index < hi`` (bool)."""
    index: Ix
    lo: int
    hi: int
    kind = "bool"


@_hash_once
@dataclass(frozen=True)
class BoolConst(Expr):
    value: bool
    kind = "bool"


TRUE, FALSE = BoolConst(True), BoolConst(False)


@_hash_once
@dataclass(frozen=True)
class Cast(Expr):
    """Round through ``dtype`` (an explicit conversion in the graph), keep computing in float."""
    arg: Expr
    dtype: torch.dtype


@_hash_once
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
    "elu": lambda a, alpha: torch.where(a > 0, a, alpha * (torch.exp(a) - 1)),
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
        return Const(float(_apply(name, vals, params)))
    return Op(name, args, tuple(params))


def _apply(name: str, vals: list, params: tuple):
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


# ---------------------------------------------------------------------------- kernels
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


def substitute(e: Expr, mapping: dict, memo: Optional[dict] = None) -> Expr:
    """``e`` with loop variables replaced by index expressions (``mapping``: Var -> Ix)."""
    memo = {} if memo is None else memo
    hit = memo.get(e)
    if hit is not None:
        return hit
    if isinstance(e, Load):
        out = Load(e.buf, e.offset.substitute(mapping))
    elif isinstance(e, InRange):
        out = InRange(e.index.substitute(mapping), e.lo, e.hi)
    elif isinstance(e, Op):
        out = Op(e.op, tuple(substitute(a, mapping, memo) for a in e.args), e.params)
    elif isinstance(e, Where):
        out = Where(substitute(e.cond, mapping, memo), substitute(e.a, mapping, memo), substitute(e.b, mapping, memo))
    elif isinstance(e, Cast):
        out = Cast(substitute(e.arg, mapping, memo), e.dtype)
    else:
        out = e
    memo[e] = out
    return out


def simplify(e: Expr, memo: Optional[dict] = None) -> Expr:
    """Decide range tests the loop bounds already answer and drop the branches they exclude (the
    concatenation inputs and padding a split loop nest never reaches)."""
    return _rebuild(e, lambda x: x, {} if memo is None else memo)


def specialize(e: Expr, mapping: dict, memo: Optional[dict] = None) -> Expr:
    """``simplify(substitute(e, mapping))``, without substituting the branches that the decided
    range tests drop (a loop box of a concatenation reads one of its inputs)."""
    def leaf(x):
        if isinstance(x, Load):
            return Load(x.buf, x.offset.substitute(mapping))
        if isinstance(x, InRange):
            return InRange(x.index.substitute(mapping), x.lo, x.hi)
        return x
    return _rebuild(e, leaf, {} if memo is None else memo)


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


# ---------------------------------------------------------------------------- torch semantics
def _eval_ix(ix: Ix, env: dict) -> torch.Tensor:
    out = None
    for a, c in ix.terms:
        if isinstance(a, Var):
            v = env[a]
        elif isinstance(a, FloorDiv):
            v = torch.div(_eval_ix(a.arg, env), a.div, rounding_mode="floor")
        else:
            v = torch.remainder(_eval_ix(a.arg, env), a.div)
        out = v * c if out is None else out + v * c
    const = torch.tensor(ix.const, dtype=torch.int64, device=_device(env))
    return const if out is None else out + ix.const


def _device(env):
    return next(iter(env.values())).device if env else torch.device("cpu")


def _flat(t: torch.Tensor, span: int) -> torch.Tensor:
    """The memory of ``t`` from its data pointer on, as a 1-D view of ``span`` elements."""
    return t.as_strided((max(span, 1),), (1,))


def _eval(e: Expr, env: dict, flats: list, cache: dict, red: dict) -> torch.Tensor:
    hit = cache.get(e)
    if hit is not None:
        return hit
    if isinstance(e, Load):
        flat = flats[e.buf]
        # clamped: a load under a Where branch is read for every index here (the generated code
        # reads it only where the branch is taken), and its value is discarded elsewhere
        off = _eval_ix(e.offset, env).clamp(0, flat.numel() - 1)
        out = flat[off].to(torch.float32)
    elif isinstance(e, Const):
        out = torch.tensor(e.value, dtype=torch.float32, device=_device(env))
    elif isinstance(e, BoolConst):
        out = torch.tensor(e.value, dtype=torch.bool, device=_device(env))
    elif isinstance(e, Op):
        vals = [_eval(a, env, flats, cache, red) for a in e.args]
        out = _apply(e.op, vals, e.params)
        if out.dtype != torch.bool:
            out = out.to(torch.float32)
    elif isinstance(e, Where):
        out = torch.where(_eval(e.cond, env, flats, cache, red), _eval(e.a, env, flats, cache, red),
                          _eval(e.b, env, flats, cache, red))
    elif isinstance(e, InRange):
        ix = _eval_ix(e.index, env)
        out = (ix >= e.lo) & (ix < e.hi)
    elif isinstance(e, Cast):
        out = _eval(e.arg, env, flats, cache, red).to(e.dtype).to(torch.float32)
    elif isinstance(e, Red):
        out = red[e.name]
    else:
        raise TypeError(f"unknown expression {e!r}")
    cache[e] = out
    return out


def _grid(vars_: list, device) -> dict:
    """Every combination of the loop variables, flattened (the first varies slowest)."""
    if not vars_:
        return {}
    axes = [torch.arange(v.size, device=device) for v in vars_]
    mesh = torch.meshgrid(*axes, indexing="ij")
    return {v: m.reshape(-1) for v, m in zip(vars_, mesh)}


def _points(env: dict) -> int:
    return len(next(iter(env.values()))) if env else 1


def _store(t: torch.Tensor, span: int, env: dict, store: Store, value: torch.Tensor) -> None:
    n = _points(env)
    off = _eval_ix(store.offset, env).expand(n)
    _flat(t, span)[off] = (value.expand(n) if value.dim() == 0 else value).to(t.dtype)


def evaluate(k, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> None:
    """Run kernel ``k`` with torch (any device), writing ``outputs`` in place: the reference
    semantics of the generated code (same loads, same offsets, float32 math)."""
    device = inputs[0].device if inputs else outputs[0].device
    flats = [_flat(t, b.span()) for t, b in zip(inputs, k.inputs)]
    if isinstance(k, PointwiseKernel):
        for part in k.parts:
            evaluate(part, inputs, outputs)
        if k.parts or k.numel == 0:
            return
        env = _grid(k.vars, device)
        cache: dict = {}
        for s in k.stores:
            _store(outputs[s.buf], k.outputs[s.buf].span(), env, s, _eval(s.value, env, flats, cache, {}))
        return
    rows, size = k.rows, k.row_size
    if rows == 0:
        return
    env = _grid(list(k.outer) + list(k.reduced), device)
    red: dict = {}
    cache = {}
    for ph in k.phases:
        val = _eval(ph.value, env, flats, cache, red).expand(rows * size).reshape(rows, size)
        r = {"sum": lambda t: t.sum(1), "max": lambda t: t.amax(1), "min": lambda t: t.amin(1)}[ph.op](val)
        red[ph.name] = r.repeat_interleave(size)  # broadcast back over the row
    for s in k.row_stores:
        _store(outputs[s.buf], k.outputs[s.buf].span(), env, s, _eval(s.value, env, flats, cache, red))
    if k.outer_stores:
        oenv = _grid(list(k.outer), device)
        ored = {n: v.reshape(rows, size)[:, 0] for n, v in red.items()}
        ocache: dict = {}
        for s in k.outer_stores:
            _store(outputs[s.buf], k.outputs[s.buf].span(), oenv, s, _eval(s.value, oenv, flats, ocache, ored))

