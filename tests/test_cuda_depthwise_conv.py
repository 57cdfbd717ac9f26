"""Row-tiled depthwise convolution kernels (backends/cuda/codegen/depthwise_conv.py, schedule/conv.py
``plan_depthwise_rows``): which convs get them, that the columns a tile loads feed the right pixels
(a pure-Python run of the tiling against PyTorch, CPU), that every variant compiles with NVRTC (CPU),
and that they compute what PyTorch computes (GPU: hypothesis over shapes, strides, dilations, dtypes,
tiles and epilogues; a compiled model measuring them)."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fxopt
import fxopt.testing
from fxopt.backends import torch_ref
from fxopt.backends.cuda.codegen.epilogue import template_epilogue
from fxopt.backends.cuda.kernels.depthwise_conv import (channel_block, column_taps,
                                                        generate_depthwise_conv2d_nhwc_rows)
from fxopt.backends.cuda.compiler import compile_many, nvrtc_available
from fxopt.backends.cuda.kernels.depthwise_conv import DepthwiseConvRows, plan_depthwise_rows
from fxopt.ops import fused_conv_ref
from fxopt.tolerances import relative_error

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Block(nn.Module):
    """A ConvNeXt-like depthwise 7x7 with a bias, then a stride-2 depthwise 3x3 after a ReLU."""

    def __init__(self, c=32):
        super().__init__()
        self.dw7 = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.dw3 = nn.Conv2d(c, c, 3, stride=2, padding=1, groups=c, bias=False)

    def forward(self, x):
        return self.dw3(torch.relu(self.dw7(x)))


def lowered(model, x, options=None):
    r = fxopt.explain(model, x, options=dict({"executor": "torch"}, **(options or {})))
    return torch_ref.lower(r.graphs[0].after)


def convs(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fused_conv_ref]


# ---------------------------------------------------------------------------- tiling (CPU)
def _tiled_conv(x, w, stride, padding, dilation, tw):
    """The kernel's loop nest in Python: per tile of ``tw`` pixels of an output row and per kernel
    row, each column of ``column_taps`` read once (skipped outside the image) and added into the
    pixels it feeds."""
    n, c, h, wd = x.shape
    kh_, kw_ = w.shape[2:]
    oh = (h + 2 * padding - dilation * (kh_ - 1) - 1) // stride + 1
    ow = (wd + 2 * padding - dilation * (kw_ - 1) - 1) // stride + 1
    y = torch.zeros(n, c, oh, ow, dtype=x.dtype)
    taps = column_taps(tw, kw_, stride, dilation)
    for r in range(oh):
        for ow0 in range(0, ow, tw):
            acc = torch.zeros(n, c, tw, dtype=x.dtype)
            iw0 = ow0 * stride - padding
            for kh in range(kh_):
                ih = r * stride - padding + kh * dilation
                if not 0 <= ih < h:
                    continue
                for col, uses in taps:
                    if not 0 <= iw0 + col < wd:
                        continue
                    for u, t in uses:
                        acc[:, :, u] += x[:, :, ih, iw0 + col] * w[:, 0, kh, t]
            last = min(tw, ow - ow0)
            y[:, :, r, ow0:ow0 + last] = acc[:, :, :last]
    return y


def test_column_taps_give_every_pixel_each_tap_once():
    for tw, kw, sw, dw in ((4, 7, 1, 1), (8, 3, 2, 1), (4, 5, 1, 2), (3, 3, 2, 2), (1, 1, 1, 1)):
        taps = column_taps(tw, kw, sw, dw)
        pairs = [(u, t) for _, uses in taps for u, t in uses]
        assert sorted(pairs) == [(u, t) for u in range(tw) for t in range(kw)]
        assert all(col == u * sw + t * dw for col, uses in taps for u, t in uses)
        assert [col for col, _ in taps] == sorted({u * sw + t * dw for u in range(tw) for t in range(kw)})
    assert len(column_taps(4, 7, 1, 1)) == 10  # 4 + 7 - 1 loads, not 28


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 7), stride=st.integers(1, 2), dilation=st.integers(1, 2), pad=st.integers(0, 3),
       h=st.integers(1, 12), w=st.integers(1, 13), tw=st.integers(1, 8))
def test_the_tiled_loop_nest_computes_the_convolution(k, stride, dilation, pad, h, w, tw):
    x, wt = torch.randn(2, 3, h, w, dtype=torch.float64), torch.randn(3, 1, k, k, dtype=torch.float64)
    if h + 2 * pad < dilation * (k - 1) + 1 or w + 2 * pad < dilation * (k - 1) + 1:
        return
    want = F.conv2d(x, wt, None, stride, pad, dilation, 3)
    torch.testing.assert_close(_tiled_conv(x, wt, stride, pad, dilation, tw), want)


# ---------------------------------------------------------------------------- planning (CPU)
def test_variants_only_where_the_one_pixel_kernel_has_threads_to_spare():
    cl = {"layout": "channels_last"}
    gm = lowered(Block().eval().half(), torch.randn(64, 32, 32, 32).half(), cl)  # 64x32x32 px x 4 vectors
    dw7, dw3 = convs(gm)
    plans = plan_depthwise_rows(dw7)
    assert [(p.sources[0].meta["vec"], p.sources[0].meta["tw"]) for p in plans] == [(4, 4), (4, 8), (2, 8)]
    assert all(isinstance(p, DepthwiseConvRows) for p in plans) and len({p.label for p in plans}) == 3
    assert plans[0].epilogue == template_epilogue(True, False, ("relu", ())) and [p.align for p in plans] == [8, 8, 4]
    assert plan_depthwise_rows(dw3) == []  # 64 x 16 x 16 pixels x 4 vectors: 65536 threads, not enough
    gm = lowered(Block().eval().half(), torch.randn(1, 32, 32, 32).half(), cl)
    assert all(plan_depthwise_rows(n) == [] for n in convs(gm))  # batch 1: the one-pixel kernel's parallelism
    gm = lowered(Block().eval().half(), torch.randn(64, 32, 32, 32).half(), {"layout": "contiguous"})
    assert all(plan_depthwise_rows(n) == [] for n in convs(gm))  # channels-first: not these kernels
    gm = lowered(Block(36).eval().half(), torch.randn(64, 36, 32, 32).half(), cl)
    assert all(plan_depthwise_rows(n) == [] for n in convs(gm))  # 36 channels: not whole 16-byte vectors


def test_channel_blocks_and_argument_checks():
    assert channel_block(96, 4) == 96 and channel_block(192, 4) == 96 and channel_block(768, 8) == 128
    assert channel_block(24, 8) == 24 and channel_block(136, 8) == 8  # 17 vectors: no larger divisor
    with pytest.raises(ValueError, match="channels per thread"):
        generate_depthwise_conv2d_nhwc_rows(1, 12, 8, 8, 8, 8, 3, 1, 1, 1, torch.float16, vec=8)
    with pytest.raises(ValueError, match="channels per thread"):
        generate_depthwise_conv2d_nhwc_rows(1, 16, 8, 8, 8, 8, 3, 1, 1, 1, torch.float16, vec=1)  # 2-byte loads
    with pytest.raises(ValueError, match="pixels per thread"):
        generate_depthwise_conv2d_nhwc_rows(1, 16, 8, 8, 8, 8, 3, 1, 1, 1, torch.float16, vec=4, tw=0)


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_variant_compiles_with_nvrtc(dtype):
    full = 16 // dtype.itemsize
    cases = [  # (n, c, hw, k, stride, padding, dilation, epilogue, vec, tw)
        (32, 96, 56, 7, 1, 3, 1, template_epilogue(True, False, None), full // 2, 4),
        (32, 768, 7, 7, 1, 3, 1, template_epilogue(True, True, "relu"), full, 4),
        (8, 144, 28, 3, 2, 1, 1, template_epilogue(True, False, ("hardtanh", (0.0, 6.0))), full // 2, 8),
        (4, 64, 15, 5, 1, 4, 2, template_epilogue(False, True, "silu"), full, 8),
    ]
    sources = []
    for n, c, hw, k, s, p, d, epi, vec, tw in cases:
        o = (hw + 2 * p - d * (k - 1) - 1) // s + 1
        sources.append(generate_depthwise_conv2d_nhwc_rows(n, c, hw, hw, o, o, k, s, p, d, dtype, epi, vec, tw))
    for ks, kernel in zip(sources, compile_many(sources)):
        assert kernel.compiled, ks.name
        assert ks.block[0] % (channel_block(ks.meta["shape"][1], ks.meta["vec"]) // ks.meta["vec"]) == 0


# ---------------------------------------------------------------------------- against PyTorch (GPU)
def _reference(x, w, b, res, stride, padding, dilation, act):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, padding, dilation, x.shape[1])
    if res is not None:
        y = y + res.double()
    return {None: y, "relu": torch.relu(y), "silu": F.silu(y)}[act] if not isinstance(act, tuple) else y.clamp(0, 6)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), cvec=st.integers(1, 6), k=st.integers(1, 7), stride=st.integers(1, 2),
       padding=st.integers(0, 3), dilation=st.integers(1, 2), h=st.integers(3, 17), w=st.integers(3, 19),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), split=st.sampled_from([1, 2, 4]),
       tw=st.sampled_from([1, 2, 4, 8]), bias=st.booleans(), residual=st.booleans(),
       act=st.sampled_from([None, "relu", ("hardtanh", (0.0, 6.0)), "silu"]))
def test_kernels_match_pytorch_on_gpu(n, cvec, k, stride, padding, dilation, h, w, dtype, split, tw, bias, residual,
                                      act):
    vec = 16 // dtype.itemsize // split  # 16-, 8- and 4-byte channel vectors
    c = cvec * 16 // dtype.itemsize
    oh = (h + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    ow = (w + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    if oh < 1 or ow < 1:
        return
    cl = torch.channels_last
    x = torch.randn(n, c, h, w, device="cuda", dtype=dtype).contiguous(memory_format=cl)
    wt = (torch.randn(c, 1, k, k, device="cuda", dtype=dtype) / k).to(dtype)
    b = torch.randn(c, device="cuda", dtype=dtype) if bias else None
    res = torch.randn(n, c, oh, ow, device="cuda", dtype=dtype).contiguous(memory_format=cl) if residual else None
    ks = generate_depthwise_conv2d_nhwc_rows(n, c, h, w, oh, ow, k, stride, padding, dilation, dtype,
                                             template_epilogue(bias, residual, act), vec, tw)
    out = torch.full((n, c, oh, ow), float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=cl)
    ks.compile().launch(ks.meta["grid"], ks.block, [x, wt] + [t for t in (b, res) if t is not None] + [out])
    want = _reference(x, wt, b, res, stride, padding, dilation, act)
    assert relative_error(out.double(), want) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_model_matches_eager_and_measures_the_row_kernels(dtype, tmp_path):
    m = Block().eval().cuda().to(dtype)
    graphs = []
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json"), "layout": "channels_last"},
                                         graphs)
    x = torch.randn(64, 32, 32, 32, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double())
        assert relative_error(c(x).double(), want) <= (2e-3 if dtype == torch.float32 else 1e-2)
    measured = [v for v in graphs[0].executor_details["node_choices"].values()
                if any(name.startswith("generated_depthwiseconv_rows") for name in {**v.get("ms", {}), **v.get("pruned", {})})]
    # the 7x7 conv's three variants; in float32 (4 channels a vector) the strided 3x3 conv has the threads too
    assert len(measured) == (2 if dtype == torch.float32 else 1), graphs[0].executor_details["node_choices"]
    assert all(sum(name.startswith("generated_depthwiseconv_rows") for name in {**v["ms"], **v.get("pruned", {})}) == 3
               for v in measured)
