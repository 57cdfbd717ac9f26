"""The reduction family: CUDA C for a ``ReductionKernel`` of the loop-level IR (``ir/``):
``generate_reduction_kernel`` (warp- or block-per-row; column reductions, the ``outer`` strategy, in
``column_reduction.py``) and, below, a row reduction
whose rows fit in registers (the ``inner`` strategy of ``ir/`` for rows of at most ``MAX_ELEMS_PER_THREAD`` x 32 elements).

Why: a normalization (LayerNorm: mean, variance, normalize) reads its row once per phase and
once more for the output. With one warp striding over each row in 2-byte loads, each phase
re-reads the row from cache and a warp has few bytes in flight, so LayerNorm over 96 to 768
channels ran at about half the memory bandwidth. Here each thread loads its share of the row
once, ``vec`` consecutive elements per load (16 bytes at most), keeps the loaded values in
registers for every phase and the row's outputs, and writes ``vec`` elements per store.

The mapping:
- a row is reduced by ``tpr`` threads (a power of two <= 32, so a row never straddles a warp and
  is combined by warp shuffles alone); a block holds ``rpb`` rows, fewer when the grid would
  otherwise not fill the GPU;
- the row's index is split into ``chunks`` of ``vec`` consecutive elements of the innermost
  reduced variable; thread ``lane`` takes chunks ``lane``, ``lane + tpr``, ... (``iters`` of
  them, the loop unrolled here, in Python, so the values stay in named registers);
- a chunk index past the row's end (the last iteration when ``tpr`` does not divide ``chunks``)
  and a row past the last (the last block) are clamped to valid indices, so that every lane of a
  warp runs the same shuffles and every load stays in bounds; what they compute is neither
  combined nor stored.

``row_plan`` decides whether a kernel takes this form (otherwise ``generate_reduction_kernel`` keeps the strided
loops): the inner strategy, a non-empty row of at most 32 values per thread per loaded input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import Ix, Load, ReductionKernel, Var
from fxopt.backends.cuda.codegen.c import ctype
from fxopt.backends.cuda.codegen.emit import REDUCE_COMBINE, REDUCE_INIT, Emitter, ix_c
from fxopt.backends.cuda.codegen.ir_kernel import (MAX_GRID, decompose_index, extent, extent_params,
                                                   kernel_fast_math_prefix, kernel_header, kernel_index64,
                                                   kernel_name, kernel_params, named_source, split_index)
from fxopt.backends.cuda.codegen.source import KernelSource
from fxopt.backends.cuda.kernels.column_reduction import (column_plan, column_vector_width, generate_column_reduction,
                                                          vector_ok)


def _reduction_geometry(k: ReductionKernel) -> dict:
    R, rows = k.row_size, k.rows
    if R <= 1024:
        rows_per_block = 8
        return {"block": 32 * rows_per_block, "row_threads": 32, "rows_per_block": rows_per_block,
                "grid": max(1, min(-(-rows // rows_per_block), MAX_GRID))}
    block = 512 if R >= 4096 else 256
    return {"block": block, "row_threads": block, "rows_per_block": 1, "grid": max(1, min(rows, MAX_GRID))}


def reduction_vector_width(k: ReductionKernel) -> int:
    """The widest vector the kernel's mapping allows: along the row (``inner``) or the columns (``outer``)."""
    return column_vector_width(k) if k.strategy == "outer" else row_vector_width(k)


def generate_reduction_kernel(k: ReductionKernel, fast_math: bool = False, vec: int = 1,
                              work: int = 1) -> KernelSource:
    """``fast_math``: option fast_math (``codegen.c.fast_math_prefix``); ``vec``: the row's vector
    width (rows that fit in registers, ``row_plan`` below; 1: scalar loads); ``work``: a column
    reduction's plan for that much math per element (``column_reduction.column_plan``)."""
    cols = column_plan(k, vec, work) or column_plan(k, 1, work)
    if cols is not None:
        return generate_column_reduction(k, cols, fast_math, work)
    plan = row_plan(k, vec)
    if plan is not None:
        prefix = kernel_fast_math_prefix(k, fast_math)
        index64 = kernel_index64(k)
        name = kernel_name(k, f"rows{plan.block}v{plan.vec}" + "f" * bool(prefix))
        ps = kernel_params(k) + extent_params(1)
        lines, aligned = generate_row_reduction(k, plan, name, kernel_header(k, name, plan.block, ps, index64, prefix))
        grid = max(1, min(-(-k.rows // plan.rpb), MAX_GRID))
        meta = {"kernel": k, "grid": (grid, 1, 1), "geometry": vars(plan) | {"block": plan.block},
                "aligned": aligned, "vec": plan.vec, "extents": [k.rows], "fast_math": bool(prefix)}
        name, source = named_source(name, lines)
        return KernelSource(name, source, tuple(ps), "fused_reduction", meta, (plan.block, 1, 1), index64)
    geo = _reduction_geometry(k)
    block = geo["block"]
    index64 = kernel_index64(k)
    prefix = kernel_fast_math_prefix(k, fast_math)
    name = kernel_name(k, f"{k.strategy}{block}" + "f" * bool(prefix))
    ps = kernel_params(k) + extent_params(1)
    lines = kernel_header(k, name, block, ps, index64, prefix)
    rows, outer = extent(0), list(k.outer)
    rt, rpb = geo["row_threads"], geo["rows_per_block"]
    if rt > 32:
        lines.append(f"  __shared__ float smem_[{rt // 32}];")
    lines += [f"  const int lane_ = threadIdx.x % {rt};",
              f"  for (idx_t row_ = (idx_t)blockIdx.x * {rpb} + threadIdx.x / {rt}; row_ < {rows}; "
              f"row_ += (idx_t)gridDim.x * {rpb}) {{"]
    ind = "    "
    lines += decompose_index(outer, "row_", ind)
    for ph in k.phases:
        lines += _accumulate(k, ph, "", "lane_", rt, ind)
        comb = REDUCE_COMBINE[ph.op].format(a=f"acc_{ph.name}", b=f"__shfl_xor_sync(0xffffffffu, acc_{ph.name}, o_)")
        lines.append(f"{ind}for (int o_ = 16; o_ > 0; o_ >>= 1) acc_{ph.name} = {comb};")
        if rt > 32:
            nw = rt // 32
            lines += [f"{ind}if (lane_ % 32 == 0) smem_[lane_ / 32] = acc_{ph.name};", f"{ind}__syncthreads();",
                      f"{ind}acc_{ph.name} = smem_[0];",
                      f"{ind}for (int j_ = 1; j_ < {nw}; ++j_) "
                      f"acc_{ph.name} = {REDUCE_COMBINE[ph.op].format(a=f'acc_{ph.name}', b='smem_[j_]')};",
                      f"{ind}__syncthreads();"]
        lines.append(f"{ind}const float red_{ph.name} = acc_{ph.name};")
    lines += _row_outputs(k, "", "lane_", str(rt), ind)
    lines += _outer_outputs(k, "lane_ == 0", ind)
    lines += ["  }", "}"]
    meta = {"kernel": k, "grid": (geo["grid"], 1, 1), "geometry": geo, "extents": [k.rows], "fast_math": bool(prefix)}
    name, source = named_source(name, lines)
    return KernelSource(name, source, tuple(ps), "fused_reduction", meta, (block, 1, 1), index64)


def _accumulate(k: ReductionKernel, ph, guard: str, start: str, step: int, ind: str) -> list:
    """This thread's share of reduction phase ``ph``: ``acc_<name>`` over r = start, start + step, ..."""
    lines = [f"{ind}float acc_{ph.name} = {REDUCE_INIT[ph.op]};",
             f"{ind}{guard}for (idx_t r_ = {start}; r_ < {k.row_size}; r_ += {step}) {{"]
    lines += decompose_index(list(k.reduced), "r_", ind + "  ")
    em = Emitter(k, ind + "  ", {})
    (v,) = em.emit([ph.value])
    lines += em.lines
    lines.append(f"{ind}  acc_{ph.name} = {REDUCE_COMBINE[ph.op].format(a=f'acc_{ph.name}', b=v)};")
    return lines + [f"{ind}}}"]


def _store_lines(k: ReductionKernel, stores: list, ind: str) -> list:
    """The values of ``stores`` computed and written to their outputs."""
    em = Emitter(k, ind, {})
    vals = em.emit([s.value for s in stores])
    return em.lines + [f"{ind}out{s.buf}[{ix_c(s.offset)}] = fx_from<{ctype(k.outputs[s.buf].dtype)}>({v});"
                       for s, v in zip(stores, vals)]


def _row_outputs(k: ReductionKernel, guard: str, start: str, step: str, ind: str) -> list:
    if not k.row_stores:
        return []
    lines = [f"{ind}{guard}for (idx_t r_ = {start}; r_ < {k.row_size}; r_ += {step}) {{"]
    lines += decompose_index(list(k.reduced), "r_", ind + "  ")
    return lines + _store_lines(k, k.row_stores, ind + "  ") + [f"{ind}}}"]


def _outer_outputs(k: ReductionKernel, cond: str, ind: str) -> list:
    if not k.outer_stores:
        return []
    lines = [f"{ind}if ({cond}) {{"]
    return lines + _store_lines(k, k.outer_stores, ind + "  ") + [f"{ind}}}"]


MAX_ELEMS_PER_THREAD = 32   # row values one thread keeps per loaded input
MAX_REGS_PER_THREAD = 64    # row values one thread keeps over all its loaded inputs
BLOCK = 256
FILL_BLOCKS = 264           # blocks below which a block takes fewer rows (two per SM of an H100)


@dataclass(frozen=True)
class RowPlan:
    vec: int      # consecutive elements per load / store (1: scalar)
    tpr: int      # threads per row
    rpb: int      # rows per block
    chunks: int   # vec-wide pieces of a row
    iters: int    # chunks per thread

    @property
    def block(self) -> int:
        return self.tpr * self.rpb


def _row_loads(k: ReductionKernel, phases_only: bool = False) -> list:
    """Loads evaluated unconditionally in the phases (and the row outputs) that walk the row."""
    red = set(k.reduced)
    roots = [p.value for p in k.phases] + ([] if phases_only else [s.value for s in k.row_stores])
    hoist = Emitter(k, "", {}).unconditional(roots)
    return sorted((e for e in hoist if isinstance(e, Load) and ir.all_vars(e.offset) & red), key=repr)


def row_vector_width(k: ReductionKernel) -> int:
    """The widest vector the row's loads allow (1 if none is wider)."""
    if k.strategy != "inner" or not k.reduced:
        return 1
    inner = k.reduced[-1]
    loads = _row_loads(k)
    for vec in (8, 4, 2):
        if inner.size % vec:
            continue
        if any(vector_ok(ld.offset, inner, vec, k.inputs[ld.buf].dtype.itemsize) for ld in loads):
            if row_plan(k, vec) is not None:
                return vec
    return 1


def row_plan(k: ReductionKernel, vec: int) -> Optional[RowPlan]:
    """The register-row mapping for ``k`` at width ``vec``, or None where it does not apply."""
    R, rows = k.row_size, k.rows
    if k.strategy != "inner" or not k.reduced or R == 0 or rows == 0 or k.reduced[-1].size % vec:
        return None
    chunks = R // vec
    tpr = 1
    while tpr < min(chunks, 32):
        tpr *= 2
    iters = -(-chunks // tpr)
    n_loads = max(1, len(_row_loads(k, phases_only=True)))  # the row outputs' own: one chunk at a time
    if iters * vec > MAX_ELEMS_PER_THREAD or iters * vec * n_loads > MAX_REGS_PER_THREAD:
        return None
    rpb = BLOCK // tpr
    while rpb > 1 and rpb * tpr > 32 and -(-rows // rpb) < FILL_BLOCKS:
        rpb //= 2
    return RowPlan(vec, tpr, rpb, chunks, iters)


def generate_row_reduction(k: ReductionKernel, plan: RowPlan, name: str, header: list) -> tuple:
    """(lines of the kernel after ``header``, aligned accesses) for ``k`` mapped by ``plan``."""
    vec, tpr, rpb, chunks, iters = plan.vec, plan.tpr, plan.rpb, plan.chunks, plan.iters
    rows, inner = extent(0), k.reduced[-1]  # the rows: an argument (codegen/ir_kernel.py)
    lines = list(header)
    lines += [f"  const int lane_ = threadIdx.x % {tpr};", f"  const int sub_ = threadIdx.x / {tpr};",
              f"  for (idx_t base_ = (idx_t)blockIdx.x * {rpb}; base_ < {rows}; base_ += (idx_t)gridDim.x * {rpb}) {{",
              "    const idx_t rowu_ = base_ + sub_;",
              f"    const bool rowok_ = rowu_ < {rows};",
              f"    const idx_t row_ = rowok_ ? rowu_ : {rows} - 1;"]
    ind = "    "
    lines += split_index("row_", list(k.outer), ind)

    # the chunks of each iteration: loop variables renamed per iteration (straight-line code)
    subs, oks = [], []
    for it in range(iters):
        full = (it + 1) * tpr <= chunks
        lin = f"ch{it}_"
        if full:
            lines.append(f"{ind}const idx_t {lin} = lane_ + {it * tpr};")
            oks.append(None)
        else:
            lines += [f"{ind}const bool ok{it}_ = lane_ + {it * tpr} < {chunks};",
                      f"{ind}const idx_t {lin} = ok{it}_ ? (idx_t)(lane_ + {it * tpr}) : (idx_t){chunks - 1};"]
            oks.append(f"ok{it}_")
        renamed = [Var(f"{v.name}_{it}", v.size) for v in k.reduced[:-1]]
        chunk = Var(f"{inner.name}_c{it}", inner.size // vec)
        lines += split_index(lin, renamed + [chunk], ind)
        first = Var(f"{inner.name}_{it}", inner.size)
        lines.append(f"{ind}const idx_t {first.name} = {chunk.name} * {vec};")
        base = dict(zip(k.reduced[:-1], (Ix.of(v) for v in renamed)))
        base[inner] = Ix.of(first)
        subs.append([{**base, inner: Ix.of(first) + lane} for lane in range(vec)])

    # vector loads, each where it is first needed (the phases' before the first phase)
    loads = _row_loads(k)
    in_phases = set()
    for p in k.phases:
        in_phases |= {e for e in ir.walk(p.value) if isinstance(e, Load)}
    alias, aligned, loaded = {}, [], set()

    def load_lines(which: list, its: range) -> list:
        out = []
        for j, ld in enumerate(loads):
            if ld not in which or (j, its.start) in loaded or vec == 1:  # (all of ``its`` loaded together)
                continue
            item = k.inputs[ld.buf].dtype.itemsize
            if not vector_ok(ld.offset, inner, vec, item):
                continue
            loaded.update((j, it) for it in its)
            t = ctype(k.inputs[ld.buf].dtype)
            for it in its:
                off = ld.offset.substitute(subs[it][0])
                out.append(f"{ind}const fx_vec<{t}, {vec}> vl{j}_{it} = "
                           f"*reinterpret_cast<const fx_vec<{t}, {vec}>*>(in{ld.buf} + {ix_c(off)});")
                for lane in range(vec):
                    alias[Load(ld.buf, ld.offset.substitute(subs[it][lane]))] = f"fx_to_f32(vl{j}_{it}.v[{lane}])"
            aligned.append(("in", ld.buf, min(16, vec * item)))
        return out

    # (the phases' loads: all iterations at once, before the first phase; the outputs' own loads
    # one iteration at a time, just before its stores)
    phase_loads = [ld for ld in loads if ld in in_phases]
    lines += load_lines(phase_loads, range(iters))
    em = Emitter(k, ind, {}, alias)
    for ph in k.phases:
        acc = f"acc_{ph.name}"
        body = []
        for it in range(iters):
            vals = em.emit([ir.substitute(ph.value, s) for s in subs[it]])
            body.append((oks[it], vals))
        lines += em.lines
        em.lines = []
        lines.append(f"{ind}float {acc} = {REDUCE_INIT[ph.op]};")
        for ok, vals in body:
            for v in vals:
                comb = REDUCE_COMBINE[ph.op].format(a=acc, b=v)
                lines.append(f"{ind}{acc} = {comb};" if ok is None else f"{ind}{acc} = {ok} ? {comb} : {acc};")
        if tpr > 1:
            shfl = REDUCE_COMBINE[ph.op].format(a=acc, b=f"__shfl_xor_sync(0xffffffffu, {acc}, o_)")
            lines.append(f"{ind}for (int o_ = {tpr // 2}; o_ > 0; o_ >>= 1) {acc} = {shfl};")
        lines.append(f"{ind}const float red_{ph.name} = {acc};")

    if k.row_stores:
        for it in range(iters):
            lines += load_lines(loads, range(it, it + 1))
            per_lane = [[ir.Store(s.buf, s.offset.substitute(sub), ir.substitute(s.value, sub)) for s in k.row_stores]
                        for sub in subs[it]]
            vals = [em.emit([s.value for s in st]) for st in per_lane]
            lines += em.lines
            em.lines = []
            cond = "rowok_" if oks[it] is None else f"rowok_ && {oks[it]}"
            lines.append(f"{ind}if ({cond}) {{")
            for j, s in enumerate(k.row_stores):
                t = ctype(k.outputs[s.buf].dtype)
                if vec > 1 and vector_ok(s.offset, inner, vec, k.outputs[s.buf].dtype.itemsize):
                    lines.append(f"{ind}  fx_vec<{t}, {vec}> vs_;")
                    lines += [f"{ind}  vs_.v[{lane}] = fx_from<{t}>({vals[lane][j]});" for lane in range(vec)]
                    lines.append(f"{ind}  *reinterpret_cast<fx_vec<{t}, {vec}>*>(out{s.buf} + "
                                 f"{ix_c(per_lane[0][j].offset)}) = vs_;")
                    aligned.append(("out", s.buf, min(16, vec * k.outputs[s.buf].dtype.itemsize)))
                else:
                    lines += [f"{ind}  out{s.buf}[{ix_c(per_lane[lane][j].offset)}] = fx_from<{t}>({vals[lane][j]});"
                              for lane in range(vec)]
            lines.append(f"{ind}}}")
    if k.outer_stores:
        vals = em.emit([s.value for s in k.outer_stores])
        lines += em.lines
        em.lines = []
        lines.append(f"{ind}if (rowok_ && lane_ == 0) {{")
        lines += [f"{ind}  out{s.buf}[{ix_c(s.offset)}] = fx_from<{ctype(k.outputs[s.buf].dtype)}>({v});"
                  for s, v in zip(k.outer_stores, vals)]
        lines.append(f"{ind}}}")
    lines += ["  }", "}"]
    return lines, sorted(set(aligned))
