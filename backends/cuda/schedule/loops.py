"""Loop order and merging of a generated kernel (``arrange``): its loops sorted by the memory order
of what it writes (reductions: of their largest input), adjacent loops that every access walks
contiguously merged into one (a kernel over dense tensors becomes one flat loop), a pointwise loop
nest split at concatenation and padding boundaries first (``split``), and a reduction's thread
mapping chosen ("inner": threads across the reduced index; "outer": threads across rows, when the
rows are what is contiguous, e.g. a spatial mean of a channels_last tensor).
"""
from __future__ import annotations

from typing import Optional

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import Ix, Load, Phase, PointwiseKernel, Store, Var


def _substitute(k, mapping: dict) -> None:
    memo: dict = {}
    if isinstance(k, PointwiseKernel):
        k.stores = [Store(s.buf, s.offset.substitute(mapping), ir.substitute(s.value, mapping, memo)) for s in k.stores]
        return
    k.phases = [Phase(p.name, p.op, ir.substitute(p.value, mapping, memo)) for p in k.phases]
    k.row_stores = [Store(s.buf, s.offset.substitute(mapping), ir.substitute(s.value, mapping, memo)) for s in k.row_stores]
    k.outer_stores = [Store(s.buf, s.offset.substitute(mapping), ir.substitute(s.value, mapping, memo))
                      for s in k.outer_stores]


def _mergeable(a: Var, b: Var, ixs: list) -> bool:
    """Loops a (outer) and b (inner) walk every access as one loop of a.size * b.size."""
    for ix in ixs:
        if a in ix.vars_inside_atoms() or b in ix.vars_inside_atoms():
            return False
        if ix.coef(a) != ix.coef(b) * b.size:
            return False
    return True


def _merge_run(vs: list, k, prefix: str) -> list:
    """Merge adjacent loops of ``vs`` (outermost first) where every access allows it."""
    vs = list(vs)
    i = len(vs) - 1
    while i > 0:
        a, b = vs[i - 1], vs[i]
        if _mergeable(a, b, ir.index_exprs(k)):
            m = Var(f"{prefix}{a.name}_{b.name}", a.size * b.size)
            _substitute(k, {a: Ix(), b: Ix.of(m)})
            vs[i - 1:i + 1] = [m]
        i -= 1
    return vs


def _order(vs: list, ix: Ix) -> list:
    """Loops sorted by the stride ``ix`` gives them, largest first (stable)."""
    return sorted(vs, key=lambda v: -abs(ix.coef(v)))


def _main_load(k) -> Optional[Load]:
    best, size = None, -1
    for p in k.phases:
        for e in ir.walk(p.value):
            if isinstance(e, Load) and k.inputs[e.buf].numel > size:
                best, size = e, k.inputs[e.buf].numel
    return best


def _rename(k, vs_lists: list) -> None:
    """Short loop names (v0, v1, ... / o0, r0 ...) for the generated code."""
    mapping = {}
    for vs, prefix in vs_lists:
        for j, v in enumerate(vs):
            mapping[v] = Var(f"{prefix}{j}", v.size)
    _substitute(k, {a: Ix.of(b) for a, b in mapping.items()})
    return mapping


#: at most this many sub-kernels when a loop nest is split at concatenation / padding boundaries
MAX_PARTS = 64


def _split_points(k: PointwiseKernel) -> dict:
    """Per loop variable, the values where a range test on it (``v + c`` in [lo, hi)) flips."""
    pts: dict = {}
    for e in ir.kernel_exprs(k):
        for node in ir.walk(e):
            if isinstance(node, ir.InRange) and len(node.index.terms) == 1:
                v, coef = node.index.terms[0]
                if isinstance(v, Var) and coef == 1:
                    for b in (node.lo - node.index.const, node.hi - node.index.const):
                        if 0 < b < v.size:
                            pts.setdefault(v, set()).add(b)
    return pts


def split(k: PointwiseKernel) -> list:
    """Sub-kernels of ``k`` over boxes of its loop nest cut at the points where its range tests
    flip, each with the tests decided: a concatenation becomes one plain copy per input, padding
    an unconditional interior and thin borders. [] when nothing is worth splitting."""
    pts = _split_points(k)
    if not pts:
        return []
    chosen, parts = [], 1
    for v in sorted(pts, key=lambda v: len(pts[v])):
        n = len(pts[v]) + 1
        if parts * n <= MAX_PARTS:
            chosen.append(v)
            parts *= n
    if not chosen:
        return []
    segments = []
    for v in chosen:
        edges = [0] + sorted(pts[v]) + [v.size]
        segments.append([(v, a, b) for a, b in zip(edges, edges[1:])])
    out = []
    for box in _product(segments):
        mapping, new_vars = {}, {}
        for v, a, b in box:
            nv = Var(f"{v.name}p{a}", b - a) if b - a > 1 else None
            mapping[v] = (Ix.of(nv) if nv is not None else Ix()) + a
            new_vars[v] = nv
        memo: dict = {}
        stores = [Store(s.buf, s.offset.substitute(mapping), ir.specialize(s.value, mapping, memo)) for s in k.stores]
        vs = [new_vars.get(v, v) for v in k.vars]
        out.append(PointwiseKernel(f"{k.name}_p{len(out)}", [v for v in vs if v is not None], k.inputs, k.outputs,
                                   stores, k.ops))
    return out


def _product(lists: list) -> list:
    out = [[]]
    for options in lists:
        out = [acc + [o] for acc in out for o in options]
    return out


def _arrange_pointwise(k: PointwiseKernel) -> None:
    vs = _order(k.vars, k.stores[0].offset)
    vs = _merge_run(vs, k, "m")
    mapping = _rename(k, [(vs, "x")])
    k.vars = [mapping[v] for v in vs]


def arrange(k) -> None:
    """Order the loops of ``k`` by memory order and merge the contiguous ones (in place); split a
    pointwise loop nest at concatenation / padding boundaries first."""
    if isinstance(k, PointwiseKernel):
        k.parts = split(k)
        for part in k.parts:
            _arrange_pointwise(part)
        if not k.parts:
            _arrange_pointwise(k)
        return
    main = _main_load(k)
    key = main.offset if main is not None else (k.row_stores or k.outer_stores)[0].offset
    outer = _merge_run(_order(k.outer, key), k, "m")
    reduced = _merge_run(_order(k.reduced, key), k, "m")
    mapping = _rename(k, [(outer, "o"), (reduced, "r")])
    k.outer, k.reduced = [mapping[v] for v in outer], [mapping[v] for v in reduced]
    main = _main_load(k)
    if main is not None and k.reduced and main.offset.coef(k.reduced[-1]) == 1:
        k.strategy = "inner"
    elif main is not None and k.outer and main.offset.coef(k.outer[-1]) == 1:
        k.strategy = "outer"
    else:
        k.strategy = "inner"
