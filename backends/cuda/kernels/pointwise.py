"""The pointwise family: CUDA C for a ``PointwiseKernel`` of the loop-level IR (``ir/``), one kernel per
scheduled region (reductions: ``reduction.py``; the region's candidate and launch: ``region.py``).

``generate_kernel(k, vec)`` writes the source of a ``PointwiseKernel`` or ``ReductionKernel``:

- sizes, strides and offsets are compile-time constants (a kernel is specialised to its shapes;
  the scheduler only fuses static shapes), except the outermost extent that scales with the batch
  (work items, rows, tiles), an argument (``codegen/ir_kernel.py``, "Extents as arguments");
  indices are ``int`` unless an extent needs 64 bits;
- value expressions are emitted once per distinct subtree (equal subtrees are one IR node),
  except under a ``Where`` branch: a load there may be out of bounds for the rows the condition
  excludes (padding, the other inputs of a concatenation), so a branch is evaluated inline and
  only when taken;
- math is float32: loads widen, stores round (``fx_from<T>``), and the IR rounds each 16-bit
  value a node defines (a ``Cast``, ``schedule/build.py``), as eager rounds each op's result;
- pointwise kernels: a grid-stride loop over the work items; with ``vec > 1`` each item is ``vec``
  consecutive elements of the innermost loop, and every unconditional access that walks that
  loop with stride 1 (from a ``vec``-aligned start) is one 16-byte (at most) vector load or store;
  the other accesses stay scalar, one per lane. The launcher checks the pointers' alignment;
- reductions, ``inner`` mapping: rows that fit in registers as ``reduction.py`` maps them (each
  value loaded once, vector loads and stores); other rows one warp per row (row <= 1024 elements: 8
  rows per block) or one block per row (longer rows), each thread striding over the row, combined by warp shuffles
  (and shared memory across the warps of a block); ``outer`` mapping: a block of 32 consecutive
  rows x ``TR`` threads, each thread striding over the reduced index of its row, combined in
  shared memory. Every thread ends a phase with the row's result (the next phase may use it);
  row outputs are written in a last pass over the row, per-row outputs by one thread.
"""
from __future__ import annotations

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import Ix, Load, PointwiseKernel, ReductionKernel, Var
from fxopt.backends.cuda.codegen.c import ctype
from fxopt.backends.cuda.codegen.emit import Emitter, ix_c
from fxopt.backends.cuda.codegen.ir_kernel import (MAX_GRID, decompose_index, extent, extent_params,
                                                   kernel_fast_math_prefix, kernel_header, kernel_index64,
                                                   kernel_name, kernel_params, named_source)
from fxopt.backends.cuda.codegen.source import KernelSource
from fxopt.backends.cuda.kernels.reduction import reduction_vector_width


POINTWISE_BLOCK = 256


def _vector_plan(k: PointwiseKernel, vec: int):
    """(vector loads, vector stores) for width ``vec`` on the innermost loop, or None."""
    if vec == 1 or not k.vars or k.vars[-1].size % vec:
        return None
    inner = k.vars[-1]

    def ok(ix: Ix, itemsize: int) -> bool:
        if ix.coef(inner) != 1 or inner in ix.vars_inside_atoms():
            return False
        return all(c % vec == 0 for a, c in ix.terms if a != inner) and ix.const % vec == 0 and vec * itemsize <= 32
    em = Emitter(k, "", {})
    hoist = em.unconditional([s.value for s in k.stores])
    loads = sorted({e for e in hoist if isinstance(e, Load) and ok(e.offset, k.inputs[e.buf].dtype.itemsize)},
                   key=repr)
    stores = [j for j, s in enumerate(k.stores) if ok(s.offset, k.outputs[s.buf].dtype.itemsize)]
    if not loads and not stores:
        return None
    return loads, stores


def _pointwise_loop(k: PointwiseKernel, vec: int, block: int, ind: str, part: int = 0) -> tuple:
    """(lines, aligned accesses, work items) of the grid-stride loop of one (sub-)kernel (``part``:
    its index, whose extent argument bounds the loop)."""
    plan = _vector_plan(k, vec)
    vec = vec if plan is not None else 1
    work = k.numel // vec
    lines = [f"{ind}for (idx_t w_ = (idx_t)blockIdx.x * {block} + threadIdx.x; w_ < {extent(part)}; "
             f"w_ += (idx_t)gridDim.x * {block}) {{"]
    ind2 = ind + "  "
    vars_ = list(k.vars)
    aligned = []
    if vec == 1:
        lines += decompose_index(vars_, "w_", ind2)
        em = Emitter(k, ind2, {})
        vals = em.emit([s.value for s in k.stores])
        lines += em.lines
        for s, v in zip(k.stores, vals):
            lines.append(f"{ind2}out{s.buf}[{ix_c(s.offset)}] = fx_from<{ctype(k.outputs[s.buf].dtype)}>({v});")
    else:
        loads, vstores = plan
        inner = vars_[-1]
        chunk = Var(inner.name, inner.size // vec)
        lines += decompose_index(vars_[:-1] + [chunk], "w_", ind2)
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
        em = Emitter(k, ind2, {}, alias)
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
    accesses allow, up to this). ``fast_math``: option fast_math (``codegen.c.fast_math_prefix``)."""
    index64 = kernel_index64(k)
    prefix = kernel_fast_math_prefix(k, fast_math)
    name = kernel_name(k, f"v{vec}" + "f" * bool(prefix))
    ps = kernel_params(k) + extent_params(max(1, len(k.parts)))
    lines = kernel_header(k, name, block, ps, index64, prefix)
    aligned, works = [], []
    if k.parts:
        lines.append("  switch (blockIdx.y) {")
        for i, part in enumerate(k.parts):
            body, al, work = _pointwise_loop(part, min(vec, vector_width(part)) if vec > 1 else 1, block, "    ", i)
            lines += [f"  case {i}: {{"] + body + ["    break;", "  }"]
            aligned += al
            works.append(work)
        lines.append("  }")
    else:
        body, aligned, work = _pointwise_loop(k, vec, block, "  ")
        lines += body
        works.append(work)
    lines.append("}")
    grid = max(1, min(-(-max(works) // block), MAX_GRID))
    meta = {"kernel": k, "vec": vec, "aligned": sorted(set(aligned)), "grid": (grid, max(1, len(k.parts)), 1),
            "work": sum(works), "extents": works, "fast_math": bool(prefix)}
    name, source = named_source(name, lines)
    return KernelSource(name, source, tuple(ps), "fused_pointwise", meta, (block, 1, 1), index64)


def vector_width(k) -> int:
    """The widest vector (at most 16 bytes per output element group) the kernel's innermost loop
    allows (of a split kernel: the widest any of its parts allows), or 1."""
    if isinstance(k, ReductionKernel):
        return reduction_vector_width(k)
    if isinstance(k, PointwiseKernel) and k.parts:
        return max(vector_width(p) for p in k.parts)
    if not isinstance(k, PointwiseKernel) or not k.vars:
        return 1
    size = max(b.dtype.itemsize for b in k.outputs)
    for vec in (16 // size, 8, 4, 2):
        if 1 < vec <= 16 // size and k.vars[-1].size % vec == 0 and _vector_plan(k, vec) is not None:
            return vec
    return 1
