"""Column reductions: CUDA C for a ``ReductionKernel`` of the ``outer`` strategy of ``ir/`` (the
reduced index is not the innermost one: the sum over the radix of [N, R, C, H, W], a spatial mean
of a channels_last tensor, a softmax over dim 1 of [N, 2, C, 1, 1]).

Why: the earlier mapping gave a tile of 32 rows (outer indices) to a block of 32 x ``tr`` threads,
one scalar load per thread per reduced index and two barriers per tile; for R = 2 that is a block of
64 threads doing two 2-byte loads between barriers, and where the stored output is not laid out
like the input (a channels_last input summed into an NCHW output) each warp's 32 stores went to 32
cache lines. Split attention (radix-2 grouped convs, softmax over the radix, weighted sum) spent
113 us in each of two such sums of a few MB (``fx_red_sum_outer64``).

The mapping (``column_plan``): the rows, flattened with ``c`` (the innermost outer variable, which
the largest input walks with stride 1) fastest, are cut into groups of ``vec`` consecutive rows
(``vec`` divides ``c``'s size, so a group is ``vec`` consecutive columns of one position: one
16-byte load at most). Thread ``tx_`` of ``bx`` owns a group and loops over the reduced index with
``vec`` float32 accumulators per phase; a warp's loads are consecutive in memory (the classic column
reduction). Only where the groups are too few to fill the GPU (``FILL_THREADS``) is the reduced
index split: first over ``by`` threads of a block (combined in shared memory, every thread gets the
result, so later phases and row outputs work as before), then, for a single-phase kernel without
row outputs, over ``splits`` blocks (``blockIdx.y``): each writes its partial to a scratch buffer,
the last block of a column tile to arrive (an atomic ticket, the counter reset by that block)
combines the partials in split order (deterministic) and stores the outputs. Each split keeps at
least ``MIN_ITERS`` reduced elements per thread. Rows past the last (the last tile) are clamped to
the last valid group so that every thread runs the same barriers; they store nothing.

Where the per-row outputs walk another outer variable ``w`` with stride 1 and ``c`` not (the
output's contiguous axis differs from the input's), a block takes a tile of ``bx * vec`` columns x
``TILE_W`` positions of ``w``, stages its results in shared memory and writes them along ``w``
(``ColumnPlan.tw``): both the loads and the stores are coalesced.

The choice is from sizes and strides only; the cost model behind it is the bytes in flight: with
16-byte loads and a few loads in flight per thread, about 64K threads keep an H100's memory busy,
so a kernel with at least that many column groups needs no split at all (each thread reads its
columns straight through, no shared memory), and one with fewer trades the split's combine for
parallelism. Where even that leaves the GPU under-filled (a mean at batch 1), ``latency_plan`` is a
measured alternative: short chains of loads, blocks of one or two warps, the partials combined by
warp shuffles (``ColumnPlan.shfl``) before one row a warp goes through shared memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.ir import Ix, Load, Red, ReductionKernel, Var
from fxopt.backends.cuda.codegen.c import ctype
from fxopt.backends.cuda.codegen.emit import REDUCE_COMBINE, REDUCE_INIT, Emitter, ix_c
from fxopt.backends.cuda.codegen.ir_kernel import (MAX_GRID, extent, extent_params, kernel_fast_math_prefix,
                                                   kernel_header, kernel_index64, kernel_name, kernel_params,
                                                   named_source, split_index)
from fxopt.backends.cuda.codegen.source import KernelSource

BLOCK = 256
FILL_THREADS = 1 << 16  # column threads that fill an H100 (132 SMs): ~2 MB in flight at 16-byte loads
MIN_ITERS = 8           # reduced elements per thread at least, once the reduced index is split
MAX_SPLITS = 256        # blocks along the reduced index at most
FILL_BLOCKS = 264       # blocks below which a block takes fewer columns (two per SM of an H100)
TILE_C = 32             # transposed stores: columns per tile (x TILE_W = BLOCK * vec / TILE_C positions)
MAX_FILL = 1 << 18      # column threads at most that a compute-heavy plan aims for (``element_work``)
LATENCY_WORK = 0        # the ``work`` that asks ``column_plan`` for the latency plan (``latency_plan``)
LATENCY_CHAIN = 2       # loads a thread chains at most before a plan counts as under-filled (``underfilled``)
LATENCY_ITERS = 8       # a latency plan: reduced elements per thread it aims for
LATENCY_BY = 64         # a latency plan: threads of a block along the reduced index at most
LATENCY_SPLIT_BY = 32   # ... and where it splits over blocks (more, smaller blocks)
TREE_BY = 8             # a block's rows of partials above this are first halved in shared memory (a tree)
#: float operations of tens of instructions each (transcendentals, IEEE division): a reduced value
#: made of them (a SiLU epilogue inlined into a squeeze-excite mean) keeps a thread's ALU busy
#: longer than its loads, so few threads a SM leave that latency exposed
HEAVY_OPS = frozenset({"exp", "log", "div", "pow", "sqrt", "rsqrt", "reciprocal", "erf", "sin", "cos", "tanh",
                       "sigmoid", "silu", "gelu", "mish", "softplus", "softplus_beta", "elu", "log1p", "expm1"})


@dataclass(frozen=True)
class ColumnPlan:
    vec: int      # consecutive columns per thread (one vector access per walking input)
    bx: int       # threads of a block along the column groups
    by: int       # threads of a block along the reduced index (combined in shared memory)
    splits: int   # blocks along the reduced index (partials in scratch, the last block finishes)
    chunk: int    # reduced elements per split
    tiles: int    # tiles of the rows a block-row takes one after another (grid-stride)
    tw: int = 0   # transposed stores: threads (positions of ``w``) along ``w`` (0: stores along ``c``)
    shfl: bool = False  # ``by`` partials combined by warp shuffles first, then one row a warp in shared memory

    @property
    def block(self) -> int:
        return self.bx * (self.tw or self.by)


def vector_ok(ix: Ix, inner: Var, vec: int, itemsize: int) -> bool:
    """``ix`` walks ``inner`` with stride 1 from a multiple of ``vec`` (a ``vec``-wide access)."""
    if vec == 1:
        return True
    if ix.coef(inner) != 1 or inner in ix.vars_inside_atoms() or vec * itemsize > 16:
        return False
    return all(c % vec == 0 for a, c in ix.terms if a != inner) and ix.const % vec == 0


def _p2ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _p2floor(n: int) -> int:
    return 1 << max(0, int(n).bit_length() - 1)


def _loads(k: ReductionKernel) -> list:
    return sorted({e for p in k.phases for e in ir.walk(p.value) if isinstance(e, Load)}, key=repr)


def column_vector_width(k: ReductionKernel) -> int:
    """The widest ``vec`` (columns per thread) whose vector loads some input walking ``c`` allows."""
    if k.strategy != "outer" or not k.outer:
        return 1
    c = k.outer[-1]
    for vec in (8, 4, 2):
        if c.size % vec == 0 and any(vector_ok(ld.offset, c, vec, k.inputs[ld.buf].dtype.itemsize)
                                     for ld in _loads(k)):
            return vec
    return 1


def transpose_var(k: ReductionKernel) -> Optional[Var]:
    """The outer variable every per-row output walks with stride 1 where none walks ``c`` so."""
    c, found = k.outer[-1], set()
    if not k.outer_stores or k.row_stores:
        return None
    for s in k.outer_stores:
        inside = s.offset.vars_inside_atoms()
        if s.offset.coef(c) == 1 and c not in inside:
            return None
        w = next((v for v in k.outer[:-1] if s.offset.coef(v) == 1 and v not in inside), None)
        if w is None:
            return None
        found.add(w)
    return found.pop() if len(found) == 1 else None


def element_work(k: ReductionKernel) -> int:
    """1 + the heavy operations (``HEAVY_OPS``) each reduced element costs: the distinct ones among
    the phases' values that depend on the reduced variables."""
    memo: dict = {}
    heavy = {e for p in k.phases for e in ir.walk(p.value)
             if isinstance(e, ir.Op) and e.op in HEAVY_OPS and _varies(e, set(k.reduced), memo)}
    return 1 + len(heavy)


def underfilled(k: ReductionKernel, vec: int) -> bool:
    """Whether the default plan of ``k`` leaves most of the GPU idle: fewer than ``FILL_THREADS``
    threads because each keeps ``MIN_ITERS`` reduced elements (a mean at batch 1, [1, 1536, 14, 14]:
    192 column groups x 16 threads, each a chain of a dozen loads). Such a kernel is bound by that
    chain's latency, not by bandwidth: ``latency_plan`` plans it for more threads with shorter
    chains (``region.parallel_variant``, measured against the default)."""
    p = column_plan(k, vec)
    return p is not None and (k.rows // vec) * p.by * p.splits < FILL_THREADS \
        and -(-k.row_size // (p.by * p.splits)) > LATENCY_CHAIN


def _shuffles(bx: int, by: int) -> bool:
    """Whether a block of ``bx`` x ``by`` threads can combine its ``by`` partials by warp shuffles
    first: whole warps (a multiple of 32 threads), each holding at least two rows of partials."""
    return by > 1 and bx <= 16 and (bx * by) % 32 == 0


def latency_plan(k: ReductionKernel, vec: int) -> ColumnPlan:
    """The plan of an under-filled column reduction (``underfilled``): about ``LATENCY_ITERS``
    reduced elements a thread, whatever the GPU's fill. A batch-1 mean is a few hundred KB that a
    handful of SMs could stream; what its time is made of is the chain of dependent loads each
    thread waits on, the combine after it, and the launch. So the reduced index is split over
    ``by`` = R / ``LATENCY_ITERS`` threads of a block (a power of two, at most ``LATENCY_BY``), where
    that leaves at most twice ``LATENCY_ITERS`` a thread; only a longer one (a single phase without
    row outputs) is split over blocks of ``LATENCY_SPLIT_BY`` threads as well. A block keeps one
    warp's worth of threads at least (``bx = 32 / by`` column groups) and no more: small blocks
    spread over more SMs. The ``by`` partials are combined by warp shuffles, then one row a warp in
    shared memory (``ColumnPlan.shfl``). Measured on an H100 (bias + mean, fp16, channels_last,
    batch 1, 200 launches in a CUDA graph): [1, 1536, 7, 7] 1.88 us (the plan of more threads for
    heavy math, 2.15), [1, 1536, 14, 14] 2.14 (2.87), [1, 512, 28, 28] 2.72 (4.48), [1, 256, 56, 56]
    3.95 (6.44); the best of 34-106 geometries swept were within 5 % of these."""
    R, groups = k.row_size, k.rows // vec
    t = _p2ceil(-(-R // LATENCY_ITERS))
    by, splits = min(t, LATENCY_BY), 1
    if t > LATENCY_BY and -(-R // LATENCY_BY) > 2 * LATENCY_ITERS and len(k.phases) == 1 and not k.row_stores:
        by = LATENCY_SPLIT_BY
        splits = min(MAX_SPLITS, max(1, _p2ceil(-(-R // (2 * LATENCY_ITERS))) // by))
    chunk = -(-R // splits) if R else 0
    splits = -(-R // chunk) if R else 1
    bx = max(1, 32 // by)
    return ColumnPlan(vec, bx, by, splits, chunk, -(-groups // bx), 0, _shuffles(bx, by))


def column_plan(k: ReductionKernel, vec: int = 1, work: int = 1) -> Optional[ColumnPlan]:
    """The mapping of a column reduction (see the module's docstring), or None where ``k`` is not one.

    The cost model, from sizes alone: a thread streams its ``vec`` columns through the reduced
    index, so the kernel is memory-bound once about ``FILL_THREADS`` threads have loads in flight.
    ``groups = rows / vec`` threads come for free; the reduced index is split by the factor
    ``f`` still missing (a power of two), but never below ``MIN_ITERS`` elements per thread, since
    every split adds a combine (shared memory, or scratch and a ticket) that only pays when it buys
    parallelism. Within a block first (``by``, keeping a warp's worth of columns where there are
    that many), then over blocks (``splits``); a grid of fewer than ``FILL_BLOCKS`` blocks gives
    each block fewer columns (down to 8 threads' worth, 64 threads a block) so that it spreads
    over the SMs. ``work`` > 1 (``element_work``: heavy math per element) aims for ``work`` times
    the threads (at most ``MAX_FILL``) and ``MIN_ITERS / work`` elements a thread: more warps a SM
    to hide the arithmetic's latency, at the cost of more combining (a measured alternative, see
    ``kernels/region.py``); such a plan keeps only the columns of 64-128 bytes of a row a block
    (``32 / vec`` threads, at least 4), so that up to 64 threads of a block split the reduced
    index before any split over blocks (their partials combined by warp shuffles, then one row a
    warp summed in order; where a warp holds one row only, halved in shared memory by a tree down
    to ``TREE_BY`` rows). ``work`` = ``LATENCY_WORK``: ``latency_plan``. So the split-attention
    sums (rows = N*C*H*W in the millions, R = 2) take ``by = splits = 1``: every thread two
    16-byte loads and one store, no barrier; a global mean of a channels_last [N, C, 7, 7] (rows N*C, R = 49) splits R over a few
    threads of a block; a per-channel sum over N*H*W (rows = C, R large) over blocks as well.
    Stores that walk another variable than the loads take the transposed tile (``tw``) where
    there is no split and both axes are wide enough to fill it."""
    if k.strategy != "outer" or not k.outer or k.rows == 0 or k.outer[-1].size % vec:
        return None
    if work == LATENCY_WORK:
        return latency_plan(k, vec)
    R, groups = k.row_size, k.rows // vec
    fill, min_iters = min(MAX_FILL, FILL_THREADS * work), max(1, MIN_ITERS // work)
    f = min(_p2ceil(-(-fill // groups)), _p2floor(max(1, R // min_iters)))
    # the column threads a block keeps: by default a warp's worth before the reduced index is split
    # within the block, and 8 as the blocks spread; planned for more threads, only those that span
    # 64-128 bytes of a row (the rest of the block walks the reduced index)
    keep, bx_min = (32, 8) if work == 1 else (max(4, 32 // vec),) * 2
    by = min(f, BLOCK // min(keep, _p2ceil(groups)))
    bx = min(BLOCK // by, _p2ceil(groups))
    splits = 1
    if f > by and len(k.phases) == 1 and not k.row_stores:
        splits = min(MAX_SPLITS, -(-f // by))
    chunk = -(-R // splits) if R else 0
    splits = -(-R // chunk) if R else 1
    while bx > bx_min and bx * by > 64 and -(-groups // bx) * splits < FILL_BLOCKS:
        bx //= 2  # fewer columns a block: the blocks spread over more SMs
    c, w = k.outer[-1], transpose_var(k)
    if w is not None and by == 1 and splits == 1 and c.size >= TILE_C // 2 and w.size >= 16:
        bx = max(1, TILE_C // vec)
        tw = BLOCK // bx
        tiles = (k.rows // (c.size * w.size)) * -(-w.size // tw) * -(-c.size // (bx * vec))
        return ColumnPlan(vec, bx, 1, 1, chunk, tiles, tw)
    return ColumnPlan(vec, bx, by, splits, chunk, -(-groups // bx), 0, work > 1 and _shuffles(bx, by))


def smem_stride(p: ColumnPlan) -> int:
    """Floats between two rows of a block's partials in shared memory: the row's ``vec * bx``, plus
    ``bx`` where that is a multiple of the 32 banks, so that the rows of partials a warp writes
    (``32 / bx`` of them, at the same columns) fall in different banks."""
    row = p.vec * p.bx
    return row + p.bx if row % 32 == 0 else row


def _rename_reds(e, lane: int, memo: dict):
    """``e`` with each ``Red(p)`` replaced by lane ``lane``'s ``Red(p_lane)``."""
    return ir.map_leaves(e, lambda x: Red(f"{x.name}_{lane}") if isinstance(x, Red) else None, memo)


def _lane(exprs: list, c: Var, lane: int) -> list:
    """``exprs`` at the thread's column ``c + lane`` (its reductions: that lane's)."""
    memo: dict = {}
    return [_rename_reds(ir.substitute(e, {c: Ix.of(c) + lane}), lane, memo) for e in exprs]


def _varies(e, red: set, memo: dict) -> bool:
    """Whether ``e`` depends on the reduced variables ``red``."""
    if e not in memo:
        if isinstance(e, Load):
            memo[e] = bool(ir.all_vars(e.offset) & red)
        elif isinstance(e, ir.InRange):
            memo[e] = bool(ir.all_vars(e.index) & red)
        else:
            memo[e] = any(_varies(a, red, memo) for a in ir.children(e))
    return memo[e]


class _Gen:
    def __init__(self, k: ReductionKernel, plan: ColumnPlan, ext: dict):
        self.k, self.p, self.c = k, plan, k.outer[-1]
        self.ext = ext  # extent name -> its C name (an argument, codegen/ir_kernel.py)
        self.em = Emitter(k, "", {})
        self.aligned: list = []

    def _emit(self, roots: list, ind: str) -> list:
        self.em.indent, self.em.lines = ind, []
        names = self.em.emit(roots)
        self.lines += self.em.lines
        return names

    def _vector_loads(self, exprs: list, ind: str) -> None:
        """One vector load for each unconditional load of ``exprs`` that walks ``c`` from a multiple
        of ``vec`` (the thread's first column; the other lanes' loads become its elements)."""
        k, vec, c = self.k, self.p.vec, self.c
        if vec == 1:
            return
        for e in sorted((x for x in self.em.unconditional(exprs) if isinstance(x, Load)), key=repr):
            item = k.inputs[e.buf].dtype.itemsize
            if e in self.em.alias or not vector_ok(e.offset, c, vec, item):
                continue
            name, t = f"vl{len(self.aligned)}", ctype(k.inputs[e.buf].dtype)
            self.lines.append(f"{ind}const fx_vec<{t}, {vec}> {name} = "
                              f"*reinterpret_cast<const fx_vec<{t}, {vec}>*>(in{e.buf} + {ix_c(e.offset)});")
            for lane in range(vec):
                self.em.alias[Load(e.buf, e.offset.substitute({c: Ix.of(c) + lane}))] = f"fx_to_f32({name}.v[{lane}])"
            self.aligned.append(("in", e.buf, min(16, vec * item)))

    def _phase(self, ph, lo: str, hi: str, ind: str) -> None:
        """Thread's accumulators of phase ``ph`` over r = lo + ty_, ... < hi, then ``red_<phase>_<lane>``."""
        k, p = self.k, self.p
        vals = [_lane([ph.value], self.c, lane)[0] for lane in range(p.vec)]
        memo: dict = {}
        fixed = [e for e in self.em.unconditional(vals) if not _varies(e, set(k.reduced), memo)
                 and not isinstance(e, (ir.Const, ir.BoolConst, Red))]
        self._vector_loads(fixed, ind)
        self._emit(sorted(fixed, key=repr), ind)  # per-column values: once, before the loop
        accs = [f"acc_{ph.name}_{lane}" for lane in range(p.vec)]
        self.lines += [f"{ind}float {a} = {REDUCE_INIT[ph.op]};" for a in accs]
        start = f"{lo} + ty_" if p.by > 1 else lo
        self.lines += [f"{ind}#pragma unroll 4", f"{ind}for (idx_t r_ = {start}; r_ < {hi}; r_ += {p.by}) {{"]
        scope, alias = dict(self.em.names), dict(self.em.alias)
        self.lines += split_index("r_", list(k.reduced), ind + "  ")
        self._vector_loads(vals, ind + "  ")
        names = self._emit(vals, ind + "  ")
        self.lines += [f"{ind}  {a} = {REDUCE_COMBINE[ph.op].format(a=a, b=v)};" for a, v in zip(accs, names)]
        self.lines.append(f"{ind}}}")
        self.em.names, self.em.alias = scope, alias
        reds = [f"red_{ph.name}_{lane}" for lane in range(p.vec)]
        if p.by == 1:
            self.lines += [f"{ind}float {r} = {a};" for r, a in zip(reds, accs)]
            return
        stride = smem_stride(p)
        if p.shfl:
            self._shuffled(ph, accs, reds, stride, ind)
            return
        self.lines += [f"{ind}smem_[ty_ * {stride} + {lane * p.bx} + tx_] = {a};" for lane, a in enumerate(accs)]
        self.lines.append(f"{ind}__syncthreads();")
        if p.by > TREE_BY:  # halve the rows of partials in place until TREE_BY are left
            comb, h = REDUCE_COMBINE[ph.op], p.by // 2
            while h >= TREE_BY:
                at = [f"smem_[ty_ * {stride} + {lane * p.bx} + tx_]" for lane in range(p.vec)]
                up = [f"smem_[(ty_ + {h}) * {stride} + {lane * p.bx} + tx_]" for lane in range(p.vec)]
                self.lines.append(f"{ind}if (ty_ < {h}) {{")
                self.lines += [f"{ind}  {a} = {comb.format(a=a, b=b)};" for a, b in zip(at, up)]
                self.lines += [f"{ind}}}", f"{ind}__syncthreads();"]
                h //= 2
        rows = min(p.by, TREE_BY)
        self.lines += [f"{ind}float {r} = smem_[{lane * p.bx} + tx_];" for lane, r in enumerate(reds)]
        self.lines.append(f"{ind}for (idx_t j_ = 1; j_ < {rows}; j_ += 1) {{")
        comb = REDUCE_COMBINE[ph.op]
        self.lines += [f"{ind}  {r} = {comb.format(a=r, b=f'smem_[j_ * {stride} + {lane * p.bx} + tx_]')};"
                       for lane, r in enumerate(reds)]
        self.lines += [f"{ind}}}", f"{ind}__syncthreads();"]

    def _shuffled(self, ph, accs: list, reds: list, stride: int, ind: str) -> None:
        """A warp's lanes of one ``tx_`` (``32 / bx`` rows of partials) combined by butterfly
        shuffles (every lane gets the warp's sum), then the warps' rows in shared memory, summed in
        warp order after one barrier."""
        p, comb = self.p, REDUCE_COMBINE[ph.op]
        off = 16
        while off >= p.bx:
            self.lines += [f"{ind}{a} = {comb.format(a=a, b=f'__shfl_xor_sync(0xffffffffu, {a}, {off})')};"
                           for a in accs]
            off //= 2
        self.lines.append(f"{ind}if (threadIdx.x % 32 < {p.bx}) {{")
        self.lines += [f"{ind}  smem_[(threadIdx.x / 32) * {stride} + {lane * p.bx} + tx_] = {a};"
                       for lane, a in enumerate(accs)]
        self.lines += [f"{ind}}}", f"{ind}__syncthreads();"]
        self.lines += [f"{ind}float {r} = smem_[{lane * p.bx} + tx_];" for lane, r in enumerate(reds)]
        self.lines.append(f"{ind}for (idx_t j_ = 1; j_ < {p.block // 32}; j_ += 1) {{")
        self.lines += [f"{ind}  {r} = {comb.format(a=r, b=f'smem_[j_ * {stride} + {lane * p.bx} + tx_]')};"
                       for lane, r in enumerate(reds)]
        self.lines += [f"{ind}}}", f"{ind}__syncthreads();"]

    def _store(self, s, val: str, off: Ix, ind: str) -> str:
        return f"{ind}out{s.buf}[{ix_c(off)}] = fx_from<{ctype(self.k.outputs[s.buf].dtype)}>({val});"

    def _stores(self, stores: list, ind: str) -> None:
        """``stores`` for the thread's columns (vector stores along ``c`` where they allow)."""
        vec, c = self.p.vec, self.c
        per_lane = [[ir.Store(s.buf, s.offset.substitute({c: Ix.of(c) + lane}), v)
                     for s, v in zip(stores, _lane([s.value for s in stores], c, lane))] for lane in range(vec)]
        scope, alias = dict(self.em.names), dict(self.em.alias)  # what is emitted here stays in its block
        self._vector_loads([s.value for st in per_lane for s in st], ind)
        vals = [self._emit([s.value for s in st], ind) for st in per_lane]
        for j, s in enumerate(stores):
            dt = self.k.outputs[s.buf].dtype
            if vec > 1 and vector_ok(s.offset, c, vec, dt.itemsize):
                t = ctype(dt)
                self.lines.append(f"{ind}fx_vec<{t}, {vec}> vs{j}_;")
                self.lines += [f"{ind}vs{j}_.v[{lane}] = fx_from<{t}>({vals[lane][j]});" for lane in range(vec)]
                self.lines.append(f"{ind}*reinterpret_cast<fx_vec<{t}, {vec}>*>(out{s.buf} + {ix_c(s.offset)}) = vs{j}_;")
                self.aligned.append(("out", s.buf, min(16, vec * dt.itemsize)))
            else:
                self.lines += [self._store(s, vals[lane][j], per_lane[lane][j].offset, ind) for lane in range(vec)]
        self.em.names, self.em.alias = scope, alias

    def generate(self, header: list) -> list:
        k, p, c = self.k, self.p, self.c
        self.lines = list(header)
        R = k.row_size
        groups = self.ext.get("groups")
        self.lines += [f"  const int tx_ = threadIdx.x % {p.bx};", f"  const int ty_ = threadIdx.x / {p.bx};"]
        if p.by > 1:
            self.lines.append(f"  __shared__ float smem_[{p.by * smem_stride(p)}];")
        if p.tw:
            self.lines.append(f"  __shared__ float stg_[{p.bx * p.vec * (p.tw + 1)}];")
        if p.splits > 1:
            self.lines.append("  __shared__ int last_[1];")
        self.lines.append(f"  for (idx_t tile_ = blockIdx.x; tile_ < {self.ext['tiles']}; tile_ += gridDim.x) {{")
        ind = "    "
        if p.tw:
            w = transpose_var(k)
            rest = [v for v in k.outer if v not in (c, w)]
            ct, wt = Var("ct_", -(-c.size // (p.bx * p.vec))), Var("wt_", -(-w.size // p.tw))
            self.lines += split_index("tile_", rest + [wt, ct], ind)
            self.lines += [f"{ind}const idx_t cu_ = ct_ * {p.bx * p.vec} + tx_ * {p.vec};",
                           f"{ind}const idx_t wu_ = wt_ * {p.tw} + ty_;",
                           f"{ind}const idx_t {c.name} = cu_ < {c.size} ? cu_ : (idx_t){c.size - p.vec};",
                           f"{ind}const idx_t {w.name} = wu_ < {w.size} ? wu_ : (idx_t){w.size - 1};"]
        else:
            self.lines += [f"{ind}const idx_t gu_ = tile_ * {p.bx} + tx_;", f"{ind}const bool ok_ = gu_ < {groups};",
                           f"{ind}const idx_t q_ = (gu_ < {groups} ? gu_ : {groups} - 1) * {p.vec};"]
            self.lines += split_index("q_", list(k.outer), ind)
        lo, hi = "0", str(R)
        if p.splits > 1:
            lo, hi = "lo_", "hi_"
            self.lines += [f"{ind}const idx_t lo_ = (idx_t)blockIdx.y * {p.chunk};",
                           f"{ind}const idx_t hi_ = lo_ + {p.chunk} < {R} ? lo_ + {p.chunk} : (idx_t){R};"]
        for ph in k.phases:
            self._phase(ph, lo, hi, ind)
        if p.splits > 1:
            self._finish_split(ind)
        elif p.tw:
            self._transposed(ind)
        else:
            if k.row_stores:
                self.lines += [f"{ind}if (ok_) {{", f"{ind}  for (idx_t r_ = ty_; r_ < {R}; r_ += {p.by}) {{"]
                scope, alias = dict(self.em.names), dict(self.em.alias)
                self.lines += split_index("r_", list(k.reduced), ind + "    ")
                self._stores(k.row_stores, ind + "    ")
                self.em.names, self.em.alias = scope, alias
                self.lines += [f"{ind}  }}", f"{ind}}}"]
            if k.outer_stores:
                self.lines.append(f"{ind}if (ok_ && ty_ == 0) {{")
                self._stores(k.outer_stores, ind + "  ")
                self.lines.append(f"{ind}}}")
        self.lines += ["  }", "}"]
        return self.lines

    def _finish_split(self, ind: str) -> None:
        """Partials to scratch; the tile's last block to arrive combines them and stores."""
        k, p = self.k, self.p
        (ph,) = k.phases
        reds = [f"red_{ph.name}_{lane}" for lane in range(p.vec)]
        self.lines.append(f"{ind}if (ok_ && ty_ == 0) {{")
        rows = self.ext["rows"]
        self.lines += [f"{ind}  ws_[(idx_t)blockIdx.y * {rows} + q_ + {lane}] = {r};" for lane, r in enumerate(reds)]
        self.lines += [f"{ind}}}", f"{ind}__threadfence();", f"{ind}__syncthreads();",
                       f"{ind}if (threadIdx.x == 0) {{",
                       f"{ind}  const unsigned int tk_ = atomicAdd(cnt_ + tile_, 1u);",
                       f"{ind}  last_[0] = tk_ == {p.splits - 1}u;", f"{ind}}}", f"{ind}__syncthreads();",
                       f"{ind}if (last_[0]) {{"]
        self.lines += [f"{ind}  {r} = __ldcg(ws_ + q_ + {lane});" for lane, r in enumerate(reds)]
        self.lines.append(f"{ind}  for (idx_t s_ = 1; s_ < {p.splits}; s_ += 1) {{")
        self.lines += [f"{ind}    {r} = {REDUCE_COMBINE[ph.op].format(a=r, b=f'__ldcg(ws_ + s_ * {rows} + q_ + {lane})')};"
                       for lane, r in enumerate(reds)]
        self.lines += [f"{ind}  }}", f"{ind}  if (ok_ && ty_ == 0) {{"]
        self._stores(k.outer_stores, ind + "    ")
        self.lines += [f"{ind}  }}", f"{ind}  if (threadIdx.x == 0) {{", f"{ind}    cnt_[tile_] = 0u;", f"{ind}  }}",
                       f"{ind}}}", f"{ind}__syncthreads();"]

    def _transposed(self, ind: str) -> None:
        """Per-row outputs staged in shared memory, written along ``w`` by consecutive threads."""
        k, p, c = self.k, self.p, self.c
        w, tc, tp = transpose_var(k), p.bx * p.vec, p.tw + 1
        vals = [self._emit(_lane([s.value for s in k.outer_stores], c, lane), ind) for lane in range(p.vec)]
        cs, ws = Var("cc_", c.size), Var("wc_", w.size)
        for j, s in enumerate(k.outer_stores):
            self.lines += [f"{ind}stg_[(tx_ * {p.vec} + {lane}) * {tp} + ty_] = {vals[lane][j]};" for lane in range(p.vec)]
            self.lines += [f"{ind}__syncthreads();",
                           f"{ind}for (idx_t e_ = threadIdx.x; e_ < {tc * p.tw}; e_ += {p.block}) {{",
                           f"{ind}  const idx_t cc_ = ct_ * {tc} + e_ / {p.tw};",
                           f"{ind}  const idx_t wc_ = wt_ * {p.tw} + e_ % {p.tw};",
                           f"{ind}  if (cc_ < {c.size} && wc_ < {w.size}) {{",
                           self._store(s, f"stg_[(e_ / {p.tw}) * {tp} + e_ % {p.tw}]",
                                       s.offset.substitute({c: Ix.of(cs), w: Ix.of(ws)}), ind + "    "),
                           f"{ind}  }}", f"{ind}}}", f"{ind}__syncthreads();"]


def generate_column_reduction(k: ReductionKernel, plan: ColumnPlan, fast_math: bool = False,
                              work: int = 1) -> KernelSource:
    """The kernel of ``k`` mapped by ``plan`` (``column_plan``; ``work``: what it was planned for,
    part of the kernel's name, since plans of one block size may differ in its shape)."""
    prefix = kernel_fast_math_prefix(k, fast_math)
    index64 = kernel_index64(k)
    variant = (f"cols{plan.block}v{plan.vec}" + (f"s{plan.splits}" if plan.splits > 1 else "") + "t" * bool(plan.tw)
               + "x" * plan.shfl + (f"w{work}" if work > 1 else "l" if work == LATENCY_WORK else ""))
    name = kernel_name(k, variant + "f" * bool(prefix))
    ps = kernel_params(k)
    if plan.splits > 1:
        ps = ps + [("ws_", "float*"), ("cnt_", "unsigned int*")]
    # the extents that scale with the batch, as arguments (codegen/ir_kernel.py): the tiles, the
    # row groups (without the transposing staging) and the rows (a split's partials)
    values = {"tiles": plan.tiles, "groups": None if plan.tw else k.rows // plan.vec,
              "rows": k.rows if plan.splits > 1 else None}
    values = {n: v for n, v in values.items() if v is not None}
    ps = ps + extent_params(len(values))
    gen = _Gen(k, plan, {n: extent(i) for i, n in enumerate(values)})
    lines = gen.generate(kernel_header(k, name, plan.block, ps, index64, prefix))
    geometry = vars(plan) | {"block": plan.block}
    meta = {"kernel": k, "grid": (max(1, min(plan.tiles, MAX_GRID)), plan.splits, 1), "geometry": geometry,
            "aligned": sorted(set(gen.aligned)), "vec": plan.vec, "extents": list(values.values()),
            "fast_math": bool(prefix)}
    if plan.splits > 1:
        meta["scratch"] = (plan.splits * k.rows, plan.tiles)  # float partials, int32 tickets (zeroed)
    name, source = named_source(name, lines)
    return KernelSource(name, source, tuple(ps), "fused_reduction", meta, (plan.block, 1, 1), index64)
