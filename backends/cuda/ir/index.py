"""Index expressions of the loop-level IR: loop variables (``Var``) and affine sums (``Ix``) of
them and of floor-divisions / moduli of such sums by constants, simplified where the bounds of the
terms allow; ``strided`` / ``unravel`` build the index of a dense tensor from its strides."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence


def hash_once(cls):
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


@hash_once
@dataclass(frozen=True)
class Var:
    """A loop variable ranging over [0, size)."""
    name: str
    size: int

    def bounds(self) -> tuple[int, int]:
        return 0, max(self.size - 1, 0)


@hash_once
@dataclass(frozen=True)
class FloorDiv:
    arg: "Ix"
    div: int

    def bounds(self) -> tuple[int, int]:
        lo, hi = self.arg.bounds()
        return lo // self.div, hi // self.div


@hash_once
@dataclass(frozen=True)
class Mod:
    arg: "Ix"
    div: int

    def bounds(self) -> tuple[int, int]:
        lo, hi = self.arg.bounds()
        return (lo, hi) if 0 <= lo and hi < self.div else (0, self.div - 1)


Atom = (Var, FloorDiv, Mod)


@hash_once
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
