"""CUDA C from the loop-level IR (``schedule/ir.py``): one kernel per scheduled region.

``generate_kernel(k, vec)`` writes the source of a ``PointwiseKernel`` or ``ReductionKernel``:

- sizes, strides and offsets are compile-time constants (a kernel is specialised to its shapes;
  the scheduler only fuses static shapes), indices are ``int`` unless an extent needs 64 bits;
- value expressions are emitted once per distinct subtree (equal subtrees are one IR node),
  except under a ``Where`` branch: a load there may be out of bounds for the rows the condition
  excludes (padding, the other inputs of a concatenation), so a branch is evaluated inline and
  only when taken;
- math is float32: loads widen, stores round once (``fx_from<T>``);
- pointwise kernels: a grid-stride loop over the work items; with ``vec > 1`` each item is ``vec``
  consecutive elements of the innermost loop, and every unconditional access that walks that
  loop with stride 1 (from a ``vec``-aligned start) is one 16-byte (at most) vector load or store;
  the other accesses stay scalar, one per lane. The launcher checks the pointers' alignment;
- reductions, ``inner`` mapping: rows that fit in registers as ``row_reduction.py`` maps them (each
  value loaded once, vector loads and stores); other rows one warp per row (row <= 1024 elements: 8
  rows per block) or one block per row (longer rows), each thread striding over the row, combined by warp shuffles
  (and shared memory across the warps of a block); ``outer`` mapping: a block of 32 consecutive
  rows x ``TR`` threads, each thread striding over the reduced index of its row, combined in
  shared memory. Every thread ends a phase with the row's result (the next phase may use it);
  row outputs are written in a last pass over the row, per-row outputs by one thread.
"""
from __future__ import annotations

import hashlib
import re
from typing import Optional

import torch

from fxopt.backends.cuda.schedule import ir
from fxopt.backends.cuda.schedule.ir import (BoolConst, Cast, Const, FloorDiv, InRange, Ix, Load, Op, PointwiseKernel,
                                             Red, ReductionKernel, Var, Where)

from . import KernelSource, needs_index64
from .row_reduction import generate_row_reduction, row_plan, row_vector_width
from .templates import c_unary, ctype, fast_math_prefix, lit, prelude

_MAX_GRID = 65535
POINTWISE_BLOCK = 256
_BINARY_C = {"add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})", "div": "({a} / {b})",
             "maximum": "fx_max_nan({a}, {b})", "fmax_nan": "fx_max_nan({a}, {b})",
             "minimum": "fx_min_nan({a}, {b})", "pow": "powf({a}, {b})",
             "lt": "({a} < {b})", "le": "({a} <= {b})", "gt": "({a} > {b})", "ge": "({a} >= {b})",
             "eq": "({a} == {b})", "ne": "({a} != {b})", "and": "({a} && {b})", "or": "({a} || {b})"}
_UNARY_C = {"log": "logf({a})", "sqrt": "sqrtf({a})", "rsqrt": "rsqrtf({a})", "reciprocal": "(1.f / {a})",
            "erf": "erff({a})", "sin": "sinf({a})", "cos": "cosf({a})", "floor": "floorf({a})",
            "ceil": "ceilf({a})", "round": "rintf({a})", "not": "(!{a})", "isnan": "({a} != {a})",
            "mish": "({a} * tanhf(log1pf(expf({a}))))", "softplus": "log1pf(expf({a}))"}
_HELPERS = """FX_INLINE float fx_max_nan(float a, float b) { return (a > b || a != a) ? a : b; }
FX_INLINE float fx_min_nan(float a, float b) { return (a < b || a != a) ? a : b; }
"""
_INIT = {"sum": "0.f", "max": "(-__int_as_float(0x7f800000))", "min": "__int_as_float(0x7f800000)"}
_COMBINE = {"sum": "({a} + {b})", "max": "fx_max_nan({a}, {b})", "min": "fx_min_nan({a}, {b})"}


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


class _Emitter:
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


def _decompose(var_list: list, linear: str, indent: str) -> list:
    """Statements setting each loop variable from a linear index (innermost varies fastest)."""
    lines = []
    if not var_list:
        return lines
    lines.append(f"{indent}idx_t rest_ = {linear}; (void)rest_;")
    for j, v in enumerate(reversed(var_list)):
        if j == len(var_list) - 1:
            lines.append(f"{indent}const idx_t {v.name} = rest_;")
        else:
            lines.append(f"{indent}const idx_t {v.name} = rest_ % {v.size}; rest_ /= {v.size};")
    return lines


def _index64(k) -> bool:
    extents = [b.span() for b in k.inputs + k.outputs]
    if isinstance(k, PointwiseKernel):
        extents.append(k.numel)
    else:
        extents.append(k.rows * k.row_size)
    return needs_index64(max(extents + [1]))


def _params(k) -> list:
    ps = [(f"in{i}", f"const {ctype(b.dtype)}*") for i, b in enumerate(k.inputs)]
    ps += [(f"out{j}", f"{ctype(b.dtype)}*") for j, b in enumerate(k.outputs)]
    return ps


def _fast_math_prefix(k, fast_math: bool) -> str:
    return fast_math_prefix(fast_math, [b.dtype for b in k.outputs],
                            (n.op for e in ir.kernel_exprs(k) for n in ir.walk(e) if isinstance(n, Op)))


def _header(k, name: str, block: int, ps: list, index64: bool, prefix: str = "") -> list:
    dtypes = {b.dtype for b in k.inputs + k.outputs} | {torch.float32}
    for e in ir.kernel_exprs(k):
        for node in ir.walk(e):
            if isinstance(node, Cast):
                dtypes.add(node.dtype)
    ops = ", ".join(k.ops) if k.ops else "-"
    return [prefix + prelude(dtypes) + _HELPERS,
            f"// generated by fxopt from: {ops}",
            f'extern "C" __global__ void __launch_bounds__({block})',
            f"{name}({', '.join(f'{t} __restrict__ {n}' for n, t in ps)}) {{",
            "  fx_pdl_begin();  // before any memory access: see prelude.cuh",
            f"  typedef {'long long' if index64 else 'int'} idx_t;"]


def _uname(k, variant: str) -> str:
    """Named by what the kernel computes (its main op and a digest of its buffers, loops and
    expressions), not by the graph node: identical regions share one kernel (one compilation)."""
    bufs = [(b.shape, b.strides, b.dtype) for b in k.inputs + k.outputs]
    digest = hashlib.sha1(repr((bufs, ir.kernel_exprs(k), _loops(k), _stores(k), variant)).encode()).hexdigest()
    label = re.sub(r"_\d+$", "", k.name.split("_", 2)[-1]).strip("_") or "kernel"
    kind = "pw" if isinstance(k, PointwiseKernel) else "red"
    return f"fx_{kind}_{label[:24]}_{variant}_{digest[:12]}"


def _stores(k) -> tuple:
    if isinstance(k, PointwiseKernel):
        stores = [s for p in k.parts for s in p.stores] if k.parts else k.stores
    else:
        stores = k.row_stores + k.outer_stores
    return tuple((s.buf, s.offset) for s in stores)


def _loops(k) -> tuple:
    if isinstance(k, PointwiseKernel):
        return tuple(tuple(p.vars) for p in k.parts) if k.parts else tuple(k.vars)
    return (tuple(k.outer), tuple(k.reduced), k.strategy)


# ---------------------------------------------------------------------------- pointwise
def _vector_plan(k: PointwiseKernel, vec: int):
    """(vector loads, vector stores) for width ``vec`` on the innermost loop, or None."""
    if vec == 1 or not k.vars or k.vars[-1].size % vec:
        return None
    inner = k.vars[-1]

    def ok(ix: Ix, itemsize: int) -> bool:
        if ix.coef(inner) != 1 or inner in ix.vars_inside_atoms():
            return False
        return all(c % vec == 0 for a, c in ix.terms if a != inner) and ix.const % vec == 0 and vec * itemsize <= 32
    em = _Emitter(k, "", {})
    hoist = em.unconditional([s.value for s in k.stores])
    loads = sorted({e for e in hoist if isinstance(e, Load) and ok(e.offset, k.inputs[e.buf].dtype.itemsize)},
                   key=repr)
    stores = [j for j, s in enumerate(k.stores) if ok(s.offset, k.outputs[s.buf].dtype.itemsize)]
    if not loads and not stores:
        return None
    return loads, stores


def _pointwise_loop(k: PointwiseKernel, vec: int, block: int, ind: str) -> tuple:
    """(lines, aligned accesses, work items) of the grid-stride loop of one (sub-)kernel."""
    plan = _vector_plan(k, vec)
    vec = vec if plan is not None else 1
    work = k.numel // vec
    lines = [f"{ind}for (idx_t w_ = (idx_t)blockIdx.x * {block} + threadIdx.x; w_ < {work}; "
             f"w_ += (idx_t)gridDim.x * {block}) {{"]
    ind2 = ind + "  "
    vars_ = list(k.vars)
    aligned = []
    if vec == 1:
        lines += _decompose(vars_, "w_", ind2)
        em = _Emitter(k, ind2, {})
        vals = em.emit([s.value for s in k.stores])
        lines += em.lines
        for s, v in zip(k.stores, vals):
            lines.append(f"{ind2}out{s.buf}[{ix_c(s.offset)}] = fx_from<{ctype(k.outputs[s.buf].dtype)}>({v});")
    else:
        loads, vstores = plan
        inner = vars_[-1]
        chunk = Var(inner.name, inner.size // vec)
        lines += _decompose(vars_[:-1] + [chunk], "w_", ind2)
        first = Var(f"{inner.name}_v", inner.size)  # the first element of this item's vector
        lines.append(f"{ind2}const idx_t {first.name} = {inner.name} * {vec};")
        base = {inner: Ix.of(first)}
        alias = {}
        for j, ld in enumerate(loads):
            t = ctype(k.inputs[ld.buf].dtype)
            off = ld.offset.substitute(base)
            lines.append(f"{ind2}const fx_vec<{t}, {vec}> vl{j} = "
                         f"*reinterpret_cast<const fx_vec<{t}, {vec}>*>(in{ld.buf} + {ix_c(off)});")
            for lane in range(vec):
                alias[Load(ld.buf, off + lane)] = f"fx_to_f32(vl{j}.v[{lane}])"
            aligned.append(("in", ld.buf, min(16, vec * k.inputs[ld.buf].dtype.itemsize)))
        em = _Emitter(k, ind2, {}, alias)
        lane_vals = []
        for lane in range(vec):
            sub = {inner: Ix.of(first) + lane}
            stores = [ir.Store(s.buf, s.offset.substitute(sub), ir.substitute(s.value, sub)) for s in k.stores]
            lane_vals.append((stores, em.emit([s.value for s in stores])))
        lines += em.lines
        for j, s in enumerate(k.stores):
            t = ctype(k.outputs[s.buf].dtype)
            if j in vstores:
                off = lane_vals[0][0][j].offset
                lines.append(f"{ind2}{{ fx_vec<{t}, {vec}> vs_;")
                for lane in range(vec):
                    lines.append(f"{ind2}  vs_.v[{lane}] = fx_from<{t}>({lane_vals[lane][1][j]});")
                lines.append(f"{ind2}  *reinterpret_cast<fx_vec<{t}, {vec}>*>(out{s.buf} + {ix_c(off)}) = vs_; }}")
                aligned.append(("out", s.buf, min(16, vec * k.outputs[s.buf].dtype.itemsize)))
            else:
                for lane in range(vec):
                    st, vals = lane_vals[lane]
                    lines.append(f"{ind2}out{s.buf}[{ix_c(st[j].offset)}] = fx_from<{t}>({vals[j]});")
    lines.append(f"{ind}}}")
    return lines, aligned, work


def generate_pointwise_kernel(k: PointwiseKernel, vec: int = 1, block: int = POINTWISE_BLOCK,
                              fast_math: bool = False) -> KernelSource:
    """``vec``: the widest vector any loop may use (each (sub-)kernel uses the widest its own
    accesses allow, up to this). ``fast_math``: option fast_math (``templates.fast_math_prefix``)."""
    index64 = _index64(k)
    prefix = _fast_math_prefix(k, fast_math)
    name = _uname(k, f"v{vec}" + "f" * bool(prefix))
    ps = _params(k)
    lines = _header(k, name, block, ps, index64, prefix)
    aligned, works = [], []
    if k.parts:
        lines.append("  switch (blockIdx.y) {")
        for i, part in enumerate(k.parts):
            body, al, work = _pointwise_loop(part, min(vec, vector_width(part)) if vec > 1 else 1, block, "    ")
            lines += [f"  case {i}: {{"] + body + ["    break;", "  }"]
            aligned += al
            works.append(work)
        lines.append("  }")
    else:
        body, aligned, work = _pointwise_loop(k, vec, block, "  ")
        lines += body
        works.append(work)
    lines.append("}")
    grid = max(1, min(-(-max(works) // block), _MAX_GRID))
    meta = {"kernel": k, "vec": vec, "aligned": sorted(set(aligned)), "grid": (grid, max(1, len(k.parts)), 1),
            "work": sum(works), "fast_math": bool(prefix)}
    return KernelSource(name, "\n".join(lines) + "\n", tuple(ps), "fused_pointwise", meta, (block, 1, 1), index64)


# ---------------------------------------------------------------------------- reductions
def _reduction_geometry(k: ReductionKernel) -> dict:
    R, rows = k.row_size, k.rows
    if k.strategy == "outer":
        tiles = -(-rows // 32)
        tr = 32 if tiles < 264 and R >= 256 else 8
        tr = min(tr, 1 << max(0, (R - 1).bit_length()))
        tr = max(tr, 1)
        return {"block": 32 * tr, "tr": tr, "grid": max(1, min(tiles, _MAX_GRID))}
    if R <= 1024:
        rows_per_block = 8
        return {"block": 32 * rows_per_block, "row_threads": 32, "rows_per_block": rows_per_block,
                "grid": max(1, min(-(-rows // rows_per_block), _MAX_GRID))}
    block = 512 if R >= 4096 else 256
    return {"block": block, "row_threads": block, "rows_per_block": 1, "grid": max(1, min(rows, _MAX_GRID))}


def generate_reduction_kernel(k: ReductionKernel, fast_math: bool = False, vec: int = 1) -> KernelSource:
    """``fast_math``: option fast_math (``templates.fast_math_prefix``); ``vec``: the row's vector
    width (rows that fit in registers, ``row_reduction.py``; 1: scalar loads)."""
    plan = row_plan(k, vec)
    if plan is not None:
        prefix = _fast_math_prefix(k, fast_math)
        index64 = _index64(k)
        name = _uname(k, f"rows{plan.block}v{plan.vec}" + "f" * bool(prefix))
        ps = _params(k)
        lines, aligned = generate_row_reduction(k, plan, name, _header(k, name, plan.block, ps, index64, prefix))
        grid = max(1, min(-(-k.rows // plan.rpb), _MAX_GRID))
        meta = {"kernel": k, "grid": (grid, 1, 1), "geometry": vars(plan) | {"block": plan.block},
                "aligned": aligned, "vec": plan.vec, "fast_math": bool(prefix)}
        return KernelSource(name, "\n".join(lines) + "\n", tuple(ps), "fused_reduction", meta, (plan.block, 1, 1),
                            index64)
    geo = _reduction_geometry(k)
    block = geo["block"]
    index64 = _index64(k)
    prefix = _fast_math_prefix(k, fast_math)
    name = _uname(k, f"{k.strategy}{block}" + "f" * bool(prefix))
    ps = _params(k)
    lines = _header(k, name, block, ps, index64, prefix)
    rows, outer = k.rows, list(k.outer)
    if k.strategy == "outer":
        tr = geo["tr"]
        lines += [f"  __shared__ float smem_[{tr}][33];",
                  "  const int tx_ = threadIdx.x % 32, ty_ = threadIdx.x / 32;",
                  f"  for (idx_t tile_ = blockIdx.x; tile_ * 32 < {rows}; tile_ += gridDim.x) {{",
                  "    const idx_t row_ = tile_ * 32 + tx_;",
                  f"    const bool valid_ = row_ < {rows};"]
        ind = "    "
        lines += _decompose(outer, "row_", ind)
        for ph in k.phases:
            lines += _accumulate(k, ph, "if (valid_) ", "ty_", tr, ind)
            lines += [f"{ind}smem_[ty_][tx_] = acc_{ph.name};", f"{ind}__syncthreads();",
                      f"{ind}float red_{ph.name} = smem_[0][tx_];",
                      f"{ind}for (int j_ = 1; j_ < {tr}; ++j_) "
                      f"red_{ph.name} = {_COMBINE[ph.op].format(a=f'red_{ph.name}', b='smem_[j_][tx_]')};",
                      f"{ind}__syncthreads();"]
        lines += _row_outputs(k, "if (valid_) ", "ty_", str(tr), ind)
        lines += _outer_outputs(k, "valid_ && ty_ == 0", ind)
        lines += ["  }", "}"]
    else:
        rt, rpb = geo["row_threads"], geo["rows_per_block"]
        if rt > 32:
            lines.append(f"  __shared__ float smem_[{rt // 32}];")
        lines += [f"  const int lane_ = threadIdx.x % {rt};",
                  f"  for (idx_t row_ = (idx_t)blockIdx.x * {rpb} + threadIdx.x / {rt}; row_ < {rows}; "
                  f"row_ += (idx_t)gridDim.x * {rpb}) {{"]
        ind = "    "
        lines += _decompose(outer, "row_", ind)
        for ph in k.phases:
            lines += _accumulate(k, ph, "", "lane_", rt, ind)
            comb = _COMBINE[ph.op].format(a=f"acc_{ph.name}", b=f"__shfl_xor_sync(0xffffffffu, acc_{ph.name}, o_)")
            lines.append(f"{ind}for (int o_ = 16; o_ > 0; o_ >>= 1) acc_{ph.name} = {comb};")
            if rt > 32:
                nw = rt // 32
                lines += [f"{ind}if (lane_ % 32 == 0) smem_[lane_ / 32] = acc_{ph.name};", f"{ind}__syncthreads();",
                          f"{ind}acc_{ph.name} = smem_[0];",
                          f"{ind}for (int j_ = 1; j_ < {nw}; ++j_) "
                          f"acc_{ph.name} = {_COMBINE[ph.op].format(a=f'acc_{ph.name}', b='smem_[j_]')};",
                          f"{ind}__syncthreads();"]
            lines.append(f"{ind}const float red_{ph.name} = acc_{ph.name};")
        lines += _row_outputs(k, "", "lane_", str(rt), ind)
        lines += _outer_outputs(k, "lane_ == 0", ind)
        lines += ["  }", "}"]
    meta = {"kernel": k, "grid": (geo["grid"], 1, 1), "geometry": geo, "fast_math": bool(prefix)}
    return KernelSource(name, "\n".join(lines) + "\n", tuple(ps), "fused_reduction", meta, (block, 1, 1), index64)


def _accumulate(k: ReductionKernel, ph, guard: str, start: str, step: int, ind: str) -> list:
    """This thread's share of reduction phase ``ph``: ``acc_<name>`` over r = start, start + step, ..."""
    lines = [f"{ind}float acc_{ph.name} = {_INIT[ph.op]};",
             f"{ind}{guard}for (idx_t r_ = {start}; r_ < {k.row_size}; r_ += {step}) {{"]
    lines += _decompose(list(k.reduced), "r_", ind + "  ")
    em = _Emitter(k, ind + "  ", {})
    (v,) = em.emit([ph.value])
    lines += em.lines
    lines.append(f"{ind}  acc_{ph.name} = {_COMBINE[ph.op].format(a=f'acc_{ph.name}', b=v)};")
    return lines + [f"{ind}}}"]


def _store_lines(k: ReductionKernel, stores: list, ind: str) -> list:
    """The values of ``stores`` computed and written to their outputs."""
    em = _Emitter(k, ind, {})
    vals = em.emit([s.value for s in stores])
    return em.lines + [f"{ind}out{s.buf}[{ix_c(s.offset)}] = fx_from<{ctype(k.outputs[s.buf].dtype)}>({v});"
                       for s, v in zip(stores, vals)]


def _row_outputs(k: ReductionKernel, guard: str, start: str, step: str, ind: str) -> list:
    if not k.row_stores:
        return []
    lines = [f"{ind}{guard}for (idx_t r_ = {start}; r_ < {k.row_size}; r_ += {step}) {{"]
    lines += _decompose(list(k.reduced), "r_", ind + "  ")
    return lines + _store_lines(k, k.row_stores, ind + "  ") + [f"{ind}}}"]


def _outer_outputs(k: ReductionKernel, cond: str, ind: str) -> list:
    if not k.outer_stores:
        return []
    lines = [f"{ind}if ({cond}) {{"]
    return lines + _store_lines(k, k.outer_stores, ind + "  ") + [f"{ind}}}"]


def generate_kernel(k, vec: int = 1, fast_math: bool = False) -> KernelSource:
    """The source of an IR kernel (``vec``: vector width of the innermost (pointwise) or reduced loop;
    ``fast_math``: option fast_math, see ``templates.fast_math_prefix``)."""
    if isinstance(k, PointwiseKernel):
        return generate_pointwise_kernel(k, vec, fast_math=fast_math)
    if isinstance(k, ReductionKernel):
        return generate_reduction_kernel(k, fast_math, vec)
    raise TypeError(f"not an IR kernel: {type(k).__name__}")


def vector_width(k) -> int:
    """The widest vector (at most 16 bytes per output element group) the kernel's innermost loop
    allows (of a split kernel: the widest any of its parts allows), or 1."""
    if isinstance(k, ReductionKernel):
        return row_vector_width(k)
    if isinstance(k, PointwiseKernel) and k.parts:
        return max(vector_width(p) for p in k.parts)
    if not isinstance(k, PointwiseKernel) or not k.vars:
        return 1
    size = max(b.dtype.itemsize for b in k.outputs)
    for vec in (16 // size, 8, 4, 2):
        if 1 < vec <= 16 // size and k.vars[-1].size % vec == 0 and _vector_plan(k, vec) is not None:
            return vec
    return 1


__all__ = ["generate_kernel", "generate_pointwise_kernel", "generate_reduction_kernel",
           "vector_width", "ix_c"]
