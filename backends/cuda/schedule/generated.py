"""Candidates for a region of the fusion scheduler (``fusion.py``) besides its generated kernel
(``kernels/region.py``):

- ``RegionReference``: the region's ATen nodes as PyTorch runs them (``rewrite.reference_module``),
  called with the region's inputs, returning the tuple of its outputs. It is what the region
  computes by definition: every other candidate is checked against it when measured, and runs
  in its place wherever it declines.
- ``EmulatedRegion``: the region's kernel IR run by ``ir.evaluate`` (the generated code's semantics
  on any device): what runs in the reference's place on the CPU under option ``emulate_kernels``.
- ``template_candidates``: the older per-node templates (max pool, global average pool,
  ``kernels/pool.py``) for a region that is exactly that node, as more candidates of the same region.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from fxopt.backends.cuda.kernels.pool import plan_global_avgpool, plan_maxpool
from fxopt.backends.cuda.schedule.fusion import Region
from fxopt.backends.cuda.schedule.rewrite import reference_module


class RegionReference:
    def __init__(self, gm: fx.GraphModule, region: Region):
        self.module = reference_module(gm, region)
        self.__name__ = f"ref_{region.name}"

    def __call__(self, *inputs):
        return tuple(self.module(*inputs))


class EmulatedRegion:
    """The region's kernel IR, evaluated with torch on its inputs' device; returns its outputs. As the
    generated kernel does, it declines inputs that are not laid out as the kernel was planned for
    (``buffer_fits``): ``reference`` runs then. On the CPU its outputs take the dtypes the reference's
    have (the first call runs both): a graph traced on the CPU gives a batch norm of float16 input and
    float32 weights statistics of float16 (the CPU's meta function), the CPU's kernels float32 (as
    CUDA's meta and kernels do), and the CPU's backward refuses float16 statistics with float32
    weights ("mixed dtype (CPU)"; CPU fuzz fcaddfc67e, an affine InstanceNorm trained in float16),
    computed at the reference's dtype where it is the wider float (the statistics of a CPU-traced
    batch or instance norm planned in float16 would be rounded there, a GPU's are float32: CPU fuzz
    d69f088fdc, an InstanceNorm over two values trained in float16, whose saved mean rounded to
    float16 moved a gradient by 0.66), and the reference's strides where theirs differ only in
    dimensions of size 1 (the same memory:
    the CPU's meta function and kernel may disagree there, and a CPU library that reads the stride
    of a size-1 channel dimension as a memory format picks another algorithm, whose float16 rounding
    differs from eager's where a GPU's would not; CPU fuzz 98f2d714a5, a one-channel 1x1 conv's
    weight gradient in float16)."""

    def __init__(self, region: Region, reference):
        self.kernel, self.reference = region.kernel, reference
        self.__name__ = f"emu_{region.name}"
        self._dtypes = None  # the reference's output dtypes (CPU)
        self._strides = None  # and strides (CPU)

    def __call__(self, *inputs):
        import torch

        from fxopt.backends.cuda import ir
        from fxopt.backends.cuda.kernels.region import buffer_fits

        if len(inputs) != len(self.kernel.inputs) or not all(
                isinstance(t, torch.Tensor) and buffer_fits(t, b.shape, b.strides, b.dtype)
                for t, b in zip(inputs, self.kernel.inputs)):
            return self.reference(*inputs)
        device = inputs[0].device if inputs else torch.device("cpu")
        dtypes = [b.dtype for b in self.kernel.outputs]
        if device.type == "cpu":
            if self._dtypes is None:
                ref = self.reference(*inputs)
                self._dtypes = [getattr(t, "dtype", None) for t in ref]
                self._strides = [t.stride() if isinstance(t, torch.Tensor) else None for t in ref]
            # stored at the reference's dtype where it is the wider float (the GPU's plan)
            dtypes = [d if _wider_float(d, p) else p for d, p in zip(self._dtypes, dtypes)]
        outs = [torch.empty_strided(b.shape, b.strides, dtype=d, device=device)
                for b, d in zip(self.kernel.outputs, dtypes)]
        ir.evaluate(self.kernel, list(inputs), outs)
        if device.type == "cpu":
            outs = [o.to(d) if d is not None and d != o.dtype else o for o, d in zip(outs, self._dtypes)]
            outs = [_strides_of_size_one_as(o, st) for o, st in zip(outs, self._strides)]
        return tuple(outs)


def _wider_float(a, b) -> bool:
    """Dtype ``a`` a floating type wider than floating type ``b``."""
    return (a is not None and a.is_floating_point and b.is_floating_point
            and a.itemsize > b.itemsize)


def _strides_of_size_one_as(t, stride):
    """``t`` with ``stride`` where the two differ only in dimensions of size 1 (a copy: an output is
    no view of another tensor, as the kernel's is not), else ``t``."""
    import torch

    if stride is None or t.stride() == tuple(stride) or len(stride) != t.dim():
        return t
    if any(n != 1 and a != b for n, a, b in zip(t.shape, t.stride(), stride)):
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


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
