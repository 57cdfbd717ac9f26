"""GPU tests of the fusion scheduler's generated kernels (skipped without a CUDA device; run by
scripts/gpu_check.sh, also under compute-sanitizer memcheck). Every region's generated kernel is
launched directly and compared with the region's ATen ops (whatever the executor's measurement
would choose), over hypothesis-drawn blocks, dtypes and both memory formats; whole models compiled
with the cuda executor match eager."""
import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxopt.backends import torch_ref
from fxopt.backends.cuda.schedule.fusion import schedule
from fxopt.backends.cuda.kernels.region import GeneratedRegion
from fxopt.backends.cuda.schedule.generated import RegionReference
from fxopt.testing import block_cases, compile_with_fxopt
from fxopt.testing.fusion import _values, capture
from fxopt.tolerances import relative_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _regions_on_gpu(model, x, options=None, fast_math=False):
    """[(GeneratedRegion, RegionReference, real inputs)] for every region fxopt forms for model(x)."""
    out = []
    for report, example in capture(model, (x,), {"executor": "torch", **(options or {})}):
        gm = torch_ref.lower(report.after)
        if len([n for n in gm.graph.nodes if n.op == "placeholder"]) != len(example):
            continue
        vals = _values(gm, example)
        for region in schedule(gm, strict=True).regions:
            gen = GeneratedRegion(region, fast_math)
            for variant, ks in gen.sources.items():
                gen.kernels[variant] = ks.compile()
            out.append((gen, RegionReference(gm, region), [vals[n] for n in region.inputs]))
    return out


def region_error(got, want, inputs) -> float:
    """max |got - want| over the larger of max |want| and the region's largest input: a region
    whose exact result cancels to about 0 (the mean of a normalized row) rounds at its inputs'
    magnitude, and relative to its own result that rounding is O(1)."""
    if want.numel() == 0:
        return 0.0
    scale = max([want.detach().abs().max().item()]
                + [t.detach().abs().max().item() for t in inputs
                   if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()])
    return (got.detach().double() - want.detach().double()).abs().max().item() / (scale or 1.0)


def _check_region(gen, ref, inputs, dtype):
    want = ref(*inputs)
    got = gen(*inputs)
    assert got is not None, f"{gen.name} declined its own inputs"
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert all(n == 1 or a == b for n, a, b in zip(g.shape, g.stride(), w.stride())), (g.stride(), w.stride())
        err = region_error(g, w, inputs)
        assert err <= TOL[dtype], f"{gen.name} ({gen.ops}): error {err} relative to the region's values"
    # every variant (vector and scalar) on the same inputs
    k = gen.region.kernel
    from fxopt.backends.cuda.kernels.region import launch_fused, vector_aligned

    for variant, ks in gen.sources.items():
        outs = [torch.full(b.shape, float("nan"), dtype=b.dtype, device="cuda").as_strided(b.shape, b.strides)
                if b.span() == b.numel else torch.empty_strided(b.shape, b.strides, dtype=b.dtype, device="cuda")
                for b in k.outputs]
        if not vector_aligned(ks, inputs, outs):
            continue
        launch_fused(ks, inputs, outs, gen.kernels[variant])
        for g, w in zip(outs, want):
            assert region_error(g, w, inputs) <= TOL[dtype], f"{ks.name}: variant {variant}"


@given(block_cases(dtypes=(torch.float32, torch.float16, torch.bfloat16), max_batch=4),
       st.sampled_from([torch.contiguous_format, torch.channels_last]), st.booleans())
def test_property_every_generated_kernel_matches_its_region(case, fmt, fast_math):
    model = copy.deepcopy(case.model).cuda()
    x = case.inputs[0].cuda().contiguous(memory_format=fmt)
    for gen, ref, inputs in _regions_on_gpu(model, x, fast_math=fast_math):
        _check_region(gen, ref, inputs, case.dtype)


class _Activations(torch.nn.Module):
    def forward(self, x):
        return (torch.nn.functional.silu(x), torch.sigmoid(x), torch.nn.functional.hardswish(x),
                torch.nn.functional.hardsigmoid(x), torch.exp(x.clamp(max=8.0)) * torch.sigmoid(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fast_math_activations_match_eager_at_their_limits(dtype):
    """Option fast_math: infinities, NaN, and the values where exp overflows or its quotient
    underflows give eager's results (NaN where eager's is NaN)."""
    special = torch.tensor([float("-inf"), float("inf"), float("nan"), -100.0, -88.0, -17.0, -0.0, 0.0, 17.0,
                            100.0, 3.0, -3.0])
    x = torch.cat([special, torch.randn(4 * 16 * 8 - special.numel()) * 6]).reshape(4, 16, 8, 1).to(dtype).cuda()
    regions = _regions_on_gpu(_Activations(), x, fast_math=True)
    assert regions and all(ks.meta["fast_math"] for gen, _, _ in regions for ks in gen.sources.values())
    for gen, ref, inputs in regions:
        want, got = ref(*inputs), gen(*inputs)
        assert got is not None
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=TOL[dtype], atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("shape", [(1, 8, 1, 1), (3, 5, 7, 9), (2, 64, 56, 56), (1, 384, 14, 14), (64, 32, 8, 8),
                                   (2, 96, 7, 7), (3, 40, 5, 5), (2, 768, 7, 7), (1, 1000, 2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reductions_of_every_geometry(shape, dtype):
    """Rows shorter and longer than a warp and a block, few and many rows, both thread mappings,
    rows kept in registers with and without a partial last chunk."""
    class Norms(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.ln = torch.nn.LayerNorm(c)
            self.gn = torch.nn.GroupNorm(1, c)

        def forward(self, x):
            a = self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            return torch.softmax(a, 1) + self.gn(x) + x.mean((2, 3), keepdim=True) + x.amax(1, keepdim=True)

    model = Norms(shape[1]).cuda().to(dtype).eval()
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(shape, device="cuda", dtype=dtype).contiguous(memory_format=fmt)
        regions = _regions_on_gpu(model, x)
        assert regions
        for gen, ref, inputs in regions:
            _check_region(gen, ref, inputs, dtype)


class _SiluSE(torch.nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(16, c, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.fc1, self.fc2 = torch.nn.Conv2d(c, 8, 1), torch.nn.Conv2d(8, c, 1)
        self.out = torch.nn.Conv2d(c, 16, 1)

    def forward(self, x):
        y = torch.nn.functional.hardswish(self.conv2(torch.nn.functional.silu(self.conv1(x))))
        g = torch.sigmoid(self.fc2(torch.nn.functional.silu(self.fc1(y.mean((2, 3), keepdim=True)))))
        return self.out(y * g) + x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fast_math_model_matches_eager(dtype, monkeypatch):
    """Option fast_math end to end: conv epilogues and fused regions with approximate exp and
    division, against the float64 model (float32: TF32 off, so that the approximations are what
    is measured, held to the float32 tolerance)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    ref_model = _SiluSE().cuda().eval().double()
    model = copy.deepcopy(ref_model).to(dtype)
    x = torch.randn(4, 16, 14, 14, device="cuda", dtype=torch.float64)
    graphs = []
    fast = compile_with_fxopt(model, {"fast_math": True}, graphs)
    with torch.no_grad():
        got, want = fast(x.to(dtype)), ref_model(x)
    bound = TOL[dtype] if dtype == torch.float32 else max(TOL[dtype], 1e-2)  # 16 bits: the whole model
    assert relative_error(got.double(), want) <= bound
    kernels = [k for g in graphs for k in g.kernels]
    assert any(k.source.startswith("#define FXOPT_FAST_MATH 1") for k in kernels), [k.name for k in kernels]


@pytest.mark.parametrize("name", ["convnext_tiny", "densenet121", "shufflenet_v2_x1_0", "efficientnet_v2_s"])
def test_fused_torchvision_models_match_eager(name):
    """fp16 through fxopt against the fp32 model (the benchmark's models: random weights and
    BatchNorm statistics, so activations stay O(1))."""
    pytest.importorskip("torchvision")
    from fxopt.bench.models import build_model

    ref_model, shape = build_model(name)
    ref_model = ref_model.cuda()
    model = copy.deepcopy(ref_model).half()
    x = torch.randn(2, *shape, device="cuda")
    graphs = []
    fast = compile_with_fxopt(model, None, graphs)
    with torch.no_grad():
        got, want = fast(x.half()), ref_model(x)
    assert relative_error(got.float(), want) <= 1e-2
    chosen = [d.get("choice") for g in graphs for d in g.executor_details.get("node_choices", {}).values()]
    assert any(c == "generated" for c in chosen), "no generated region kernel was chosen"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n,c,h,k,stride,dilation,act,residual", [
    (2, 16, 9, 3, 1, 1, "relu", False), (3, 24, 10, 3, 2, 1, "silu", True), (1, 96, 14, 7, 1, 1, "none", False),
    (4, 64, 7, 5, 2, 1, "hardswish", False), (2, 136, 11, 3, 1, 2, "relu6", True)])
def test_vectorized_nhwc_depthwise_matches_the_reference(dtype, n, c, h, k, stride, dilation, act, residual):
    from fxopt.backends.cuda.kernels.depthwise_conv import DepthwiseConvVec
    from fxopt.ops import fused_conv_ref

    acts = {"relu": ("relu", []), "silu": ("silu", []), "none": ("none", []), "hardswish": ("hardswish", []),
            "relu6": ("hardtanh", [0.0, 6.0])}
    activation, params = acts[act]
    pad = (k // 2) * dilation
    x = torch.randn(n, c, h, h, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    w = (torch.randn(c, 1, k, k, device="cuda") / k).to(dtype)
    b = torch.randn(c, device="cuda", dtype=dtype)
    want = fused_conv_ref(x, w, b, None, [stride] * 2, [pad] * 2, [dilation] * 2, c, "none", [], "direct", None)
    res = torch.randn_like(want).contiguous(memory_format=torch.channels_last) if residual else None
    want = fused_conv_ref(x, w, b, res, [stride] * 2, [pad] * 2, [dilation] * 2, c, activation, params, "direct", None)
    g = torch.fx.Graph()
    nodes = [g.placeholder(nm) for nm in ("x", "w", "b", "r")]
    for nd, t in zip(nodes, (x, w, b, res if res is not None else b)):
        nd.meta["val"] = t
    conv = g.call_function(fused_conv_ref, (nodes[0], nodes[1], nodes[2], nodes[3] if residual else None,
                                            [stride] * 2, [pad] * 2, [dilation] * 2, c, activation, params, "direct", None))
    conv.meta["val"] = want
    cand = DepthwiseConvVec(conv, want, (k, k), (stride, stride), (pad, pad), (dilation, dilation))
    cand.kernels[0] = cand.sources[0].compile()
    got = cand(x, w, b, res, [stride] * 2, [pad] * 2, [dilation] * 2, c, activation, params)
    assert got is not None and got.stride() == want.stride()
    assert relative_error(got, want) <= TOL[dtype]


def test_mean_of_a_normalized_row():
    """The property test's failure (HYPOTHESIS_PROFILE=thorough): InstanceNorm2d(2) then a
    squeeze-excite block, input 1x2x3x4, float32: the fused mean over rows of 12 (3 vector chunks
    of 4 over 4 lanes) of a normalized row, whose exact value is about 0. Every variant matches
    the region at the scale of its inputs, and is as close to the float64 mean as ATen's."""
    import torch.nn as nn

    from fxopt.testing.blocks import Block, BlockNet

    gen = torch.Generator().manual_seed(0)
    model = BlockNet([Block("instancenorm", {}, {"inorm": nn.InstanceNorm2d(2, affine=False)}),
                      Block("se", {}, {"fc1": nn.Conv2d(2, 1, 1), "fc2": nn.Conv2d(1, 2, 1)})]).eval()
    for conv in (model.blocks[1].mods["fc1"], model.blocks[1].mods["fc2"]):
        with torch.no_grad():
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen) * conv.weight[0].numel() ** -0.5)
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=gen) * 0.1)
    x = torch.randn((1, 2, 3, 4), generator=gen).cuda()
    regions = _regions_on_gpu(model.cuda(), x)
    means = [r for r in regions if r[0].name == "fx_red_mean"]
    assert means, [r[0].name for r in regions]
    for gen_region, ref, inputs in regions:
        _check_region(gen_region, ref, inputs, torch.float32)
    gen_region, ref, inputs = means[0]
    exact = inputs[0].double().mean((2, 3), keepdim=True)
    scale = inputs[0].abs().max().item()
    got, want = gen_region(*inputs)[0], ref(*inputs)[0]
    assert (got.double() - exact).abs().max().item() <= max(4 * (want.double() - exact).abs().max().item(), 1e-6 * scale)


class _ConvBnAbsLayerNorm(torch.nn.Module):
    """LayerNorm([8, 1, 2]) after conv 3x3, BatchNorm (random running statistics) and abs: the
    fuzzer's program (inference, float32, input 1x8x1x2 of seed 1, Winograd 2x2 convolution)."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(8, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 1.5)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.2, 0.2)
        self.ln = torch.nn.LayerNorm([8, 1, 2], elementwise_affine=False)

    def forward(self, x):
        return self.ln(torch.abs(self.bn(self.conv(x))))


def test_layer_norm_with_a_per_channel_shift_matches_float64():
    """The fused LayerNorm over rows of 16 = 8 x 1 x 2 with the conv's BatchNorm shift (one value
    per channel, added to both positions of a channel) folded in: 8 lanes, each a vector of 2 and
    its channel's shift (``fx_red_native_layer_norm_rows32v2_*``), and the scalar variant. Each,
    launched directly on the region's inputs, against the region computed in float64 (a variance
    with some squared deviations counted twice would be off by far more); then the compiled model
    against the float64 model."""
    from fxopt.backends.cuda.kernels.region import launch_fused, vector_aligned
    from fxopt.backends.cuda.schedule.rewrite import split_conv_epilogues
    from fxopt.fuzz.backend_api import reduction_sources
    from fxopt.testing import compile_with_fxopt

    options = {"conv_algorithm": "winograd_2x2_3x3", "autotune_cache": False}
    torch.manual_seed(0)
    model = _ConvBnAbsLayerNorm().eval()
    x = torch.randn((1, 8, 1, 2), generator=torch.Generator().manual_seed(1))
    exact = copy.deepcopy(model).double()(x.double())
    model, x = model.cuda(), x.cuda()
    checked = []
    for report, example in capture(model, (x,), {"executor": "torch", **options}):
        gm = torch_ref.lower(report.after)
        split_conv_epilogues(gm)  # as the cuda executor: the BatchNorm shift joins the LayerNorm's region
        vals = _values(gm, example)
        for region in schedule(gm, strict=True).regions:
            if region.name != "fx_red_native_layer_norm":
                continue
            inputs = [vals[n] for n in region.inputs]
            assert [tuple(t.shape) for t in inputs] == [(1, 8, 1, 2), (8,)]
            ref = RegionReference(gm, region)
            want = ref(*[t.double() for t in inputs])[0]
            for ks in reduction_sources(region.kernel):
                out = torch.full((1, 8, 1, 2), float("nan"), device="cuda")
                assert vector_aligned(ks, inputs, [out])
                launch_fused(ks, inputs, [out], ks.compile())
                torch.cuda.synchronize()
                err = (out.double() - want).abs().max().item()
                assert err <= 2e-5, f"{ks.name}: error {err} against float64"
                checked.append(ks.name)
    assert any(n.startswith("fx_red_native_layer_norm_rows32v2_") for n in checked), checked
    assert any(n.startswith("fx_red_native_layer_norm_rows32v1_") for n in checked), checked

    with torch.no_grad():
        got = compile_with_fxopt(copy.deepcopy(model), {"executor": "cuda", **options})(x)
        eager = model(x)
    err, err_eager = ((t.double().cpu() - exact).abs().max().item() for t in (got, eager))
    assert err <= max(4 * err_eager, 1e-4), f"fxopt's error against float64 {err}, eager's {err_eager}"
