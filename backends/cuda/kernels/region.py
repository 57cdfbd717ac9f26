"""The fusion scheduler's region kernels: ``generate_kernel`` (a pointwise or reduction kernel of the
IR, ``pointwise.py`` / ``reduction.py``), ``vector_width`` (the widest vector its innermost loop
allows), the region's candidate ``GeneratedRegion`` (a vectorized variant where the innermost loop
allows, and a scalar one for tensors that are not aligned for it; for a column reduction of heavy
math or of an under-filled plan, ``parallel_variant``, the same kernel planned for more threads or
for short chains of loads, and for a transposing pointwise kernel, ``tiled_variant``, shared-memory
tiles, each measured against it; option ``fast_math``: approximate exp and division in the
activations; ``__call__`` returns ``None``, so that the reference runs, when the tensors it gets
are not on the GPU or differ in shape, dtype or strides from those the kernel was generated for)
and its launch (``launch_fused``: buffers checked against the kernel's, vector accesses'
alignment; the scratch of a column reduction split over blocks, ``meta["scratch"]``: its partials
allocated per launch, its ticket counters kept by the region)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from fxopt.backends.cuda.ir import PointwiseKernel, ReductionKernel
from fxopt.backends.cuda.codegen.source import KernelSource
from fxopt.backends.cuda.kernels.column_reduction import LATENCY_WORK, element_work, underfilled
from fxopt.backends.cuda.kernels.common import compiled_kernel, meta
from fxopt.backends.cuda.kernels.pointwise import generate_pointwise_kernel, vector_width
from fxopt.backends.cuda.kernels.reduction import generate_reduction_kernel
from fxopt.backends.cuda.kernels.transpose import generate_tiled

if TYPE_CHECKING:
    from fxopt.backends.cuda.schedule.fusion import Region


def generate_kernel(k, vec: int = 1, fast_math: bool = False, work: int = 1) -> KernelSource:
    """The source of an IR kernel (``vec``: vector width of the innermost (pointwise) or reduced loop;
    ``fast_math``: option fast_math, see ``codegen.c.fast_math_prefix``; ``work``: a column
    reduction planned for that much math per element)."""
    if isinstance(k, PointwiseKernel):
        return generate_pointwise_kernel(k, vec, fast_math=fast_math)
    if isinstance(k, ReductionKernel):
        return generate_reduction_kernel(k, fast_math, vec, work)
    raise TypeError(f"not an IR kernel: {type(k).__name__}")


class GeneratedRegion:
    def __init__(self, region: Region, fast_math: bool = False, work: int = 1, sources: Optional[dict] = None):
        self.region, self.name, self.label = region, region.name, "fused"
        self.kernels: dict = {}
        self.tickets: dict = {}  # (kernel, device) -> a split column reduction's counters (``launch_fused``)
        if sources is not None:  # another mapping of the region's kernel (``tiled_variant``)
            self.sources = dict(sources)
            return
        k = region.kernel
        vec = vector_width(k)
        self.sources = {vec: generate_kernel(k, vec, fast_math, work)}
        if vec > 1 and not _aligned_by_metadata(self.sources[vec], region):
            self.sources[1] = generate_kernel(k, 1, fast_math, work)  # for the tensors that will not be aligned

    @property
    def ops(self) -> list:
        return list(self.region.ops)

    def __call__(self, *inputs):
        k = self.region.kernel
        if len(self.kernels) != len(self.sources) or len(inputs) != len(k.inputs):
            return None
        for t, b in zip(inputs, k.inputs):
            if not isinstance(t, torch.Tensor) or not t.is_cuda or not buffer_fits(t, b.shape, b.strides, b.dtype):
                return None
        device = inputs[0].device if inputs else torch.device("cuda")
        outs = [torch.empty_strided(b.shape, b.strides, dtype=b.dtype, device=device) for b in k.outputs]
        for variant in sorted(self.sources, reverse=True):
            ks = self.sources[variant]
            if vector_aligned(ks, inputs, outs):
                launch_fused(ks, inputs, outs, kernel=self.kernels[variant], tickets=self.tickets)
                return tuple(outs)
        return None


def parallel_variant(region: Region, generated: GeneratedRegion, fast_math: bool = False) -> dict:
    """A column reduction's other plans, each measured against the default plan (which is planned
    for the loads alone): ``generated_parallel``, planned for more threads where its reduced values
    are heavy math (``column_reduction.element_work``, a SiLU epilogue inlined into a squeeze-excite
    mean), and ``generated_latency``, short chains of loads and small blocks where the default plan
    leaves the GPU under-filled (``column_reduction.underfilled``, a mean at batch 1; both where
    both hold); ``{}`` where the kernel is neither or a plan is the default's."""
    k = region.kernel
    if not isinstance(k, ReductionKernel) or k.strategy != "outer":
        return {}
    plans = {}
    work = element_work(k)
    if work >= 2:
        plans["parallel"] = work
    if underfilled(k, vector_width(k)):
        plans["latency"] = LATENCY_WORK
    out = {}
    for label, w in plans.items():
        alt = GeneratedRegion(region, fast_math, w)
        if all(alt.sources.get(v) is not None and alt.sources[v].name == ks.name
               for v, ks in generated.sources.items()):
            continue
        alt.label = label
        out[f"generated_{label}"] = (alt, alt)
    return out


def tiled_variant(region: Region, fast_math: bool = False) -> dict:
    """``{"generated_tiled": (candidate, call)}``: a pointwise kernel that transposes (its stores walk
    one loop, its largest input another) through shared memory tiles (``kernels/transpose.py``),
    measured against the default mapping; ``{}`` where the kernel is not such a transpose."""
    ks = generate_tiled(region.kernel, fast_math)
    if ks is None:
        return {}
    alt = GeneratedRegion(region, fast_math, sources={1: ks})
    alt.label = "tiled"
    return {"generated_tiled": (alt, alt)}


def _aligned_by_metadata(ks, region: Region) -> bool:
    """Whether the vector variant's tensors start 16-byte aligned as far as their metadata tells:
    outputs are fresh allocations, inputs views at an offset of whole vectors. (A tensor that is
    not aligned at run time after all runs the reference.)"""
    for kind, i, nbytes in ks.meta.get("aligned", ()):
        if kind != "in":
            continue
        t = meta(region.inputs[i])
        if t is None or (t.storage_offset() * t.element_size()) % nbytes:
            return False
    return True


def buffer_fits(t: torch.Tensor, shape: tuple, strides: tuple, dtype: torch.dtype) -> bool:
    """``t`` has the shape, dtype and (for dims of size > 1) strides a generated kernel expects."""
    if t.dtype != dtype or tuple(t.shape) != shape:
        return False
    return all(n == 1 or s == e for n, s, e in zip(shape, t.stride(), strides))


def launch_fused(ks: KernelSource, inputs, outputs, kernel=None, tickets: Optional[dict] = None) -> None:
    """Launch a kernel generated from the loop-level IR (``generate_kernel``): its inputs and
    outputs in the order of the kernel's buffers; sizes are compiled in but for the extents in
    ``meta["extents"]``, passed after them. A column reduction split over blocks gets float
    scratch for its partials (uninitialized) and zeroed ticket counters: from ``tickets`` (the
    launching region's own, kept per kernel and device) where given, else fresh ones."""
    k = ks.meta["kernel"]
    if len(inputs) != len(k.inputs) or len(outputs) != len(k.outputs):
        raise ValueError(f"{ks.name}: {len(inputs)} inputs / {len(outputs)} outputs, "
                         f"expected {len(k.inputs)} / {len(k.outputs)}")
    for t, b in zip(list(inputs) + list(outputs), k.inputs + k.outputs):
        if not buffer_fits(t, b.shape, b.strides, b.dtype):
            raise ValueError(f"{ks.name}: {b.name} is {tuple(t.shape)} {t.stride()} {t.dtype}, the kernel was "
                             f"generated for {b.shape} {b.strides} {b.dtype}")
    if not vector_aligned(ks, inputs, outputs):
        raise ValueError(f"{ks.name}: a vector-accessed tensor is not aligned")
    if any(b.numel == 0 for b in k.outputs) or ks.meta.get("work", 1) == 0:
        return
    args = list(inputs) + list(outputs)
    if "scratch" in ks.meta:  # a column reduction split over blocks: partials and zeroed tickets
        partials, count = ks.meta["scratch"]
        device = (list(inputs) + list(outputs))[0].device
        args += [torch.empty(partials, dtype=torch.float32, device=device),
                 split_tickets(tickets, ks.name, count, device)]
    args += ks.meta.get("extents", [])  # the extents the kernel takes as arguments (codegen/ir_kernel.py)
    compiled_kernel(ks, kernel).launch(ks.meta["grid"], ks.block, args)


def split_tickets(cache: Optional[dict], name: str, count: int, device: torch.device) -> torch.Tensor:
    """``count`` zeroed int32 counters for a split column reduction's tiles. The kernel's last block
    of a tile resets its counter, so after each launch they are zero again: ``cache`` (one region's,
    so that no two kernels that may run at once on different streams share them) keeps them from
    one launch to the next (a zero-fill kernel less per call). Counters first made while a CUDA
    graph is being captured are not kept: their zero-fill would run only in that graph's replays."""
    key = (name, device)
    t = None if cache is None else cache.get(key)
    if t is None or t.numel() != count:
        t = torch.zeros(count, dtype=torch.int32, device=device)
        if cache is not None and not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            cache[key] = t
    return t


def vector_aligned(ks: KernelSource, inputs, outputs) -> bool:
    """The tensors a vector variant reads or writes 16 bytes (at most) at a time are aligned."""
    for kind, i, nbytes in ks.meta.get("aligned", ()):
        t = inputs[i] if kind == "in" else outputs[i]
        if t.data_ptr() % nbytes:
            return False
    return True
