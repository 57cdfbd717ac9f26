"""Reflection and replication padding read in place (``movement_rules._edge_pad``), on the CPU: the
padding is inside a generated region (no PyTorch padding kernel, no padded copy), every region's
IR against its ATen ops (values, shapes and strides), the kernels compile with NVRTC, and a
hypothesis property over pad widths, sizes, modes and layouts."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fxopt
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.testing import check_fusion
from fxopt.testing.strategies import CNNCase

CL = {"layout": "channels_last"}


class BlurDown(nn.Module):
    """A conv, a reflection (or replication) pad and a fixed-filter depthwise stride-2 conv: the
    anti-aliased downsampling of TResNet / ResNet-AA; then a 1x1 conv."""

    def __init__(self, c=8, pad=(1, 1, 1, 1), mode="reflect"):
        super().__init__()
        self.conv, self.pad, self.mode = nn.Conv2d(c, c, 3, padding=1), pad, mode
        a = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("filt", (a[:, None] * a[None, :] / 16).expand(c, 1, 3, 3).contiguous())
        self.proj = nn.Conv2d(c, 4, 1)

    def forward(self, x):
        y = F.pad(F.leaky_relu(self.conv(x), 1e-3), self.pad, mode=self.mode)
        return self.proj(F.conv2d(y, self.filt, stride=2, groups=y.shape[1]))


class Pad1d(nn.Module):
    def __init__(self, pad=(2, 1), mode="reflect"):
        super().__init__()
        self.conv, self.pad, self.mode = nn.Conv1d(3, 5, 3), pad, mode

    def forward(self, x):
        return torch.sigmoid(F.pad(torch.relu(self.conv(x)), self.pad, mode=self.mode)) * 2


def _padding_in_regions(model, x) -> tuple:
    """(ops the cuda executor fused into generated regions, ops it left to PyTorch)."""
    r = fxopt.explain(model.eval(), x, options={"executor": "cuda", **CL})
    fused = [n for g in r.graphs for reg in g.executor_details.get("regions", {}).values() for n in reg["nodes"]]
    left = [n for g in r.graphs for n in g.executor_details.get("unfused", {}) if "pad" in n]
    return fused, left


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@pytest.mark.parametrize("pad", [(1, 1, 1, 1), (2, 0, 1, 3), (0, 1, 0, 1)])
def test_padding_is_read_in_place(mode, pad):
    m, x = BlurDown(pad=pad, mode=mode), torch.randn(2, 8, 7, 6)
    fused, left = _padding_in_regions(m, x)
    name = "reflection_pad2d" if mode == "reflect" else "replication_pad2d"
    assert any(n.startswith(name) for n in fused), fused
    assert not left, left  # no padding op runs as PyTorch's


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mode", ["reflect", "replicate"])
@pytest.mark.parametrize("layout", [{}, CL])
def test_regions_match_aten(dtype, mode, layout):
    torch.manual_seed(0)
    m, x = BlurDown(pad=(2, 1, 1, 2), mode=mode).to(dtype).eval(), torch.randn(2, 8, 6, 7).to(dtype)
    check_fusion(CNNCase(m, (x,), dtype), layout, compile_kernels=nvrtc_available())


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_one_dimensional(mode):
    torch.manual_seed(0)
    m, x = Pad1d(mode=mode).eval(), torch.randn(2, 3, 9)
    check_fusion(CNNCase(m, (x,), torch.float32), {}, compile_kernels=nvrtc_available())


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["reflect", "replicate"]), st.integers(2, 7), st.integers(2, 7),
       st.lists(st.integers(0, 3), min_size=4, max_size=4), st.sampled_from([torch.float32, torch.float16]),
       st.booleans())
def test_random_pads_match_aten(mode, h, w, pad, dtype, channels_last):
    if mode == "reflect":
        pad = [min(p, (w if i < 2 else h) - 1) for i, p in enumerate(pad)]
    torch.manual_seed(h * 31 + w)
    m, x = BlurDown(c=3, pad=tuple(pad), mode=mode).to(dtype).eval(), torch.randn(1, 3, h, w).to(dtype)
    if h + pad[2] + pad[3] < 3 or w + pad[0] + pad[1] < 3:
        return  # the blur's 3x3 window does not fit the padded input: eager refuses as well
    check_fusion(CNNCase(m, (x,), dtype), CL if channels_last else {}, compile_kernels=False)
