"""CUDA code generator + NVRTC compiler tests.

CPU part: every generator is compiled with NVRTC for sm_90 over a grid of parameters
(compile failure = test failure; the compiler itself: tests/test_cuda_compiler.py), and the conv-epilogue kernel (the
fused epilogue's IR expression rendered after cuDNN) over every activation x bias x residual x dtype
x layout: its text, and its reference semantics checked against eager torch.  GPU part
(``@pytest.mark.gpu``): kernels are launched and compared with torch.
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from fxopt.backends.cuda import compiler as nvrtc, ir
from fxopt.backends.cuda.codegen import c as csnip, source
from fxopt.backends.cuda.codegen.epilogue import has_bias, has_residual, template_epilogue
from fxopt.backends.cuda.kernels import conv_epilogue, depthwise_conv, pool, winograd
from fxopt.backends.cuda.kernels.conv_epilogue import epilogue_inputs, epilogue_reference, generate_conv_epilogue
from fxopt.ops import ACTIVATIONS as FUSED_ACTIVATIONS, apply_activation

DTYPES = source.SUPPORTED_DTYPES
LAYOUTS = ("nchw", "nhwc")
ARCH = "sm_90"
ACTS = [None, "relu", ("hardtanh", (0.0, 6.0)), "silu", "gelu", "gelu_tanh", "hardswish",
        "hardsigmoid", "sigmoid", "tanh", ("leaky_relu", (0.1,)), ["relu", ("clamp", (None, 4.0))]]
#: every activation a fused conv carries (fxopt.ops.ACTIVATIONS), with the parameters it takes
EPI_ACTS = [("none", []), ("relu", []), ("hardtanh", [0.0, 6.0]), ("leaky_relu", [0.1]), ("silu", []), ("gelu", []),
            ("gelu_tanh", []), ("hardswish", []), ("hardsigmoid", []), ("sigmoid", []), ("tanh", [])]
assert {a for a, _ in EPI_ACTS} == set(FUSED_ACTIVATIONS)
#: (activation, params, bias, residual): every epilogue a conv-epilogue kernel computes
EPILOGUES = [(a, p, b, r) for a, p in EPI_ACTS for b in (False, True) for r in (False, True)]

if os.environ.get("FXOPT_REQUIRE_NVRTC") == "1":
    needs_nvrtc = pytest.mark.usefixtures()
    assert nvrtc.nvrtc_available(), "FXOPT_REQUIRE_NVRTC=1 but NVRTC is not usable"
else:
    needs_nvrtc = pytest.mark.skipif(not nvrtc.nvrtc_available(), reason="NVRTC (cuda.core) not usable")


def gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(f))


def compile_all(kernels):
    """Compile in parallel; a CompileError (with log and quoted source) fails the test."""
    out = nvrtc.compile_many(kernels, arch=ARCH)
    assert [k.name for k in out] == [k.name for k in kernels]
    assert all(k.compiled and k.cubin and k.arch == ARCH for k in out)
    assert all(k.pdl_safe for k in out), "a generated kernel must wait for its predecessor first"
    return out


def epi_kernel(act="relu", params=(), bias=True, residual=True, dtype=torch.float32, layout="nchw", vec=1, **kw):
    e = template_epilogue(bias, residual, act, list(params))
    return generate_conv_epilogue(f"conv_epi_{'b' * bias}{'r' * residual}_{act}", e, dtype, layout, vec, **kw)


# --------------------------------------------------------------------- compile grids
@needs_nvrtc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_conv_epilogue_grid(dtype):
    """Every activation x bias x residual, the layouts and vector widths taking turns, some with
    64-bit indices."""
    ks = [epi_kernel(a, p, b, r, dtype, LAYOUTS[i % 2], (1, 2, 4, 8)[i % 4] if dtype != torch.float32 else (1, 2, 4)[i % 3],
                     index64=i % 5 == 0)
          for i, (a, p, b, r) in enumerate(EPILOGUES)]
    for k, (a, p, b, r) in zip(ks, EPILOGUES):
        assert k.param_names == ("in0",) + ("in1", "in2")[:b + r] + ("out", "numel", "C", "HW")
        assert k.param_types[-3:] == ("long long",) * 3 and k.param_types[0] == f"const {csnip.ctype(dtype)}*"
    compile_all(ks)


@needs_nvrtc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_pool_and_gap_grid(dtype):
    geo = [(2, 2, 0), (3, 2, 1), (3, 1, 1), ((3, 2), (2, 1), (1, 0)), (5, 1, 2)]
    ks = [pool.generate_pool2d(kind, k, s, p, dtype, lay, pre_activation=ACTS[i % len(ACTS)],
                             count_include_pad=bool(i % 2))
          for i, (kind, (k, s, p), lay) in enumerate(itertools.product(("max", "avg"), geo, LAYOUTS))]
    ks += [pool.generate_global_avgpool(dtype, lay, index64=i64) for lay in LAYOUTS for i64 in (False, True)]
    compile_all(ks)


@needs_nvrtc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_depthwise_grid(dtype):
    ks = []
    for i, (k, s, lay) in enumerate(itertools.product(range(3, 8), (1, 2), LAYOUTS)):
        epi = template_epilogue(bias=i % 2 == 0, residual=s == 1 and i % 3 == 0, activation=ACTS[i % len(ACTS)])
        ks.append(depthwise_conv.generate_depthwise_conv2d(k, s, k // 2, dtype, lay, epi, index64=i % 7 == 0))
    compile_all(ks)


@needs_nvrtc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_winograd_grid(dtype):
    ks = [winograd.generate_winograd_input_transform(dtype, lay, pad) for lay in LAYOUTS for pad in (0, 1)]
    ks += [winograd.generate_winograd_output_transform(dtype, lay, epi)
           for lay in LAYOUTS for epi in (None, template_epilogue(True), template_epilogue(True, True, "relu"),
                                          template_epilogue(False, True, ("hardtanh", (0.0, 6.0))))]
    if dtype != torch.float32:  # half activations, fp32 transform buffers
        ks += [winograd.generate_winograd_input_transform(dtype, "nhwc", transform_dtype=torch.float32),
               winograd.generate_winograd_output_transform(dtype, "nchw", template_epilogue(True), torch.float32, True)]
    compile_all(ks)


@needs_nvrtc
def test_compile_without_cuda_headers():
    """The header-free fp16/bf16 fallback (used when no cuda_fp16.h is found) compiles."""
    for dt, act in itertools.product((torch.float16, torch.bfloat16), ("gelu_tanh", "hardswish")):
        ks = epi_kernel(act, (), True, True, dt, "nhwc", 8)
        ck = nvrtc.compile_kernel(ks.source, ks.name, ARCH, {"define_macro": "FXOPT_NO_CUDA_HEADERS"})
        assert ck.cubin


def test_include_dirs_have_fp16_headers():
    for d in nvrtc.cuda_include_dirs():
        assert os.path.isfile(os.path.join(d, "cuda_fp16.h"))


# --------------------------------------------------------------------- codegen checks (no NVRTC)
def test_generation_errors():
    with pytest.raises(ValueError):
        epi_kernel(layout="nwhc")
    with pytest.raises(ValueError):
        epi_kernel(vec=3)
    with pytest.raises(ValueError):  # more than 32 bytes a vector
        epi_kernel(dtype=torch.float32, vec=16)
    with pytest.raises(ValueError):  # the residual before the bias: no epilogue chain
        generate_conv_epilogue("r", ir.op("add", ir.op("add", ir.ACC, ir.RES), ir.BIAS), torch.float32)
    with pytest.raises(ValueError):
        template_epilogue(True, False, "frobnicate")
    with pytest.raises(NotImplementedError):
        epi_kernel(dtype=torch.float64)
    with pytest.raises(ValueError):
        pool.generate_pool2d("max", 3, 1, 2)  # padding > k/2
    with pytest.raises(ValueError):
        depthwise_conv.generate_depthwise_conv2d(9)
    with pytest.raises(ValueError):
        pool.generate_pool2d("max", 3, pre_activation="frobnicate")


def test_grid_block_and_index64():
    ks = epi_kernel("gelu", (), True, True, torch.float16, "nhwc", 8)
    assert ks.grid_block(0)[0] == (0, 1, 1)
    assert ks.grid_block(8 * 256 * 3 + 1)[0] == (4, 1, 1)
    assert ks.grid_block(10**9)[0][0] == 1 << 16  # grid-stride: capped grid
    with pytest.raises(ValueError):
        ks.grid_block(2**31)
    assert source.needs_index64(2**31) and not source.needs_index64(2**30)
    ks64 = epi_kernel("gelu", (), True, True, torch.float16, "nhwc", 8, index64=True)
    assert "typedef long long idx_t" in ks64.source and ks64.grid_block(2**31)[0][0] == 1 << 16
    gap = pool.generate_global_avgpool(torch.float32, "nhwc")
    assert gap.grid_block(2 * 100 * 49, N=2, C=100) == ((4, 2, 1), (32, 8, 1))


def test_winograd_transform_code_matches_matrices():
    """The generated transform expressions (valid Python for 0/±1 matrices) equal L X L^T."""
    g = torch.Generator().manual_seed(0)
    for L_, r in ((winograd.WINO_BT, 4), (winograd.WINO_AT, 4)):
        X = torch.randn(r, r, dtype=torch.float64, generator=g)
        env = {f"d{i}_{j}": X[i, j].item() for i in range(r) for j in range(r)}
        for n, e in winograd.winograd_transform_code(L_, [[f"d{i}_{j}" for j in range(r)] for i in range(r)], "v"):
            env[n] = eval(e.replace("0.f", "0.0"), {}, dict(env))
        Lm = torch.tensor(L_, dtype=torch.float64)
        want = Lm @ X @ Lm.T
        got = torch.tensor([[env[f"v{i}_{j}"] for j in range(len(L_))] for i in range(len(L_))], dtype=torch.float64)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("shape,pad", [((2, 3, 8, 8), 1), ((1, 4, 7, 5), 1), ((2, 2, 6, 9), 0), ((1, 1, 3, 3), 1)])
def test_winograd_reference_pipeline_equals_conv2d(shape, pad):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    w = torch.randn(5, shape[1], 3, 3, dtype=torch.float64, generator=g)
    torch.testing.assert_close(winograd.winograd_conv2d_reference(x, w, pad), F.conv2d(x, w, padding=pad))


def test_pool_output_size_matches_torch():
    for H, k, s, p, ceil in itertools.product((7, 8, 13), (2, 3), (1, 2), (0, 1), (False, True)):
        if p > k // 2:
            continue
        want = F.max_pool2d(torch.zeros(1, 1, H, H + 1), k, s, p, ceil_mode=ceil).shape[2:]
        assert pool.pool2d_output_size(H, H + 1, k, s, p, ceil) == tuple(want)


def test_vector_width_selection_and_contract():
    ins = epilogue_inputs(template_epilogue(True))
    assert [(a.name, a.broadcast) for a in ins] == [("y", "full"), ("bias", "channel")]

    def choose(layout, x, b, out):
        return conv_epilogue.choose_vector_width(ins, torch.float16, layout, {"y": x, "bias": b}, out)

    x = torch.zeros(2, 16, 3, 3).to(memory_format=torch.channels_last).half()
    b, out = torch.zeros(16).half(), torch.empty_like(x)
    assert choose("nhwc", x, b, out) == 8
    assert choose("nchw", x, b, out) == 1  # HW = 9
    assert choose("nhwc", x, torch.zeros(17).half()[1:], out) == 1  # misaligned channel vector
    assert choose("nhwc", x, b, torch.empty(2 * 16 * 9 + 1).half()[1:].view(2, 3, 3, 16).permute(0, 3, 1, 2)) == 1
    x12 = torch.zeros(2, 12, 4, 4).half()
    assert choose("nhwc", x12, torch.zeros(12).half(), x12) == 4
    assert choose("nchw", x12, torch.zeros(12).half(), x12) == 8
    ks = epi_kernel("none", (), True, False, torch.float16, "nchw", 8)
    assert ks.meta["inputs"] == ins and ks.meta["dtype"] == torch.float16
    with pytest.raises(ValueError):  # HW % 8 != 0 violates the contract: refused, never launched
        conv_epilogue.launch_conv_epilogue(ks, {"y": x.contiguous(), "bias": b}, torch.empty_like(x.contiguous()))
    with pytest.raises(ValueError):  # wrong memory layout
        conv_epilogue.launch_conv_epilogue(ks, {"y": x, "bias": b}, out)
    with pytest.raises(TypeError):  # wrong dtype
        conv_epilogue.launch_conv_epilogue(ks, {"y": x12, "bias": torch.zeros(12)}, x12)
    with pytest.raises(ValueError):  # a bias of the wrong length
        conv_epilogue.launch_conv_epilogue(ks, {"y": x12, "bias": torch.zeros(8).half()}, x12)
    empty = torch.empty(0, 16, 4, 4).half()
    assert conv_epilogue.launch_conv_epilogue(ks, {"y": empty, "bias": b}, torch.empty_like(empty)).numel() == 0


def test_depthwise_weight_layouts():
    w = torch.arange(2 * 3 * 3.0).reshape(2, 1, 3, 3)
    assert depthwise_conv.prepare_depthwise_weight(w, "nchw").shape == (2, 3, 3)
    wn = depthwise_conv.prepare_depthwise_weight(w, "nhwc")
    assert wn.shape == (3, 3, 2) and wn[1, 2, 1] == w[1, 0, 1, 2]


# --------------------------------------------------------------------- the conv-epilogue kernel
def _body(ks) -> list[str]:
    lines = ks.source.splitlines()
    start = lines.index(f"FX_INLINE float {ks.name}_body(" + ", ".join(
        f"float x{j}" for j in range(len(ks.meta["inputs"]))) + ") {")
    return lines[start + 1:lines.index("}", start)]


def test_the_body_is_the_chain_in_order_one_value_per_step():
    assert _body(epi_kernel("relu", (), True, True)) == [
        "  const float t0 = (x0 + x1);  // t_bias = add", "  const float t1 = (t0 + x2);  // t_res = add",
        "  const float t2 = (t1 < 0.f ? 0.f : t1);  // t_act = relu", "  return t2;"]
    assert _body(epi_kernel("hardtanh", (0, 6), False, True)) == [
        "  const float t0 = (x0 + x1);  // t_res = add",
        "  const float t1 = fx_clamp(t0, 0.0f, 6.0f);  // t_act = hardtanh", "  return t1;"]
    assert _body(epi_kernel("leaky_relu", (0.1,), False, False)) == [
        "  const float t0 = (x0 > 0.f ? x0 : x0 * 0.1f);  // t_act = leaky_relu", "  return t0;"]
    assert _body(epi_kernel("none", (), False, False)) == ["  const float t0 = x0;  // t_id = identity", "  return t0;"]
    ks = epi_kernel("silu", (), True, False, torch.float16, "nhwc", 8)
    assert ks.name == "fx_pw_conv_epi_b_silu_nhwc_v8"
    assert "// fused pointwise region 'conv_epi_b_silu': layout nhwc, vector width 8" in ks.source
    assert "    const float a1 = fx_to_f32(in1[i % C]);" in ks.source
    assert "fx_vec<fx_half, 8> a1 = *reinterpret_cast<const fx_vec<fx_half, 8>*>(in1 + (i % C));" in ks.source
    nchw = epi_kernel("silu", (), True, False, torch.float16, "nchw", 8)
    assert nchw.source.count("const float a1 = fx_to_f32(in1[(i / HW) % C]);") == 2  # one bias per vector


@pytest.mark.parametrize("act,params,bias,residual", EPILOGUES, ids=str)
def test_every_epilogue_renders_its_steps_and_inputs(act, params, bias, residual):
    e = template_epilogue(bias, residual, act, params)
    ks = generate_conv_epilogue("e", e, torch.bfloat16, "nhwc", 4)
    body = _body(ks)
    labels = [ln.split("// ")[1] for ln in body[:-1]]
    want = ["t_bias = add"] * bias + ["t_res = add"] * residual + [f"t_act = {act}"] * (act != "none")
    assert labels == (want or ["t_id = identity"]) and body[-1] == f"  return t{len(labels) - 1};"
    assert [a.name for a in ks.meta["inputs"]] == ["y"] + ["bias"] * bias + ["res"] * residual
    assert ks.meta["epilogue"] == e and ks.source.count("fx_to_f32(in") == 1 + bias + residual


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act,params,bias,residual", EPILOGUES, ids=str)
def test_reference_is_the_fused_convs_epilogue(act, params, bias, residual, dtype, layout):
    """The kernel's semantics (the IR expression's ops in float32, one rounding) equal what
    ``fused_conv`` computes after its convolution, eagerly."""
    g = torch.Generator().manual_seed(3)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    y, res = ((torch.randn(2, 8, 5, 3, generator=g) * 4).to(dtype).contiguous(memory_format=fmt) for _ in range(2))
    tensors = {"y": y, "bias": torch.randn(8, generator=g).to(dtype), "res": res}
    epi = conv_epilogue.GeneratedEpilogue("t", template_epilogue(bias, residual, act, params), dtype, layout, 2)
    got = epi.reference(tensors)
    acc = y.float() + (tensors["bias"].float().view(1, -1, 1, 1) if bias else 0) + (res.float() if residual else 0)
    want = apply_activation(acc, act, params).to(dtype)
    assert got.dtype == dtype and got.shape == y.shape
    tol = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(epilogue_reference(epi.epilogue, tensors, dtype), got, rtol=0, atol=0)


# --------------------------------------------------------------------- GPU: launch and compare
def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act,params,bias,residual", EPILOGUES, ids=str)
def test_gpu_conv_epilogue_matches_its_reference(act, params, bias, residual, dtype):
    e = template_epilogue(bias, residual, act, params)
    for layout, (shape, i64) in itertools.product(LAYOUTS, [((3, 5, 7, 11), False), ((2, 16, 8, 8), True),
                                                            ((0, 5, 3, 3), False), ((1, 24, 13, 13), False)]):
        fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
        g = torch.Generator(device="cuda").manual_seed(sum(shape))
        full = [(torch.rand(shape, generator=g, device="cuda") * 8 - 4).to(dtype).contiguous(memory_format=fmt)
                for _ in range(2)]
        tensors = {"y": full[0], "bias": (torch.rand(shape[1], generator=g, device="cuda") * 2 - 1).to(dtype),
                   "res": full[1]}
        want = epilogue_reference(e, tensors, dtype)
        ins = epilogue_inputs(e)
        for vec in sorted({1, conv_epilogue.choose_vector_width(ins, dtype, layout, tensors, full[0])}):
            out = torch.full_like(full[0], float("nan"))
            ks = generate_conv_epilogue("g", e, dtype, layout, vec, index64=i64)
            conv_epilogue.launch_conv_epilogue(ks, tensors, out)
            torch.testing.assert_close(out, want, rtol=_tol(dtype), atol=_tol(dtype), msg=f"{ks.name} {shape}")


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_generated_epilogue_runs_in_place_or_declines(layout):
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    epi = conv_epilogue.GeneratedEpilogue("t", template_epilogue(True, True, "relu"), torch.float16, layout, 8)
    y = torch.randn(2, 16, 6, 6, device="cuda").half().contiguous(memory_format=fmt)
    bias, res = torch.randn(16, device="cuda").half(), torch.randn_like(y)
    want = epi.reference({"y": y, "bias": bias, "res": res})
    assert epi(y, bias, res) is y
    torch.testing.assert_close(y, want, rtol=_tol(torch.float16), atol=_tol(torch.float16))
    other = torch.channels_last if layout == "nchw" else torch.contiguous_format
    assert epi(y.contiguous(memory_format=other), bias, res.contiguous(memory_format=other)) is None


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_pool_gap(layout, dtype):
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(2, 5, 13, 11, device="cuda").to(dtype).contiguous(memory_format=fmt)
    for kind, (k, s, p), cip, act in [("max", (3, 2, 1), True, "relu"), ("avg", (3, 2, 1), False, None),
                                      ("avg", (2, 2, 0), True, "hardswish"), ("max", (2, 1, 1), True, None)]:
        ks = pool.generate_pool2d(kind, k, s, p, dtype, layout, pre_activation=act, count_include_pad=cip)
        for ceil in (False, True):
            OH, OW = pool.pool2d_output_size(13, 11, k, s, p, ceil)
            out = torch.empty(2, 5, OH, OW, dtype=dtype, device="cuda", memory_format=fmt)
            pool.launch_pool2d(ks, x, out)
            xa = x.float() if act is None else apply_activation(x.float(), act, [])
            want = (F.max_pool2d(xa, k, s, p, ceil_mode=ceil) if kind == "max" else
                    F.avg_pool2d(xa, k, s, p, ceil_mode=ceil, count_include_pad=cip))
            torch.testing.assert_close(out.float(), want, rtol=_tol(dtype), atol=_tol(dtype))
    gap = pool.generate_global_avgpool(dtype, layout)
    for shape in [(2, 5, 13, 11), (3, 70, 7, 7), (1, 3, 1, 1), (0, 4, 2, 2)]:
        xx = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=fmt)
        got = pool.launch_global_avgpool(gap, xx)
        torch.testing.assert_close(got.float(), xx.float().mean((2, 3)), rtol=_tol(dtype), atol=_tol(dtype))


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_depthwise(layout, dtype):
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    for k, s, (H, W), epi in [(3, 1, (9, 7), template_epilogue(True, True, "relu")), (5, 2, (12, 11), template_epilogue(True)),
                              (7, 1, (8, 8), template_epilogue(False, False, "hardswish")), (4, 2, (5, 6), None)]:
        C, p = 6, k // 2
        x = torch.randn(2, C, H, W, device="cuda").to(dtype).contiguous(memory_format=fmt)
        w = (torch.randn(C, 1, k, k, device="cuda") / k).to(dtype)
        bias = torch.randn(C, device="cuda").to(dtype)
        want = F.conv2d(x.double(), w.double(), bias.double() if epi and has_bias(epi) else None, s, p, groups=C)
        res = torch.randn(want.shape, device="cuda").to(dtype).contiguous(memory_format=fmt)
        if epi and has_residual(epi):
            want = want + res.double()
        for act, params in (ir.epilogue_parts(epi).activations if epi else ()):
            want = apply_activation(want, act, list(params))
        want = want.float()
        ks = depthwise_conv.generate_depthwise_conv2d(k, s, p, dtype, layout, epi)
        out = torch.empty(want.shape, dtype=dtype, device="cuda", memory_format=fmt)
        depthwise_conv.launch_depthwise_conv2d(ks, x, depthwise_conv.prepare_depthwise_weight(w, layout), out,
                                  bias if epi and has_bias(epi) else None, res if epi and has_residual(epi) else None)
        torch.testing.assert_close(out.float(), want, rtol=_tol(dtype) * 2, atol=_tol(dtype) * 4)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_winograd(layout, dtype):
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    for (N, C, H, W, K), pad in [((2, 8, 9, 7, 16), 1), ((1, 3, 8, 8, 4), 0), ((1, 16, 14, 14, 8), 1)]:
        x = torch.randn(N, C, H, W, device="cuda").to(dtype).contiguous(memory_format=fmt)
        w = (torch.randn(K, C, 3, 3, device="cuda") / (3 * C**0.5)).to(dtype)
        bias = torch.randn(K, device="cuda").to(dtype)
        want = F.conv2d(x.double(), w.double(), bias.double(), padding=pad)  # float64: no TF32
        res = torch.randn(want.shape, device="cuda").to(dtype).contiguous(memory_format=fmt)
        want = F.relu(want + res.double()).float()
        ks_in = winograd.generate_winograd_input_transform(dtype, layout, pad, transform_dtype=torch.float32)
        ks_out = winograd.generate_winograd_output_transform(dtype, layout, template_epilogue(True, True, "relu"), torch.float32)
        U = winograd.winograd_filter_transform(w, torch.float32)
        got = winograd.winograd_conv2d(ks_in, ks_out, x, U, bias, res)
        torch.testing.assert_close(got.float(), want, rtol=_tol(dtype) * 2, atol=_tol(dtype) * 4)


@gpu
def test_gpu_launch_on_current_stream_and_cuda_graph():
    ks = epi_kernel("silu", (), False, False, torch.float32, "nchw", 4)
    ck = ks.compile()
    ck.load()  # load the module before capture
    x = torch.randn(4, 8, 16, 16, device="cuda")
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # launches go to torch's current stream
        y = x * 2
        conv_epilogue.launch_conv_epilogue(ks, {"y": y}, out, kernel=ck)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(out, F.silu(x * 2))
    graph, static_out = torch.cuda.CUDAGraph(), torch.empty_like(x)
    with torch.cuda.graph(graph):
        conv_epilogue.launch_conv_epilogue(ks, {"y": x}, static_out, kernel=ck)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(static_out, F.silu(x))


@gpu
def test_gpu_programmatic_launch_chain_keeps_stream_order():
    """Twenty dependent kernels ping-ponging between two large buffers (each reads what the previous
    one wrote and overwrites what it read), launched with programmatic dependent launch where the
    device has it (sm_90+; before that the same chain runs without it), eagerly and replayed from a
    CUDA graph: the result is the sequential one."""
    add = epi_kernel("none", (), True, False, torch.float32, "nchw", 4)  # x + b[c]
    add_relu = epi_kernel("relu", (), True, False, torch.float32, "nchw", 4)  # relu(x + b[c])
    ks = (add, add_relu)
    biases = (torch.full((16,), 1.0, device="cuda"), torch.full((16,), -0.75, device="cuda"))
    cks = [k.compile() for k in ks]
    for ck in cks:
        ck.load()
        dev = torch.cuda.current_device()
        assert ck.pdl_safe and ck._pdl[dev] is nvrtc.programmatic_launch_supported(dev)
        if torch.cuda.get_device_capability(dev) < (9, 0):
            assert ck._pdl[dev] is False
    bufs = [torch.randn(1, 16, 1024, 1024, device="cuda"), torch.empty(1, 16, 1024, 1024, device="cuda")]

    def chain():
        for k in range(20):
            conv_epilogue.launch_conv_epilogue(ks[k % 2], {"y": bufs[k % 2], "bias": biases[k % 2]}, bufs[(k + 1) % 2],
                                               kernel=cks[k % 2])

    def expected(x):
        for k in range(20):
            x = x + 1.0 if k % 2 == 0 else torch.relu(x - 0.75)
        return x

    x0 = bufs[0].clone()
    chain()
    torch.testing.assert_close(bufs[0], expected(x0), rtol=0, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    bufs[0].copy_(x0)
    graph.replay()
    torch.testing.assert_close(bufs[0], expected(x0), rtol=0, atol=0)
