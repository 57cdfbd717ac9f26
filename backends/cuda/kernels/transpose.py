"""Tiled transposes: CUDA C for a ``PointwiseKernel`` whose stores walk the innermost loop ``b`` with
stride 1 while its largest input walks another loop ``a`` with stride 1 (a layout conversion
between channels_last and NCHW, a permute, with the epilogue fused into it).

Why: the pointwise mapping gives consecutive threads consecutive ``b``; the stores coalesce but
each thread's load of that input is ``stride(b)`` elements from its neighbour's, one memory
transaction per element. A conv epilogue stored NHWC -> NCHW for tresnet_m fp16 b32 on an H200
took 95 us for 25 MB (~270 GB/s); a transpose through shared memory moves it at a few TB/s.

The mapping (``tiled_plan``, ``generate_tiled``): a block of 32 x 8 threads takes a 32 x 32 tile
of (``a``, ``b``) at one position of the other loops. It reads the input with consecutive threads
on ``a`` (coalesced), four rows each, into shared memory (``tile_``, rows padded to 33 words: no
bank conflicts either way), waits at a barrier, then with consecutive threads on ``b`` reads its
element back, computes the whole value (the other loads, the epilogue) and stores (coalesced).
Positions past the loops' ends (the last tiles) load and store nothing, but every thread reaches
both barriers. Offered beside the default mapping as a measured candidate (``region.py``).
"""
from __future__ import annotations

from typing import Optional

from fxopt.backends.cuda.ir import Load, PointwiseKernel, Var
from fxopt.backends.cuda.codegen.c import ctype
from fxopt.backends.cuda.codegen.emit import Emitter, ix_c
from fxopt.backends.cuda.codegen.ir_kernel import (MAX_GRID, extent, extent_params, kernel_fast_math_prefix,
                                                   kernel_header, kernel_index64, kernel_name, kernel_params,
                                                   named_source, split_index)
from fxopt.backends.cuda.codegen.source import KernelSource

TILE = 32           # tile edge: a warp's worth of consecutive elements on each side
ROWS = 8            # warps a block (each thread 32 / ROWS elements a phase)
MIN_EXTENT = 8      # loops shorter than this leave most of a tile empty: the default mapping then


def _walks(ix, v: Var) -> bool:
    return ix.coef(v) == 1 and v not in ix.vars_inside_atoms()


def tiled_plan(k) -> Optional[tuple]:
    """(the transposed load, its stride-1 loop ``a``, the stores' ``b``) or None where ``k`` is not a
    transpose worth tiling: a single-part pointwise kernel whose first store walks its innermost
    loop with stride 1 and whose largest unconditional load walks another loop so, and not ``b``."""
    if not isinstance(k, PointwiseKernel) or k.parts or len(k.vars) < 2 or not k.stores:
        return None
    b = k.vars[-1]
    if b.size < MIN_EXTENT or not _walks(k.stores[0].offset, b):
        return None
    em = Emitter(k, "", {})
    best = None
    # in the order of the buffers (ties between inputs of one size go to the first, whatever the
    # set's order: the same kernel at every batch size and in every process)
    loads = sorted((e for e in em.unconditional([s.value for s in k.stores]) if isinstance(e, Load)),
                   key=lambda e: (e.buf, repr(e.offset)))
    for e in loads:
        if _walks(e.offset, b):
            continue
        a = next((v for v in k.vars[:-1] if v.size >= MIN_EXTENT and _walks(e.offset, v)), None)
        size = k.inputs[e.buf].numel
        if a is not None and (best is None or size > best[0]):
            best = (size, e, a)
    return None if best is None else (best[1], best[2], b)


def generate_tiled(k: PointwiseKernel, fast_math: bool = False) -> Optional[KernelSource]:
    """The tiled kernel of ``k`` (``tiled_plan``), or None where ``k`` is not such a transpose."""
    plan = tiled_plan(k)
    if plan is None:
        return None
    load, a, b = plan
    others = [v for v in k.vars if v not in (a, b)]
    at, bt = Var("at_", -(-a.size // TILE)), Var("bt_", -(-b.size // TILE))
    tiles = at.size * bt.size
    for v in others:
        tiles *= v.size
    per = TILE // ROWS
    index64 = kernel_index64(k)
    prefix = kernel_fast_math_prefix(k, fast_math)
    name = kernel_name(k, f"tile{TILE}" + "f" * bool(prefix))
    ps = kernel_params(k) + extent_params(1)
    lines = kernel_header(k, name, TILE * ROWS, ps, index64, prefix)
    lines += [f"  const int tx_ = threadIdx.x % {TILE};", f"  const int ty_ = threadIdx.x / {TILE};",
              f"  __shared__ float tile_[{TILE * (TILE + 1)}];",
              f"  for (idx_t t_ = blockIdx.x; t_ < {extent(0)}; t_ += gridDim.x) {{"]
    lines += split_index("t_", others + [at, bt], "    ")
    inside = f"{a.name} < {a.size} && {b.name} < {b.size}"
    # phase 1: consecutive threads on a, the input read coalesced into the tile
    lines += [f"    for (idx_t j_ = 0; j_ < {per}; j_ += 1) {{",
              f"      const idx_t {a.name} = at_ * {TILE} + tx_;",
              f"      const idx_t {b.name} = bt_ * {TILE} + ty_ + j_ * {ROWS};",
              f"      if ({inside}) {{",
              f"        tile_[(ty_ + j_ * {ROWS}) * {TILE + 1} + tx_] = fx_to_f32(in{load.buf}[{ix_c(load.offset)}]);",
              "      }", "    }", "    __syncthreads();"]
    # phase 2: consecutive threads on b, the value computed and stored coalesced
    lines += [f"    for (idx_t j_ = 0; j_ < {per}; j_ += 1) {{",
              f"      const idx_t {a.name} = at_ * {TILE} + ty_ + j_ * {ROWS};",
              f"      const idx_t {b.name} = bt_ * {TILE} + tx_;",
              f"      if ({inside}) {{"]
    em = Emitter(k, "        ", {}, {load: f"tile_[tx_ * {TILE + 1} + ty_ + j_ * {ROWS}]"})
    vals = em.emit([s.value for s in k.stores])
    lines += em.lines
    lines += [f"        out{s.buf}[{ix_c(s.offset)}] = fx_from<{ctype(k.outputs[s.buf].dtype)}>({v});"
              for s, v in zip(k.stores, vals)]
    lines += ["      }", "    }", "    __syncthreads();", "  }", "}"]
    meta = {"kernel": k, "vec": 1, "aligned": [], "grid": (max(1, min(tiles, MAX_GRID)), 1, 1), "work": k.numel,
            "extents": [tiles], "fast_math": bool(prefix),
            "geometry": {"tile": TILE, "rows": ROWS, "a": a.name, "b": b.name}}
    name, source = named_source(name, lines)
    return KernelSource(name, source, tuple(ps), "fused_pointwise", meta, (TILE * ROWS, 1, 1), index64)
