"""Building the kernels the scheduler decided on (``fusion.py``): the nodes of one kernel are
lowered through their rules (``lowering.py``) where they are computed inline, and read as kernel
inputs everywhere else; the realized node (or a reduction's outputs) is stored.

``pointwise_kernel``: a ``PointwiseKernel`` over the stored value's shape; ``reduction_kernel``:
a ``ReductionKernel`` from the node's ``RowSpec`` (row outputs stored at every index of the row,
per-row outputs once per row). Outputs must be dense tensors of float32/float16/bfloat16.

Arithmetic is float32, and every float16/bfloat16 value a node defines is rounded to its dtype
where it is computed inline (``rounded``), as eager rounds each op's result: a value and a stored
reduction of it then agree as in eager (``x - x.mean(1)`` over one channel is 0, where the value
unrounded minus its rounded mean was its rounding error, which an InstanceNorm after it scaled
to +-1: GPU fuzz 649729573e).
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from fxopt.backends.cuda import ir
import torch

from fxopt.backends.cuda.ir import (Buffer, Cast, Const, Ix, Load, Op, Phase, PointwiseKernel, ReductionKernel, Store,
                                    Var, Where)
from fxopt.backends.cuda.kernels.common import meta
from .lowering import target_name, value_rule, view_root
from .reduction_rules import reduction_rule
from .values import FLOATS, Decline, Value, static_shape

#: kernel inputs and outputs the generated code can read and write
_MEMORY_DTYPES = FLOATS


class Builder:
    """Lowers the nodes of one kernel: inline values through their rules, everything else as
    kernel inputs. ``classes``: the scheduler's node classes (``.cls``: node -> "fusible",
    "view", "container", ...); ``realized``: the stored nodes; ``own``: the ones this kernel stores."""

    def __init__(self, classes, realized: set, own: set):
        self.c, self.realized, self.own = classes, realized, own
        self.inputs: list = []
        self.buffers: list = []
        self._slot: dict = {}
        self._memo: dict = {}
        self.covered: list = []
        self.failing: Optional[fx.Node] = None  # the node whose rule declined

    def inline(self, n: fx.Node) -> bool:
        c = self.c.cls.get(n)
        if c == "view":
            return self.inline(view_root(n))
        if c in ("fusible", "container"):
            return n not in self.realized or n in self.own
        return False

    def value_of(self, n: fx.Node) -> Value:
        hit = self._memo.get(n)
        if hit is not None:
            return hit
        if not self.inline(n):
            v = self._memo[n] = self.leaf(n)
            return v
        try:
            rule = value_rule(n)
            if rule is None:
                raise Decline(f"no rule for {target_name(n)}")
            v = rule(n, self.value_of)
        except Exception:
            self.failing = self.failing or n
            raise
        self.covered.append(n)
        narrow = v.dtype if v.dtype in _NARROW else None

        def load(idx, inner=v.load, node=n):
            try:
                e = inner(idx)
            except Exception:
                self.failing = self.failing or node  # the innermost node whose rule declined
                raise
            return e if narrow is None else rounded(e, narrow, self.buffers)
        v = self._memo[n] = Value(v.shape, v.dtype, load)
        return v

    def leaf(self, n: fx.Node) -> Value:
        t = meta(n)
        if t is None:
            raise Decline(f"{n.name} has no tensor metadata")
        if t.dtype not in _MEMORY_DTYPES:
            raise Decline(f"input {n.name} is {t.dtype}")
        if t.device.type not in ("cuda", "cpu", "meta"):  # meta: a loaded package's values
            raise Decline(f"input on {t.device}")
        shape, strides = static_shape(t), tuple(int(s) for s in t.stride())
        slot = self._slot.get(n)
        if slot is None:
            slot = self._slot[n] = len(self.inputs)
            self.inputs.append(n)
            self.buffers.append(Buffer(n.name, shape, strides, t.dtype))
        return Value(shape, t.dtype, lambda idx, s=slot: Load(s, ir.strided(idx, shape, strides)))


_NARROW = (torch.float16, torch.bfloat16)
#: ops whose result is one of their arguments (or 0): representable wherever the arguments are
_SELECTING = ("neg", "abs", "relu", "maximum", "minimum", "fmax_nan")


def rounded(e, dtype: torch.dtype, buffers: list):
    """``e`` rounded to ``dtype`` (``Cast``), unless every value it can take is one already: a load
    of a ``dtype`` input, a rounding to ``dtype``, a constant (rounded here), a selection between
    or the sign, magnitude, max or min of such values."""
    if e.kind != "float":
        return e
    if isinstance(e, Const):
        return Const(float(torch.tensor(e.value, dtype=torch.float32).to(dtype).float()))
    return e if _representable(e, dtype, buffers) else Cast(e, dtype)


def _representable(e, dtype: torch.dtype, buffers: list) -> bool:
    if isinstance(e, Cast):
        return e.dtype == dtype
    if isinstance(e, Load):
        return buffers[e.buf].dtype == dtype
    if isinstance(e, Const):
        return float(torch.tensor(e.value, dtype=torch.float32).to(dtype).float()) == e.value
    if isinstance(e, Where):
        return _representable(e.a, dtype, buffers) and _representable(e.b, dtype, buffers)
    if isinstance(e, Op) and e.op in _SELECTING and not e.params:
        return all(_representable(a, dtype, buffers) for a in e.args)
    return False


def _out_buffer(n: fx.Node) -> Buffer:
    t = meta(n)
    if t is None or t.dtype not in _MEMORY_DTYPES:
        raise Decline(f"output {n.name} of dtype {None if t is None else t.dtype}")
    shape = static_shape(t)
    strides = tuple(int(s) for s in t.stride())
    if not _dense(shape, strides):
        raise Decline(f"output {n.name} is not dense")
    return Buffer(n.name, shape, strides, t.dtype)


def _dense(shape, strides) -> bool:
    dims = sorted(((s, n) for n, s in zip(shape, strides) if n != 1), key=lambda t: t[0])
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def _vars(shape: tuple, prefix: str) -> tuple[list, list]:
    """(loop variables for the non-size-1 dims, the logical index with 0 for size-1 dims)."""
    vs, idx = [], []
    for d, n in enumerate(shape):
        if n == 1:
            idx.append(Ix())
        else:
            v = Var(f"{prefix}{d}", int(n))
            vs.append(v)
            idx.append(Ix.of(v))
    return vs, idx


def pointwise_kernel(name: str, n: fx.Node, b: Builder) -> PointwiseKernel:
    out = _out_buffer(n)
    v = b.value_of(n)
    if v.shape != out.shape:
        raise Decline("value shape differs from its metadata")
    vs, idx = _vars(out.shape, "i")
    value = v.load(idx)
    if value.kind != "float":
        raise Decline("a boolean value stored")
    store = Store(0, ir.strided(idx, out.shape, out.strides), value)
    return PointwiseKernel(name, vs, b.buffers, [out], [store])


def reduction_kernel(name: str, n: fx.Node, b: Builder) -> tuple[ReductionKernel, list]:
    spec = reduction_rule(n)(n, b.value_of)
    b.covered.append(n)
    vs, idx = _vars(spec.shape, "i")
    outer = [v for v in vs if int(v.name[1:]) not in spec.reduced]
    reduced = [v for v in vs if int(v.name[1:]) in spec.reduced]
    phases = [Phase(pn, pop, fn(idx)) for pn, pop, fn in spec.phases]
    outs, bufs, row, outer_st = [], [], [], []
    zero = {v: Ix() for v in reduced}
    for o in spec.outputs:
        node = n if o.item is None else next((u for u in n.users if u.args[1] == o.item), None)
        if node is None:
            continue
        buf = _out_buffer(node)
        slot = len(bufs)
        bufs.append(buf)
        outs.append(node)
        oidx = o.index(idx)
        if o.kind == "row":
            row.append(Store(slot, ir.strided(oidx, buf.shape, buf.strides), o.value(idx)))
        else:
            off = ir.strided(oidx, buf.shape, buf.strides).substitute(zero)
            outer_st.append(Store(slot, off, o.value(idx)))
    if not outs:
        raise Decline("no output of the reduction is used")
    for s in outer_st:
        if any(v in ir.all_vars(ix) for ix in _store_ixs(s) for v in reduced):
            raise Decline("a per-row output depends on the reduced index")
    k = ReductionKernel(name, outer, reduced, b.buffers, bufs, phases, row, outer_st)
    return k, outs


def _store_ixs(s: Store) -> list:
    out = [s.offset]
    for e in ir.walk(s.value):
        if isinstance(e, Load):
            out.append(e.offset)
        elif isinstance(e, ir.InRange):
            out.append(e.index)
    return out
