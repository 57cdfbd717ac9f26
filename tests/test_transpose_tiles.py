"""Tiled transposes (``kernels/transpose.py``): a pointwise kernel whose stores and largest input walk
different loops gets a shared-memory-tile candidate. On the CPU: which kernels qualify, every thread
of the tiled kernel run by ``fxopt.fuzz.simt`` against the IR (barriers, shared-memory hazards,
bounds, each element stored once), NVRTC compilation, and the candidate offered in a model whose
layout conversion transposes (and not in one that does not)."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import fxopt
from fxopt.backends.cuda import ir
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda.ir import Buffer, Ix, Load, PointwiseKernel, Store, Var
from fxopt.backends.cuda.kernels.transpose import generate_tiled, tiled_plan
from fxopt.fuzz.simt import check_column_geometry


def nhwc_to_nchw(n, c, hw, dtype=torch.float16, epilogue=True, to_nhwc=False) -> PointwiseKernel:
    """out = relu(x + bias[c]) with x channels_last [n, c, hw] and out NCHW (``to_nhwc``: the other way)."""
    x0, x1, x2 = Var("x0", n), Var("x1", c), Var("x2", hw)
    nhwc = Ix.of(x0) * (hw * c) + Ix.of(x2) * c + Ix.of(x1)
    nchw = Ix.of(x0) * (c * hw) + Ix.of(x1) * hw + Ix.of(x2)
    src, dst = (nchw, nhwc) if to_nhwc else (nhwc, nchw)
    loops = [x0, x2, x1] if to_nhwc else [x0, x1, x2]
    strides_in = (c * hw, 1, c) if not to_nhwc else (c * hw, hw, 1)
    strides_out = (c * hw, hw, 1) if not to_nhwc else (c * hw, 1, c)
    ins = [Buffer("x", (n, c, hw), strides_in, dtype), Buffer("b", (c,), (1,), dtype)]
    v = Load(0, src)
    if epilogue:
        v = ir.op("maximum", ir.op("add", v, Load(1, Ix.of(x1))), ir.Const(0.0))
    return PointwiseKernel("fx_pw_clone_1", loops, ins, [Buffer("o", (n, c, hw), strides_out, dtype)],
                           [Store(0, dst, v)])


def test_which_kernels_are_transposes():
    load, a, b = tiled_plan(nhwc_to_nchw(2, 64, 49))
    assert (a.name, b.name, load.buf) == ("x1", "x2", 0)
    load, a, b = tiled_plan(nhwc_to_nchw(2, 64, 49, to_nhwc=True))
    assert (a.name, b.name) == ("x2", "x1")
    assert tiled_plan(nhwc_to_nchw(2, 4, 49)) is None  # 4 channels: a tile would be mostly empty
    x0, x1 = Var("x0", 64), Var("x1", 64)
    same = PointwiseKernel("fx_pw_relu_1", [x0, x1], [Buffer("x", (64, 64), (64, 1), torch.float32)],
                           [Buffer("o", (64, 64), (64, 1), torch.float32)],
                           [Store(0, Ix.of(x0) * 64 + Ix.of(x1), ir.op("relu", Load(0, Ix.of(x0) * 64 + Ix.of(x1))))])
    assert tiled_plan(same) is None and generate_tiled(same) is None  # no transpose


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 40, 99), (1, 8, 8), (3, 33, 65), (1, 128, 49)])
@pytest.mark.parametrize("to_nhwc", [False, True])
def test_every_thread_of_the_tiled_kernel(shape, dtype, to_nhwc):
    ks = generate_tiled(nhwc_to_nchw(*shape, dtype=dtype, to_nhwc=to_nhwc))
    assert ks is not None and "tile32" in ks.name
    check_column_geometry(ks, high=8)


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 3), st.integers(8, 70), st.integers(8, 70), st.booleans(), st.booleans())
def test_random_transposes(n, c, hw, epilogue, to_nhwc):
    check_column_geometry(generate_tiled(nhwc_to_nchw(n, c, hw, torch.float32, epilogue, to_nhwc)), high=8)


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
def test_tiled_kernels_compile():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        generate_tiled(nhwc_to_nchw(2, 40, 99, dtype)).compile()


class ToNCHW(nn.Module):
    """A conv in channels_last whose output is handed back contiguous (a layout conversion)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(16, 48, 3, padding=1)

    def forward(self, x):
        return torch.nn.functional.leaky_relu(self.conv(x), 1e-3).contiguous()


def test_a_model_whose_output_changes_layout_gets_the_tiled_candidate():
    torch.manual_seed(0)
    r = fxopt.explain(ToNCHW().eval(), torch.randn(2, 16, 20, 20), options={"executor": "cuda",
                                                                            "layout": "channels_last"})
    names = [k.name for g in r.graphs for k in g.kernels]
    assert any("_tile32" in n for n in names), names
