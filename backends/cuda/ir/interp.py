"""``evaluate`` runs an IR kernel with torch on any device, index for index as the generated code
does (the same loads at the same offsets): the CPU-testable semantics of every kernel. Its math is
float32, as the generated code's; ``compute=torch.float64`` runs the same expressions in float64
(constants and roundings still through float32 and the ``Cast`` dtypes), for comparing with an
emulation of the generated code in float64 (``fxopt.fuzz.simt``)."""
from __future__ import annotations

from typing import Sequence

import torch

from fxopt.backends.cuda.ir.expr import BoolConst, Cast, Const, Expr, InRange, Load, Op, Red, Where, apply_op
from fxopt.backends.cuda.ir.index import FloorDiv, Ix, Var
from fxopt.backends.cuda.ir.kernel import PointwiseKernel, Store


def eval_ix(ix: Ix, env: dict) -> torch.Tensor:
    out = None
    for a, c in ix.terms:
        if isinstance(a, Var):
            v = env[a]
        elif isinstance(a, FloorDiv):
            v = torch.div(eval_ix(a.arg, env), a.div, rounding_mode="floor")
        else:
            v = torch.remainder(eval_ix(a.arg, env), a.div)
        out = v * c if out is None else out + v * c
    const = torch.tensor(ix.const, dtype=torch.int64, device=_device(env))
    return const if out is None else out + ix.const


def _device(env):
    return next(iter(env.values())).device if env else torch.device("cpu")


def _flat(t: torch.Tensor, span: int) -> torch.Tensor:
    """The memory of ``t`` from its data pointer on, as a 1-D view of ``span`` elements."""
    return t.as_strided((max(span, 1),), (1,))


def _eval(e: Expr, env: dict, flats: list, cache: dict, red: dict, ct=torch.float32) -> torch.Tensor:
    hit = cache.get(e)
    if hit is not None:
        return hit
    if isinstance(e, Load):
        flat = flats[e.buf]
        # clamped: a load under a Where branch is read for every index here (the generated code
        # reads it only where the branch is taken), and its value is discarded elsewhere
        off = eval_ix(e.offset, env).clamp(0, flat.numel() - 1)
        out = flat[off].to(ct)
    elif isinstance(e, Const):
        out = torch.tensor(e.value, dtype=torch.float32, device=_device(env)).to(ct)
    elif isinstance(e, BoolConst):
        out = torch.tensor(e.value, dtype=torch.bool, device=_device(env))
    elif isinstance(e, Op):
        vals = [_eval(a, env, flats, cache, red, ct) for a in e.args]
        out = apply_op(e.op, vals, e.params)
        if out.dtype != torch.bool:
            out = out.to(ct)
    elif isinstance(e, Where):
        out = torch.where(_eval(e.cond, env, flats, cache, red, ct), _eval(e.a, env, flats, cache, red, ct),
                          _eval(e.b, env, flats, cache, red, ct))
    elif isinstance(e, InRange):
        ix = eval_ix(e.index, env)
        out = (ix >= e.lo) & (ix < e.hi)
    elif isinstance(e, Cast):
        out = _eval(e.arg, env, flats, cache, red, ct).to(torch.float32).to(e.dtype).to(ct)
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
    off = eval_ix(store.offset, env).expand(n)
    _flat(t, span)[off] = (value.expand(n) if value.dim() == 0 else value).to(t.dtype)


def evaluate(k, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], compute=torch.float32) -> None:
    """Run kernel ``k`` with torch (any device), writing ``outputs`` in place: the reference
    semantics of the generated code (same loads, same offsets, float32 math; ``compute``: see the
    module's docstring)."""
    device = inputs[0].device if inputs else outputs[0].device
    flats = [_flat(t, b.span()) for t, b in zip(inputs, k.inputs)]
    if isinstance(k, PointwiseKernel):
        for part in k.parts:
            evaluate(part, inputs, outputs, compute)
        if k.parts or k.numel == 0:
            return
        env = _grid(k.vars, device)
        cache: dict = {}
        for s in k.stores:
            _store(outputs[s.buf], k.outputs[s.buf].span(), env, s, _eval(s.value, env, flats, cache, {}, compute))
        return
    rows, size = k.rows, k.row_size
    if rows == 0:
        return
    env = _grid(list(k.outer) + list(k.reduced), device)
    red: dict = {}
    cache = {}
    for ph in k.phases:
        val = _eval(ph.value, env, flats, cache, red, compute).expand(rows * size).reshape(rows, size)
        r = {"sum": lambda t: t.sum(1), "max": lambda t: t.amax(1), "min": lambda t: t.amin(1)}[ph.op](val)
        red[ph.name] = r.repeat_interleave(size)  # broadcast back over the row
    for s in k.row_stores:
        _store(outputs[s.buf], k.outputs[s.buf].span(), env, s, _eval(s.value, env, flats, cache, red, compute))
    if k.outer_stores:
        oenv = _grid(list(k.outer), device)
        ored = {n: v.reshape(rows, size)[:, 0] for n, v in red.items()}
        ocache: dict = {}
        for s in k.outer_stores:
            _store(outputs[s.buf], k.outputs[s.buf].span(), oenv, s, _eval(s.value, oenv, flats, ocache, ored, compute))
