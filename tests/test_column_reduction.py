"""Column reductions (``kernels/column_reduction.py``: the reduced index is not the innermost) on
the CPU: the geometry the cost model picks, NVRTC compilation, and every thread of each launch run
by ``fxopt.fuzz.simt`` against the kernel's IR (every output stored once, every element of its row
combined once, barriers, the split's tickets) for reduced and contiguous axes of odd sizes. The
same kernels launched on a GPU: ``test_gpu_column_reduction.py``."""
import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda.ir import Buffer, Ix, Load, Phase, Red, ReductionKernel, Store, Var
from fxopt.backends.cuda.kernels.column_reduction import column_plan
from fxopt.backends.cuda.kernels.pointwise import vector_width
from fxopt.backends.cuda.kernels.region import generate_kernel
from fxopt.backends.cuda.schedule.loops import arrange
from fxopt.fuzz.geometry import check_row_geometry, is_row_kernel
from fxopt.fuzz.backend_api import reduction_sources
from fxopt.fuzz.simt import check_column_geometry, is_column_kernel
from fxopt.testing import check_fusion
from fxopt.testing.strategies import CNNCase

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
REDUCED = (1, 2, 3, 7, 64, 1000)
CONTIGUOUS = (1, 3, 8, 61, 4096)


def dense(shape, order) -> tuple:
    """Strides of a dense tensor whose dims, outermost first, are ``order``."""
    strides, s = [0] * len(shape), 1
    for d in reversed(order):
        strides[d] = s
        s *= shape[d]
    return tuple(strides)


def column_kernel(shape, order, red, dtype=torch.float32, out_order=None, op="sum") -> ReductionKernel:
    """The kernel the scheduler builds for ``x.sum(red)`` / ``x.mean(red)`` (``op``) or a softmax
    over ``red`` (one dim) of x of ``shape`` laid out in ``order``, the output in ``out_order``."""
    vs = [Var(f"i{d}", n) if n > 1 else None for d, n in enumerate(shape)]
    idx = [Ix.of(v) if v else Ix() for v in vs]
    x = Buffer("x", tuple(shape), dense(shape, order), dtype)
    keep = [d for d in range(len(shape)) if d not in red or op == "softmax"]
    oshape = tuple(shape[d] for d in keep)
    out = Buffer("out", oshape, dense(oshape, out_order or range(len(oshape))), dtype)
    off = ir.strided([idx[d] for d in keep], oshape, out.strides)
    load = Load(0, ir.strided(idx, shape, x.strides))
    outer, reduced = [vs[d] for d in keep if vs[d] and d not in red], [vs[d] for d in red if vs[d]]
    if op == "softmax":
        e = ir.op("exp", ir.op("sub", load, Red("max")))
        phases = [Phase("max", "max", load), Phase("sum", "sum", e)]
        k = ReductionKernel("fx_red_softmax_1", outer, reduced, [x], [out], phases,
                            [Store(0, off, ir.op("div", e, Red("sum")))], [])
    else:
        R = math.prod(shape[d] for d in red)
        val = Red("acc") if op == "sum" else ir.op("mul", Red("acc"), ir.Const(1.0 / R))
        st = Store(0, off.substitute({v: Ix() for v in reduced}), val)
        k = ReductionKernel(f"fx_red_{op}_1", outer, reduced, [x], [out], [Phase("acc", "sum", load)], [], [st])
    arrange(k)
    return k


def layout(name: str, R: int, C: int, dtype=torch.float32, n: int = 2, w: int = 20) -> ReductionKernel:
    """``ncr``: [N, R, C] contiguous summed over R; ``cl``: the split-attention sum, [N, R, C, W]
    laid out (N, W, R, C) (a channels_last [N, R*C, H, W] viewed as 5-D, H*W = W) into an NCHW
    [N, C, W] (eager's strides: stores transposed) or, ``cl_nhwc``, a channels_last one; ``mean``:
    the spatial mean of a channels_last [N, C, H, W] with H*W = R; ``softmax``: over R of [N, R, C]."""
    if name == "ncr":
        return column_kernel((n, R, C), (0, 1, 2), (1,), dtype)
    if name in ("cl", "cl_nhwc"):
        return column_kernel((n, R, C, w), (0, 3, 1, 2), (1,), dtype, (0, 2, 1) if name == "cl_nhwc" else None)
    if name == "mean":
        h = next(d for d in range(int(math.isqrt(R)), 0, -1) if R % d == 0)
        return column_kernel((n, C, h, R // h), (0, 2, 3, 1), (2, 3), dtype, op="mean")
    return column_kernel((n, R, C), (0, 1, 2), (1,), dtype, op="softmax")


def sources(k) -> list:
    return [generate_kernel(k, vec) for vec in sorted({vector_width(k), 1}, reverse=True)]


# ---------------------------------------------------------------------------- the cost model's choices
@pytest.mark.parametrize("case, dtype, want", [
    # split attention, [16, 2, 256, 56, 56]: millions of rows, R = 2 -> no split, 16-byte loads
    (("cl", 2, 256, 16, 3136), torch.float16, dict(vec=8, by=1, splits=1, tw=64, block=256)),
    (("cl_nhwc", 2, 256, 16, 3136), torch.float16, dict(vec=8, by=1, splits=1, tw=0, block=256)),
    (("ncr", 2, 256 * 3136, 16), torch.float16, dict(vec=8, by=1, splits=1, tw=0, block=256)),
    # sum over dim 1 of [16, 2, 256, 1, 1]: R too short to split
    (("ncr", 2, 256, 16), torch.float16, dict(vec=8, by=1, splits=1, tw=0)),
    # global mean of a channels_last [16, 2048, 7, 7]: 4096 groups, R = 49 over 4 threads of a block,
    # 16 groups a block so that 256 blocks spread over the SMs
    (("mean", 49, 2048, 16), torch.float16, dict(vec=8, by=4, bx=16, splits=1)),
    # per-channel sum over N*H*W (rows = C = 64): split over 256 blocks, ~49 elements a thread
    (("ncr", 200704, 64, 1), torch.float32, dict(vec=4, by=16, splits=256)),
])
def test_the_geometry_follows_sizes_and_strides(case, dtype, want):
    k = layout(case[0], case[1], case[2], dtype, *case[3:])
    assert k.strategy == "outer"
    ks = generate_kernel(k, vector_width(k))
    assert is_column_kernel(ks) and "_cols" in ks.name
    geo = ks.meta["geometry"]
    assert {key: geo[key] for key in want} == want, geo
    threads = ks.meta["grid"][0] * ks.meta["grid"][1] * ks.block[0]
    assert threads * geo["vec"] >= min(k.rows * max(1, k.row_size // 8), 1 << 16), "the GPU is left idle"
    if geo["splits"] > 1:
        assert ks.meta["scratch"] == (geo["splits"] * k.rows, geo["tiles"])
        assert geo["chunk"] // geo["by"] >= 8


def test_a_reduction_over_the_innermost_axis_keeps_the_row_mapping():
    k = layout("ncr", 64, 1)  # [2, 64, 1]: the reduced axis is the contiguous one
    assert k.strategy == "inner" and column_plan(k) is None
    assert all(is_row_kernel(ks) for ks in sources(k))


# ---------------------------------------------------------------------------- NVRTC
@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_column_geometry_compiles(dtype):
    from fxopt.backends.cuda.compiler import compile_ptx

    cases = [("ncr", 2, 4096), ("mean", 49, 64), ("ncr", 1000, 61), ("cl", 2, 64), ("cl_nhwc", 7, 64),
             ("softmax", 64, 8), ("ncr", 3, 3)]
    seen = set()
    for case in cases:
        for ks in sources(layout(*case, dtype=dtype)):
            geo = ks.meta["geometry"]
            seen.add(("by" if geo["by"] > 1 else "") + ("s" if geo["splits"] > 1 else "") + ("t" if geo["tw"] else ""))
            assert ".entry" in compile_ptx(ks.source, ks.name, "sm_90"), ks.name
    assert {"", "by", "bys", "t"} <= seen, seen


# ---------------------------------------------------------------------------- every thread of the launch
def _check(k) -> list:
    out = []
    for ks in sources(k):
        if is_row_kernel(ks):
            check_row_geometry(ks)
        else:
            assert is_column_kernel(ks), ks.name
            soft = dict(high=8, rtol=1e-5, atol=1e-6) if "softmax" in ks.name else {}  # exp rounds in float32
            out.append(check_column_geometry(ks, **soft)["geometry"])
    return out


@pytest.mark.parametrize("C", CONTIGUOUS)
@pytest.mark.parametrize("R", REDUCED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_output_once_each_element_once(R, C, dtype):
    """[2, R, C] summed over R, and the spatial mean of a channels_last tensor with H*W = R."""
    geos = _check(layout("ncr", R, C, dtype)) + _check(layout("mean", R, C, dtype))
    assert geos or C == 1


@pytest.mark.parametrize("C", CONTIGUOUS)
@pytest.mark.parametrize("R", (1, 2, 3, 7, 64))
def test_split_attention_sums_store_along_the_outputs_own_axis(R, C):
    """The channels_last sum over the radix into eager's NCHW output: tiles staged in shared
    memory and written along W where C and W fill a tile and R is not split; into a channels_last
    output: direct."""
    w = 20 if R * C <= 8192 else 3
    for dtype in (torch.float32, torch.float16):
        for g in _check(layout("cl", R, C, dtype, n=1, w=w)):  # (a split over R keeps the direct stores)
            assert bool(g["tw"]) == (C >= 16 and w >= 16 and g["by"] == g["splits"] == 1), g
        assert not any(g["tw"] for g in _check(layout("cl_nhwc", R, C, dtype, n=1, w=w)))


@pytest.mark.parametrize("R, C", [(2, 3), (7, 61), (64, 8), (1000, 3), (64, 4096)])
def test_softmax_over_a_middle_axis_keeps_its_phases_and_row_outputs(R, C):
    """Two phases (max, then the sum of exponentials, each combined across the block's threads
    before the next) and a row output at every element."""
    geos = _check(layout("softmax", R, C, n=1))
    assert geos and all(g["splits"] == 1 for g in geos)


def test_the_emulator_sees_each_kind_of_mistake():
    k = layout("ncr", 1000, 61)
    ks = next(s for s in sources(k) if s.meta["geometry"]["splits"] > 1)
    geo = ks.meta["geometry"]
    assert (geo["by"], geo["splits"]) == (8, 8)
    src = ks.source
    cases = [("r_ += 8)", "r_ += 16)", "differ from the IR's"),
             ("j_ < 8;", "j_ < 7;", "differ from the IR's"),
             ("__syncthreads();\n    float red", "\n    float red", "without a barrier"),
             ("cnt_[tile_] = 0u;", "", "not reset"),
             ("tk_ == 7u", "tk_ == 0u", "before its writer's ticket"),
             ("__threadfence();", "", "before its partials were fenced"),
             ("(gu_ < n1_ ? gu_ : n1_ - 1)", "(gu_)", "outside its"),
             ("if (ok_ && ty_ == 0) {\n        out0", "if (ty_ == 0) {\n        out0", "stored 7 times")]
    for old, new, what in cases:
        assert old in src, old
        with pytest.raises(AssertionError, match=what):
            check_column_geometry(dataclasses.replace(ks, source=src.replace(old, new, 1)))
    t = next(s for s in sources(layout("cl", 2, 64)) if s.meta["geometry"]["tw"])
    bad = t.source.replace("if (cc_ < 64 && wc_ < 20)", "if (cc_ < 64)")
    with pytest.raises(AssertionError, match="stored 2 times|outside"):
        check_column_geometry(dataclasses.replace(t, source=bad))


class SplitAttn(nn.Module):
    """timm's split attention (radix 2): grouped conv + BN + ReLU, sum over the radix, spatial
    mean, fc + BN + ReLU, fc, softmax over the radix, the weighted sum over the radix."""

    def __init__(self, c=32, radix=2):
        super().__init__()
        self.radix = radix
        self.conv = nn.Conv2d(c, c * radix, 3, padding=1, groups=radix, bias=False)
        self.bn0, self.fc1, self.bn1 = nn.BatchNorm2d(c * radix), nn.Conv2d(c, 16, 1), nn.BatchNorm2d(16)
        self.fc2, self.out = nn.Conv2d(16, c * radix, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        x = F.relu(self.bn0(self.conv(x)))
        B, RC, H, W = x.shape
        x = x.reshape(B, self.radix, RC // self.radix, H, W)
        gap = F.relu(self.bn1(self.fc1(x.sum(dim=1).mean((2, 3), keepdim=True))))
        attn = F.softmax(self.fc2(gap).view(B, 1, self.radix, -1).transpose(1, 2), dim=1).reshape(B, -1, 1, 1)
        return self.out((x * attn.reshape(B, self.radix, RC // self.radix, 1, 1)).sum(dim=1))


def test_split_attention_sums_fuse_their_prologues_and_transpose_their_stores():
    """The model: both sums over the radix are column kernels with the conv's BatchNorm shift,
    the ReLU (and the attention weights) read in their loops, stored along W into NCHW."""
    from fxopt.fuzz.backend_api import reduction_kernels, reduction_sources

    torch.manual_seed(0)
    sums = [(n, k) for n, k in reduction_kernels(SplitAttn().eval(), (torch.randn(2, 32, 6, 6),),
                                                 {"layout": "channels_last"}) if n.startswith("fx_red_sum")]
    assert len(sums) == 2 and any("aten.mul.Tensor" in k.ops for _, k in sums)
    for _, k in sums:
        assert "conv_epilogue_ref" in k.ops and len(k.inputs) >= 2
        for ks in reduction_sources(k):
            assert check_column_geometry(ks, high=8)["geometry"]["tw"] > 0


class _ShiftedInstanceNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.InstanceNorm2d(8)

    def forward(self, x):
        return self.norm(x * 16.0 + 7.0)


def test_a_row_of_equal_values_is_emulated_in_the_irs_precision():
    """CPU fuzz seed 3 (dc1ddf32b9): a column InstanceNorm, a row of equal values (variance 0). The
    kernel's mean, then ``sum * 0.33333334f``, was the value in float32, so its output was 0 (ATen's
    Welford gives 0 too); the emulator, in float64, found the mean 3e-8 off and scaled that by
    ``rsqrt(eps) = 316``: 6.7e-4 here, 2e-4 in the fuzz program, against a tolerance of about
    1.5e-4. The emulator and the IR now both run in float64 (``ir.evaluate(compute=...)``); the IR
    in float32 still gives exactly 0 there."""
    x = torch.randn(1, 8, 1, 3).contiguous(memory_format=torch.channels_last)
    case = CNNCase(_ShiftedInstanceNorm().eval(), (x,), torch.float32, False, [])
    kernels = [ks for sched in check_fusion(case, {}) for region in sched.regions
               if hasattr(region.kernel, "reduced") for ks in reduction_sources(region.kernel, False)
               if is_column_kernel(ks)]
    assert kernels
    for ks in kernels:
        for seed in range(6):  # seeds 0, 2 and 5 draw a row of equal values
            check_column_geometry(ks, seed=seed, high=4, rtol=1e-4, atol=1e-4)
    k = kernels[0].meta["kernel"]
    flat = torch.full((k.inputs[0].span(),), 3.0)
    inp = flat.as_strided(k.inputs[0].shape, k.inputs[0].strides)
    outs = {dt: torch.empty_strided(k.outputs[0].shape, k.outputs[0].strides, dtype=dt)
            for dt in (torch.float32, torch.float64)}
    ir.evaluate(k, [inp], [outs[torch.float32]])
    ir.evaluate(k, [inp], [outs[torch.float64]], compute=torch.float64)
    assert torch.equal(outs[torch.float32], torch.zeros_like(outs[torch.float32]))
    # the mean is now ``sum / 3`` (tests/test_constant_rows.py): exact in float64 as well, where the
    # float32 constant 1/3 used to leave the float64 emulation 6.7e-4 off
    assert torch.equal(outs[torch.float64], torch.zeros_like(outs[torch.float64]))
