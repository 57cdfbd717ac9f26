"""Grouped convolution kernels (backends/cuda/codegen/grouped_conv.py, schedule/conv.py
``plan_grouped_conv``): which convs they take and decline, that every variant compiles with NVRTC
(CPU), and that they compute what PyTorch computes (GPU: hypothesis over shapes, dtypes, weight
layouts and epilogues; a compiled model measuring them)."""
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
from fxopt.backends.cuda.kernels.grouped_conv import (SMEM_FLOATS, channel_tile, generate_grouped_conv2d_nhwc,
                                                      input_vector)
from fxopt.backends.cuda.compiler import compile_many, nvrtc_available
from fxopt.backends.cuda.kernels.grouped_conv import plan_grouped_conv
from fxopt.ops import fused_conv_ref
from fxopt.tolerances import relative_error

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Grouped(nn.Module):
    """conv (groups) -> BN -> ReLU, then a strided grouped conv with a bias, a dense 1x1 conv and a
    depthwise conv: only the first two are grouped convs the kernel takes."""

    def __init__(self, c=48, groups=2):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.b = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, groups=2 * groups)
        self.dense = nn.Conv2d(2 * c, c, 1)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)

    def forward(self, x):
        y = self.b(torch.relu(self.bn(self.a(x))))
        return self.dw(self.dense(y))


def lowered(model, x, options=None):
    r = fxopt.explain(model, x, options=dict({"executor": "torch"}, **(options or {})))
    return torch_ref.lower(r.graphs[0].after)


def convs(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fused_conv_ref]


# ---------------------------------------------------------------------------- planning (CPU)
def test_plans_the_grouped_convs_of_a_channels_last_graph_and_declines_the_others():
    gm = lowered(Grouped().eval(), torch.randn(2, 48, 16, 16), {"layout": "channels_last"})
    plans = {n.args[7]: plan_grouped_conv(n) for n in convs(gm)}
    assert set(plans) == {2, 4, 1, 48}
    assert plans[1] == [] and plans[48] == []  # dense, depthwise
    first, second = plans[2], plans[4]
    # 24 -> 24 channels per group: 8 and 4 channels per thread; 12 -> 24: the same
    assert [c.sources[0].meta["cot"] for c in first] == [8, 4]
    assert [c.sources[0].meta["cot"] for c in second] == [8, 4]
    assert len({c.label for c in first}) == 2 and all(c.label.startswith("groupedconv_t") for c in first)
    assert first[0].spec["epilogue"] == template_epilogue(True, False, ("relu", ()))  # the folded BN's bias, the ReLU
    assert second[0].spec["epilogue"] == template_epilogue(True, False, None)
    assert second[0].sources[0].meta["stride"] == (2, 2) and second[0].sources[0].meta["groups"] == 4


def test_declines_channels_first_graphs_and_forced_algorithms():
    gm = lowered(Grouped().eval(), torch.randn(2, 48, 16, 16), {"layout": "contiguous"})
    assert all(plan_grouped_conv(n) == [] for n in convs(gm))  # channels-first: the kernel is channels_last only
    gm = lowered(Grouped().eval(), torch.randn(2, 48, 16, 16), {"layout": "channels_last", "conv_algorithm": "gemm"})
    grouped = [n for n in convs(gm) if n.args[7] in (2, 4)]
    assert [n.args[10] for n in grouped] == ["gemm", "gemm"]
    assert all(plan_grouped_conv(n) == [] for n in grouped)  # the user asked for gemm: nothing competes
    for n in grouped:  # the same choice made by measuring: the generated kernels are candidates
        n.meta["fxopt_conv_algorithm_how"] = "measured"
    assert all(len(plan_grouped_conv(n)) == 2 for n in grouped)


def test_two_pixels_per_thread_only_where_the_grid_has_threads_to_spare():
    gm = lowered(Grouped().eval(), torch.randn(64, 48, 32, 32), {"layout": "channels_last"})
    first = next(n for n in convs(gm) if n.args[7] == 2)  # 64 x 32 x 32 pixels x 48 / 8 channels: 393216 threads
    assert [(c.sources[0].meta["cot"], c.sources[0].meta["ppt"]) for c in plan_grouped_conv(first)] == [
        (8, 1), (4, 1), (8, 2)]
    assert plan_grouped_conv(first)[2].label == "groupedconv_t8p2"
    gm = lowered(Grouped().eval(), torch.randn(1, 48, 32, 32), {"layout": "channels_last"})
    first = next(n for n in convs(gm) if n.args[7] == 2)
    assert all(c.sources[0].meta["ppt"] == 1 for c in plan_grouped_conv(first))


def test_channels_per_thread_follow_the_group_width():
    gm = lowered(nn.Sequential(nn.Conv2d(12, 18, 3, groups=3)).eval(), torch.randn(1, 12, 9, 9),
                 {"layout": "channels_last"})
    (node,) = convs(gm)
    cands = plan_grouped_conv(node)  # 6 output channels per group: 2 per thread, and 1
    assert [c.sources[0].meta["cot"] for c in cands] == [2, 1]
    assert cands[0].sources[0].meta["vec"] == input_vector(4, torch.float32) == 4


def test_tile_vector_and_argument_checks():
    assert channel_tile(24, 216, 8) == 24
    assert channel_tile(64, 288, 8) == 32  # 64 x 288 floats exceed shared memory: half the group per block
    assert channel_tile(8, SMEM_FLOATS, 8) == 0
    assert input_vector(24, torch.float16) == 8 and input_vector(12, torch.float16) == 4
    assert input_vector(6, torch.float32) == 2 and input_vector(3, torch.bfloat16) == 1
    with pytest.raises(ValueError, match="groups"):
        generate_grouped_conv2d_nhwc(1, 8, 8, 1, 4, 4, 4, 4, 3, padding=1)
    with pytest.raises(ValueError, match="power of two"):
        generate_grouped_conv2d_nhwc(1, 48, 48, 2, 4, 4, 4, 4, 3, padding=1, cot=3)
    with pytest.raises(ValueError, match="pixels per thread"):
        generate_grouped_conv2d_nhwc(1, 48, 48, 2, 4, 4, 4, 4, 3, padding=1, ppt=3)
    with pytest.raises(ValueError, match="weight_layout"):
        generate_grouped_conv2d_nhwc(1, 48, 48, 2, 4, 4, 4, 4, 3, padding=1, weight_layout="hwio")


def test_launch_checks_the_epilogue_operands_and_passes_them_in_order():
    from types import SimpleNamespace

    from fxopt.backends.cuda.kernels.conv import launch_nhwc

    calls = []
    cand = SimpleNamespace(sources={0: SimpleNamespace(meta={"grid": (3, 2, 1)}, block=(96, 1, 1))},
                           kernel=SimpleNamespace(launch=lambda grid, block, args: calls.append((grid, block, args))))
    cl = torch.channels_last
    x = torch.randn(2, 8, 5, 5, dtype=torch.float16).contiguous(memory_format=cl)
    w, b = torch.randn(8, 4, 3, 3, dtype=torch.float16), torch.randn(8, dtype=torch.float16)
    res = torch.randn(2, 8, 5, 5, dtype=torch.float16).contiguous(memory_format=cl)
    epi = template_epilogue(True, True, "relu")
    out = launch_nhwc(cand, epi, (2, 8, 5, 5), x, w, b, res)
    (grid, block, args), = calls
    assert grid == (3, 2, 1) and block == (96, 1, 1)
    assert args[:4] == [x, w, b, res] and args[4] is out and out.is_contiguous(memory_format=cl)
    assert out.shape == (2, 8, 5, 5) and out.dtype == torch.float16
    # operands that do not match what was compiled: declined (the reference runs), nothing launched
    assert launch_nhwc(cand, epi, (2, 8, 5, 5), x, w, None, res) is None
    assert launch_nhwc(cand, epi, (2, 8, 5, 5), x, w, b.float(), res) is None
    assert launch_nhwc(cand, epi, (2, 8, 5, 5), x, w, b, res.contiguous()) is None
    assert launch_nhwc(cand, epi, (2, 8, 4, 5), x, w, b, res) is None
    assert launch_nhwc(cand, template_epilogue(True, False, None), (2, 8, 5, 5), x, w, b, res) is None
    assert len(calls) == 1
    assert launch_nhwc(cand, epi, (0, 8, 5, 5), x[:0], w, b, res[:0]).shape == (0, 8, 5, 5)
    assert len(calls) == 1  # an empty output: nothing to launch


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_variant_compiles_with_nvrtc(dtype):
    cases = [  # (n, cin, cout, groups, hw, k, stride, padding, dilation, weight layout, epilogue, cot, ppt)
        (1, 336, 336, 14, 14, 3, 1, 1, 1, "ohwi", template_epilogue(True, False, "relu"), 8, 1),
        (32, 48, 48, 2, 56, 3, 2, 1, 1, "oihw", template_epilogue(True, True, ("hardtanh", (0.0, 6.0))), 4, 2),
        (2, 12, 18, 3, 9, 5, 1, 4, 2, "oihw", template_epilogue(False, False, None), 2, 2),
        (2, 1024, 1024, 32, 7, 3, 1, 1, 1, "ohwi", template_epilogue(True, True, "silu"), 8, 2),
        (1, 6, 6, 3, 5, 1, 1, 0, 1, "ohwi", template_epilogue(True, False, None), 1, 1),
    ]
    sources = []
    for n, cin, cout, groups, hw, k, s, p, d, wl, epi, cot, ppt in cases:
        o = (hw + 2 * p - d * (k - 1) - 1) // s + 1
        sources.append(generate_grouped_conv2d_nhwc(n, cin, cout, groups, hw, hw, o, o, k, s, p, d, dtype, epi, wl,
                                                    cot, ppt))
    for ks, kernel in zip(sources, compile_many(sources)):
        assert kernel.compiled, ks.name
        assert ks.block[0] % (ks.meta["cout_tile"] // ks.meta["cot"]) == 0


@needs_nvrtc
def test_the_cuda_executor_lists_the_grouped_kernels_on_cpu():
    r = fxopt.explain(Grouped().eval(), torch.randn(2, 48, 16, 16),
                      options={"executor": "cuda", "layout": "channels_last"})
    names = [k.name for k in r.kernels if k.name.startswith("fx_gconv")]
    assert len(names) == 4, [k.name for k in r.kernels]  # two convs, two variants each
    assert all(k.compiled for k in r.kernels if k.name.startswith("fx_gconv"))


# ---------------------------------------------------------------------------- against PyTorch (GPU)
def _reference(x, w, b, res, stride, padding, dilation, groups, act):
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, padding, dilation, groups)
    if res is not None:
        y = y + res.double()
    return {None: y, "relu": torch.relu(y), "silu": F.silu(y)}[act] if not isinstance(act, tuple) else y.clamp(0, 6)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), groups=st.integers(2, 6), cgi=st.sampled_from([2, 3, 4, 6, 8, 12, 16, 24, 32]),
       cgo_mult=st.sampled_from([1, 2]), k=st.integers(1, 5), stride=st.integers(1, 2), padding=st.integers(0, 2),
       dilation=st.integers(1, 2), hw=st.integers(5, 17),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), wl=st.sampled_from(["oihw", "ohwi"]),
       bias=st.booleans(), residual=st.booleans(),
       act=st.sampled_from([None, "relu", ("hardtanh", (0.0, 6.0)), "silu"]),
       cot=st.sampled_from([1, 2, 4, 8, 16]), ppt=st.sampled_from([1, 2]))
def test_kernels_match_pytorch_on_gpu(n, groups, cgi, cgo_mult, k, stride, padding, dilation, hw, dtype, wl, bias,
                                      residual, act, cot, ppt):
    cin, cout = groups * cgi, groups * cgi * cgo_mult
    o = (hw + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    cgo = cout // groups
    if o < 1 or cgo % cot or not channel_tile(cgo, cgi * k * k, cot):
        return
    cl = torch.channels_last
    x = torch.randn(n, cin, hw, hw, device="cuda", dtype=dtype).contiguous(memory_format=cl)
    w = (torch.randn(cout, cgi, k, k, device="cuda", dtype=dtype) * (cgi * k * k) ** -0.5).contiguous(
        memory_format=cl if wl == "ohwi" else torch.contiguous_format)
    b = torch.randn(cout, device="cuda", dtype=dtype) if bias else None
    res = torch.randn(n, cout, o, o, device="cuda", dtype=dtype).contiguous(memory_format=cl) if residual else None
    ks = generate_grouped_conv2d_nhwc(n, cin, cout, groups, hw, hw, o, o, k, stride, padding, dilation, dtype,
                                      template_epilogue(bias, residual, act), wl, cot, ppt)
    out = torch.full((n, cout, o, o), float("nan"), device="cuda", dtype=dtype).contiguous(memory_format=cl)
    ks.compile().launch(ks.meta["grid"], ks.block, [x, w] + [t for t in (b, res) if t is not None] + [out])
    want = _reference(x, w, b, res, stride, padding, dilation, groups, act)
    assert relative_error(out.double(), want) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch", [1, 64])
def test_compiled_model_matches_eager_and_measures_the_grouped_kernels(dtype, batch, tmp_path):
    m = Grouped().eval().cuda().to(dtype)
    graphs = []
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json"), "layout": "channels_last"},
                                         graphs)
    x = torch.randn(batch, 48, 28, 28, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double())
        assert relative_error(c(x).double(), want) <= (2e-3 if dtype == torch.float32 else 1e-2)
    measured = [v for v in graphs[0].executor_details["node_choices"].values()
                if any(name.startswith("generated_groupedconv_t") for name in {**v.get("ms", {}), **v.get("pruned", {})})]
    assert len(measured) == 2, graphs[0].executor_details["node_choices"]
    if batch == 64:  # 64 x 28 x 28 pixels x 6 threads each: the first conv's two-pixel variant is measured too
        assert any("generated_groupedconv_t8p2" in {**v["ms"], **v.get("pruned", {})} for v in measured), measured
