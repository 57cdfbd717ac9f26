"""Expressions of the loop-level IR (``ir/``) as CUDA C statements: the operators'
C spellings, the reductions' initial values and combine steps, index arithmetic, and ``Emitter``,
which writes each unconditional subexpression once as a temporary. Shared by the pointwise and
reduction kernels of ``kernels/pointwise.py`` and ``kernels/reduction.py``."""
from __future__ import annotations

from typing import Optional

import torch

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import (BoolConst, Cast, Const, FloorDiv, InRange, Ix, Load, Op, Red, Var,
                                             Where)

from fxopt.backends.cuda.codegen.c import c_unary, ctype, lit

#: sums, differences and products rounded as written (the ``_rn`` intrinsics are never contracted
#: into a fused multiply-add): a value the kernel recomputes is then the same wherever it is used,
#: as the IR's float32 semantics (``ir.evaluate``) and eager's stored values have it. Contracted,
#: ``x * s - mean(x * s)`` over one value was an unrounded product minus its rounding, 1 ulp,
#: scaled by ``rsqrt(eps)`` to 1.8e-5 where eager gives 0 (GPU fuzz 696d585eed).
_BINARY_C = {"add": "__fadd_rn({a}, {b})", "sub": "__fsub_rn({a}, {b})", "mul": "__fmul_rn({a}, {b})",
             "div": "({a} / {b})",
             "maximum": "fx_max_nan({a}, {b})", "fmax_nan": "fx_max_nan({a}, {b})",
             "minimum": "fx_min_nan({a}, {b})", "pow": "powf({a}, {b})",
             "lt": "({a} < {b})", "le": "({a} <= {b})", "gt": "({a} > {b})", "ge": "({a} >= {b})",
             "eq": "({a} == {b})", "ne": "({a} != {b})", "and": "({a} && {b})", "or": "({a} || {b})"}
_UNARY_C = {"log": "logf({a})", "sqrt": "sqrtf({a})", "rsqrt": "rsqrtf({a})", "reciprocal": "(1.f / {a})",
            "erf": "erff({a})", "sin": "sinf({a})", "cos": "cosf({a})", "floor": "floorf({a})",
            "ceil": "ceilf({a})", "round": "rintf({a})", "not": "(!{a})", "isnan": "({a} != {a})",
            "mish": "({a} * tanhf(log1pf(expf({a}))))", "softplus": "log1pf(expf({a}))"}
HELPERS = """FX_INLINE float fx_max_nan(float a, float b) { return (a > b || a != a) ? a : b; }
FX_INLINE float fx_min_nan(float a, float b) { return (a < b || a != a) ? a : b; }
"""
REDUCE_INIT = {"sum": "0.f", "max": "(-__int_as_float(0x7f800000))", "min": "__int_as_float(0x7f800000)"}
REDUCE_COMBINE = {"sum": "__fadd_rn({a}, {b})", "max": "fx_max_nan({a}, {b})", "min": "fx_min_nan({a}, {b})"}


def _unary(name: str, a: str, params: tuple) -> str:
    if name in _UNARY_C:
        return _UNARY_C[name].format(a=a)
    if name == "pow":
        e = float(params[0])
        if e == 2.0:
            return f"({a} * {a})"
        if e == 1.0:
            return a
        if e == 0.5:
            return f"sqrtf({a})"
        return f"powf({a}, {lit(e)})"
    if name == "elu":
        return f"({a} > 0.f ? {a} : {lit(params[0])} * expm1f({a}))"
    if name == "softplus_beta":
        beta, thr = float(params[0]), float(params[1])
        return f"({a} * {lit(beta)} > {lit(thr)} ? {a} : log1pf(expf({a} * {lit(beta)})) / {lit(beta)})"
    return c_unary(name, a, tuple(params))


def ix_c(ix: Ix) -> str:
    """C expression of an index expression (idx_t arithmetic)."""
    parts = []
    for a, c in ix.terms:
        if isinstance(a, Var):
            s = a.name
        elif isinstance(a, FloorDiv):
            s = f"(({ix_c(a.arg)}) / {a.div})"
        else:
            s = f"(({ix_c(a.arg)}) % {a.div})"
        parts.append(s if c == 1 else f"{s} * {c}")
    if ix.const or not parts:
        parts.append(str(ix.const))
    return "(" + " + ".join(parts) + ")"


class Emitter:
    """Statements computing expressions, each unconditional subtree once (CSE)."""

    def __init__(self, k, indent: str, names: dict, load_alias: Optional[dict] = None):
        self.k, self.indent, self.lines = k, indent, []
        self.names = dict(names)  # expr -> C name (shared values, vector lanes)
        self.alias = load_alias or {}
        self.count = 0

    def _temp(self, code: str, kind: str) -> str:
        name = f"t{self.count}"
        self.count += 1
        ctype_ = "bool" if kind == "bool" else "float"
        self.lines.append(f"{self.indent}const {ctype_} {name} = {code};")
        return name

    def unconditional(self, roots: list) -> set:
        """Nodes evaluated whatever the conditions: reachable without entering a Where branch."""
        out, stack = set(), list(roots)
        while stack:
            e = stack.pop()
            if e in out:
                continue
            out.add(e)
            if isinstance(e, Where):
                stack.append(e.cond)
            else:
                stack.extend(ir.children(e))
        return out

    def emit(self, roots: list) -> list:
        """C names/expressions of ``roots``, their unconditional subtrees as temporaries."""
        hoist = self.unconditional(roots)
        order = []
        seen: set = set()
        for r in roots:
            for e in ir.walk(r, seen):
                order.append(e)
        for e in order:
            if e in hoist and e not in self.names and not isinstance(e, (Const, BoolConst, Red)):
                self.names[e] = self._temp(self.code(e), e.kind)
        return [self.names.get(r) or self.code(r) for r in roots]

    def ref(self, e) -> str:
        return self.names.get(e) or self.code(e)

    def code(self, e) -> str:
        if isinstance(e, Load):
            alias = self.alias.get(e)
            if alias is not None:
                return alias
            return f"fx_to_f32(in{e.buf}[{ix_c(e.offset)}])"
        if isinstance(e, Const):
            return lit(e.value)
        if isinstance(e, BoolConst):
            return "true" if e.value else "false"
        if isinstance(e, Red):
            return f"red_{e.name}"
        if isinstance(e, InRange):
            i = ix_c(e.index)
            return f"({i} >= {e.lo} && {i} < {e.hi})"
        if isinstance(e, Cast):
            a = self.ref(e.arg)
            return a if e.dtype == torch.float32 else f"fx_to_f32(fx_from<{ctype(e.dtype)}>({a}))"
        if isinstance(e, Where):
            return f"({self.ref(e.cond)} ? {self.ref(e.a)} : {self.ref(e.b)})"
        if isinstance(e, Op):
            args = [self.ref(a) for a in e.args]
            if len(args) == 2:
                return _BINARY_C[e.op].format(a=args[0], b=args[1])
            return _unary(e.op, args[0], e.params)
        raise TypeError(f"cannot emit {e!r}")
