"""Candidates for a region of the fusion scheduler (``fusion.py``): its generated kernel and
its reference.

- ``RegionReference``: the region's ATen nodes as PyTorch runs them (``fusion.reference_module``),
  called with the region's inputs, returning the tuple of its outputs. It is what the region
  computes by definition: every other candidate is checked against it when measured, and runs
  in its place wherever it declines.
- ``GeneratedRegion``: the region's IR kernel through ``codegen/kernel.py`` (a vectorized variant
  where the innermost loop allows, and a scalar one for tensors that are not aligned for it;
  option ``fast_math``: approximate exp and division in kernels with 16-bit results);
  ``__call__`` returns ``None`` (the reference runs) when the tensors it gets are not on the GPU
  or differ in shape, dtype or strides from those the kernel was generated for.
- ``template_candidates``: the older per-node templates (max pool, global average pool) for a
  region that is exactly that node, as more candidates of the same region.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.kernel import generate_kernel, vector_width
from fxopt.backends.cuda.runtime.launch import buffer_fits, launch_fused, vector_aligned
from fxopt.backends.cuda.schedule.fusion import Region, reference_module
from fxopt.backends.cuda.schedule.pool import plan_global_avgpool, plan_maxpool


class RegionReference:
    def __init__(self, gm: fx.GraphModule, region: Region):
        self.module = reference_module(gm, region)
        self.__name__ = f"ref_{region.name}"

    def __call__(self, *inputs):
        return tuple(self.module(*inputs))


class GeneratedRegion:
    def __init__(self, region: Region, fast_math: bool = False):
        self.region, self.name, self.label = region, region.name, "fused"
        k = region.kernel
        vec = vector_width(k)
        self.sources = {vec: generate_kernel(k, vec, fast_math)}
        if vec > 1 and not _aligned_by_metadata(self.sources[vec], region):
            self.sources[1] = generate_kernel(k, 1, fast_math)  # for the tensors that will not be aligned
        self.kernels: dict = {}

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
                launch_fused(ks, inputs, outs, kernel=self.kernels[variant])
                return tuple(outs)
        return None


def _aligned_by_metadata(ks, region: Region) -> bool:
    """Whether the vector variant's tensors start 16-byte aligned as far as their metadata tells:
    outputs are fresh allocations, inputs views at an offset of whole vectors. (A tensor that is
    not aligned at run time after all runs the reference.)"""
    from fxopt.backends.cuda.schedule.lowering import meta

    for kind, i, nbytes in ks.meta.get("aligned", ()):
        if kind != "in":
            continue
        t = meta(region.inputs[i])
        if t is None or (t.storage_offset() * t.element_size()) % nbytes:
            return False
    return True


def _as_tuple(fn, *const_args, pick=None):
    def run(*inputs):
        out = fn(inputs[0], *const_args)
        if out is None:
            return None
        return (out[pick] if pick is not None else out,)
    return run


def template_candidates(region: Region) -> dict:
    """name -> (candidate object with sources/kernels, callable over the region's inputs)."""
    if len(region.outputs) != 1 or len(region.inputs) != 1:
        return {}
    out = region.outputs[0]
    ops = [n for n in region.covered if n.op == "call_function"]
    pool = out.args[0] if out.target is operator.getitem else None
    if pool is not None and isinstance(pool, fx.Node) and ops == [out]:
        cand = plan_maxpool(pool)
        if cand is not None:
            a = list(pool.args[1:]) + [None] * (5 - len(pool.args[1:]))
            return {"template_maxpool": (cand, _as_tuple(cand, a[0], a[1] or a[0], a[2] or 0, a[3] or 1,
                                                         bool(a[4]), pick=0))}
    if ops == [out]:
        cand = plan_global_avgpool(out)
        if cand is not None:
            dims = out.args[1] if len(out.args) > 1 else out.kwargs.get("dim")
            keep = out.args[2] if len(out.args) > 2 else out.kwargs.get("keepdim", False)
            return {"template_gap": (cand, _as_tuple(cand, dims, keep))}
    return {}
