"""CUDA code generator + NVRTC compiler tests.

CPU part: every generator is compiled with NVRTC for sm_90 over a grid of parameters
(compile failure = test failure), compiler cache/error behaviour, and the torch reference
executor of PointwiseRegion checked against eager torch.  GPU part (``@pytest.mark.gpu``):
kernels are launched and compared with torch.
"""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from fxopt.backends.cuda import compiler as nvrtc
from fxopt.backends.cuda.codegen import c as csnip, source
from fxopt.backends.cuda.codegen.epilogue import has_bias, has_residual, template_epilogue
from fxopt.backends.cuda.kernels import common, conv_epilogue, depthwise_conv, pool, winograd
from fxopt.backends.cuda.kernels.conv_epilogue import PointwiseOp, PointwiseRegion, TensorArg

DTYPES = source.SUPPORTED_DTYPES
LAYOUTS = ("nchw", "nhwc")
ARCH = "sm_90"
ACTS = [None, "relu", ("hardtanh", (0.0, 6.0)), "silu", "gelu", "gelu_tanh", "hardswish",
        "hardsigmoid", "sigmoid", "tanh", ("leaky_relu", (0.1,)), ["relu", ("clamp", (None, 4.0))]]
UNARY_SPECS = [("identity", ()), ("neg", ()), ("relu", ()), ("hardtanh", ()), ("hardtanh", (0.0, 6.0)),
               ("leaky_relu", ()), ("leaky_relu", (0.2,)), ("silu", ()), ("gelu", ()), ("gelu_tanh", ()),
               ("hardswish", ()), ("hardsigmoid", ()), ("sigmoid", ()), ("tanh", ()), ("exp", ()),
               ("abs", ()), ("clamp", (-0.5, None)), ("clamp", (None, 0.5)), ("clamp", (-1.0, 2.0)),
               ("cast", (torch.float16,)), ("cast", (torch.bfloat16,)), ("cast", (torch.float32,))]
assert {op for op, _ in UNARY_SPECS} == set(csnip.UNARY_OPS)

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


def all_ops_region(dtype, out_dtype=None, name="all_ops") -> PointwiseRegion:
    """Every op and every broadcast kind in one region."""
    ins = [TensorArg("x", dtype), TensorArg("r", dtype), TensorArg("b", dtype, "channel"),
           TensorArg("s", torch.float32, "scalar")]
    ops, prev = [("a0", PointwiseOp("add", ["x", "b"])), ("a1", PointwiseOp("mul", ["a0", "s"])),
                 ("a2", PointwiseOp("sub", ["a1", "r"])), ("a3", PointwiseOp("div", ["a2", "s"])),
                 ("a4", PointwiseOp("add", ["a3"], (0.5,))), ("a5", PointwiseOp("div", ["a4"], (3.0,)))], "a5"
    for k, (op, p) in enumerate(UNARY_SPECS):
        ops.append((f"u{k}", PointwiseOp(op, [prev], p)))
        prev = f"u{k}"
    return PointwiseRegion(name, ins, ops, prev, out_dtype or dtype)


# --------------------------------------------------------------------- compile grids
@needs_nvrtc
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compile_pointwise_grid(dtype):
    ks = [conv_epilogue.generate_pointwise(all_ops_region(dtype), lay, vec)
          for lay, vec in itertools.product(LAYOUTS, (1, 2, 4, 8))]
    ks += [conv_epilogue.generate_pointwise(all_ops_region(dtype, torch.float32, "to_f32"), lay, 4, index64=True)
           for lay in LAYOUTS]
    for k in ks:
        assert k.param_types[-3:] == ("long long",) * 3 and k.param_names[-4] == "out"
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
    for dt in (torch.float16, torch.bfloat16):
        ks = conv_epilogue.generate_pointwise(all_ops_region(dt, name="noheaders"), "nhwc", 8)
        ck = nvrtc.compile_kernel(ks.source, ks.name, ARCH, {"define_macro": "FXOPT_NO_CUDA_HEADERS"})
        assert ck.cubin


def test_include_dirs_have_fp16_headers():
    for d in nvrtc.cuda_include_dirs():
        assert os.path.isfile(os.path.join(d, "cuda_fp16.h"))


# --------------------------------------------------------------------- compiler behaviour
_uid = itertools.count()


def unique_source(tag=""):
    n = f"fx_test_{os.getpid()}_{next(_uid)}{tag}"
    return n, f'extern "C" __global__ void {n}(float* x, long long n) {{\n  if (n) x[0] = 1.f;\n}}\n'


@needs_nvrtc
def test_compile_error_carries_log_source_and_line():
    src = ('extern "C" __global__ void fx_broken(float* x) {\n'
           '  x[0] = 1.f;\n'
           '  x[1] = undefined_symbol;\n'
           '}\n')
    with pytest.raises(nvrtc.CompileError) as ei:
        nvrtc.compile_kernel(src, "fx_broken", ARCH)
    e = ei.value
    assert e.name == "fx_broken" and e.source == src and "undefined_symbol" in e.log
    assert e.error_lines() == [3]
    msg = str(e)
    assert "fx_broken" in msg and ">    3 |   x[1] = undefined_symbol;" in msg
    assert "     2 |   x[0] = 1.f;" in msg


@needs_nvrtc
@pytest.mark.parametrize("layout,vec", [("nchw", 1), ("nhwc", 8)])
def test_fast_math_epilogue_template_only_for_16_bit_results(layout, vec):
    """Option fast_math reaches the conv-epilogue template: its exp and quotient approximate (no
    IEEE division left in the PTX) where the result is fp16/bf16; a float32 result is unchanged."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        region = all_ops_region(dtype)
        ieee = conv_epilogue.generate_pointwise(region, layout, vec)
        fast = conv_epilogue.generate_pointwise(region, layout, vec, fast_math=True)
        if dtype == torch.float32:
            assert (fast.source, fast.name, fast.meta["fast_math"]) == (ieee.source, ieee.name, False)
            continue
        assert fast.meta["fast_math"] and fast.name != ieee.name
        assert fast.source.replace(fast.name, ieee.name) == "#define FXOPT_FAST_MATH 1\n" + ieee.source
        ptx_ieee, ptx_fast = (nvrtc.compile_ptx(k.source, k.name, ARCH) for k in (ieee, fast))
        # the region's own divisions (by a tensor, by 3) stay IEEE; the activations' go
        assert ptx_fast.count("div.rn.f32") < ptx_ieee.count("div.rn.f32")
    compile_all([conv_epilogue.generate_pointwise(all_ops_region(torch.float16), layout, vec, fast_math=True)])


@needs_nvrtc
def test_compile_error_from_broken_region(monkeypatch):
    monkeypatch.setitem(csnip._UNARY_C, "relu", "({a} +* )")
    region = PointwiseRegion("broken", [TensorArg("x")], [("y", PointwiseOp("relu", ["x"]))], "y")
    ks = conv_epilogue.generate_pointwise(region)
    with pytest.raises(nvrtc.CompileError) as ei:
        ks.compile(ARCH)
    lines = ei.value.error_lines()
    assert lines and "+* )" in ks.source.splitlines()[lines[0] - 1]
    assert f"> {lines[0]:4d} | " in str(ei.value) or f">{lines[0]:5d} | " in str(ei.value)


@needs_nvrtc
def test_cache_memory_then_disk_hit():
    name, src = unique_source()
    before = nvrtc.cache_stats().get("nvrtc_compiles", 0)
    a = nvrtc.compile_kernel(src, name, ARCH)
    assert a.cache_source is None and nvrtc.cache_stats()["nvrtc_compiles"] == before + 1
    assert nvrtc.compile_kernel(src, name, ARCH) is a  # in-memory hit
    nvrtc.clear_memory_cache()
    disk_before = nvrtc.cache_stats().get("disk_hits", 0)
    b = nvrtc.compile_kernel(src, name, ARCH)
    assert b.cache_source == "disk" and b.cubin == a.cubin
    assert nvrtc.cache_stats()["nvrtc_compiles"] == before + 1
    assert nvrtc.cache_stats()["disk_hits"] == disk_before + 1
    # the key covers arch and options
    c = nvrtc.compile_kernel(src, name, "sm_80")
    d = nvrtc.compile_kernel(src, name, ARCH, {"lineinfo": True})
    assert len({a.key, c.key, d.key}) == 3
    assert nvrtc.cache_stats()["nvrtc_compiles"] == before + 3


@needs_nvrtc
def test_cache_dir_from_env_and_atomic_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path / "c"))
    name, src = unique_source()
    ck = nvrtc.compile_kernel(src, name, ARCH)
    files = list((tmp_path / "c" / "kernels").rglob("*.cubin"))
    assert [f.name for f in files] == [f"{ck.key}.cubin"]
    assert not [f for f in files[0].parent.iterdir() if f.name.startswith(".tmp-")]


@needs_nvrtc
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_cache_file_is_ignored_and_rewritten(damage):
    name, src = unique_source(damage)
    ck = nvrtc.compile_kernel(src, name, ARCH)
    path = nvrtc.cache_dir() / ck.key[:2] / f"{ck.key}.cubin"
    blob = path.read_bytes()
    bad = {"truncate": blob[: len(blob) // 2], "empty": b"", "garbage": b"not a cubin\n" * 3,
           "flip": blob[:-1] + bytes([blob[-1] ^ 0xFF])}[damage]
    path.write_bytes(bad)
    nvrtc.clear_memory_cache()
    stats = nvrtc.cache_stats()
    again = nvrtc.compile_kernel(src, name, ARCH)
    now = nvrtc.cache_stats()
    assert now["nvrtc_compiles"] == stats["nvrtc_compiles"] + 1
    assert now.get("corrupt_cache_files", 0) == stats.get("corrupt_cache_files", 0) + 1
    assert again.cubin == ck.cubin and path.read_bytes() == blob


@needs_nvrtc
def test_compile_many_keeps_order_and_raises():
    items = [unique_source() for _ in range(6)]
    out = nvrtc.compile_many(((s, n) for n, s in items), arch=ARCH, max_workers=3)  # any iterable
    assert [k.name for k in out] == [n for n, _ in items]
    assert [k.source for k in out] == [s for _, s in items]
    assert nvrtc.compile_many([]) == []
    name, src = unique_source()  # asked for three times (three nodes alike): compiled once
    before = nvrtc.cache_stats().get("nvrtc_compiles", 0)
    same = nvrtc.compile_many([(src, name)] * 3 + [(s, n) for n, s in items[:1]], arch=ARCH, max_workers=3)
    assert nvrtc.cache_stats()["nvrtc_compiles"] == before + 1  # items[0] is in the memory cache already
    assert same[0] is same[1] is same[2] and same[3].name == items[0][0]
    bad = [(s, n) for n, s in (unique_source() for _ in range(2))] + [("garbage(", "fx_bad")]
    with pytest.raises(nvrtc.CompileError):
        nvrtc.compile_many(bad, arch=ARCH)


def test_arg_conversion_and_empty_launch_is_noop():
    ck = nvrtc.CompiledKernel("k", "", ARCH, b"x", ("const float*", "float*", "long long", "int", "float"))
    t = torch.zeros(4)
    args = ck.convert_args([t, 1234, 7, 3, 0.5])
    assert args[0] == t.data_ptr() and args[1] == 1234
    assert isinstance(args[2], np.int64) and isinstance(args[3], np.int32) and isinstance(args[4], np.float32)
    with pytest.raises(TypeError):
        ck.convert_args([t])
    with pytest.raises(TypeError):
        ck.convert_args([t, t, t, 1, 1.0])
    untyped = nvrtc.CompiledKernel("k", "", ARCH, b"x").convert_args([t, 3, 2.5, np.int32(1)])
    assert [type(a) for a in untyped[1:]] == [np.int64, np.float32, np.int32]
    ck.launch((0, 1, 1), 256, [t, t, 0, 0, 0.0])  # empty grid: returns before touching CUDA
    ck.launch(1, (0,), [t, t, 0, 0, 0.0])


def test_pdl_safe_needs_the_wait_as_first_statement():
    ok = 'extern "C" __global__ void __launch_bounds__(256)\nk(float* y) {\n  fx_pdl_begin();  // c\n  y[0] = 1.f;\n}'
    late = 'extern "C" __global__ void k(float* y) {\n  y[0] = 1.f;\n  fx_pdl_begin();\n}'
    assert nvrtc.CompiledKernel("k", ok, ARCH, b"x").pdl_safe
    assert not nvrtc.CompiledKernel("k", late, ARCH, b"x").pdl_safe
    assert not nvrtc.CompiledKernel("k", 'extern "C" __global__ void k() {}', ARCH, b"x").pdl_safe
    from importlib import resources
    tdir = resources.files(common.__package__).joinpath("templates")
    kernels = [p for p in tdir.iterdir() if p.name.endswith(".cu") and "__global__" in p.read_text()]
    assert len(kernels) >= 9
    for path in kernels:  # every kernel template opts in
        assert nvrtc._PDL_FIRST.search(path.read_text()), path.name


@pytest.mark.parametrize("env,capability,want", [(None, (9, 0), True), ("0", (9, 0), False),
                                                 ("1", (8, 0), False), (None, (10, 0), True)])
def test_programmatic_launch_switch(monkeypatch, env, capability, want):
    if env is None:
        monkeypatch.delenv("FXOPT_PDL", raising=False)
    else:
        monkeypatch.setenv("FXOPT_PDL", env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(nvrtc, "_launch_config_has_pdl", lambda: True)
    assert nvrtc.programmatic_launch_supported(0) is want


def test_launch_sets_programmatic_serialization_only_when_asked(monkeypatch):
    seen = []

    class FakeCore:
        class Stream:
            @staticmethod
            def from_handle(handle):
                return ("stream", handle)

        @staticmethod
        def LaunchConfig(**kw):
            return kw

        @staticmethod
        def launch(stream, cfg, kernel, *args):
            seen.append((stream, cfg, kernel, args))

    class FakeTorchStream:
        cuda_stream = 12345

    monkeypatch.setattr(nvrtc, "_core", lambda: FakeCore)
    monkeypatch.setattr(nvrtc, "_STREAMS", {})
    nvrtc._launch("kern", (1, 1, 1), (32, 1, 1), 0, FakeTorchStream(), [1], pdl=True)
    nvrtc._launch("kern", (1, 1, 1), (32, 1, 1), 0, FakeTorchStream(), [1], pdl=False)
    assert seen[0][1]["programmatic_stream_serialization"] is True
    assert "programmatic_stream_serialization" not in seen[1][1]
    assert seen[0][0] == ("stream", 12345) and seen[0][2] == "kern" and seen[0][3] == (1,)


def test_default_arch():
    assert nvrtc.default_arch("sm_80") == "sm_80"
    if not torch.cuda.is_available():
        assert nvrtc.default_arch() == "sm_90"
    else:
        assert nvrtc.default_arch() == "sm_%d%d" % torch.cuda.get_device_capability()


# --------------------------------------------------------------------- codegen checks (no NVRTC)
def test_region_validation_errors():
    x = TensorArg("x")
    with pytest.raises(ValueError):
        PointwiseRegion("r", [x], [("y", PointwiseOp("relu", ["nope"]))], "y").validate()
    with pytest.raises(NotImplementedError):
        PointwiseRegion("r", [x], [("y", PointwiseOp("frobnicate", ["x"]))], "y").validate()
    with pytest.raises(ValueError):
        PointwiseRegion("r", [x], [("y", PointwiseOp("add", ["x"]))], "y").validate()
    with pytest.raises(ValueError):
        PointwiseRegion("r", [x], [("y", PointwiseOp("relu", ["x"]))], "z").validate()
    with pytest.raises(NotImplementedError):
        PointwiseRegion("r", [TensorArg("x", torch.float64)], [], "x").validate()
    with pytest.raises(ValueError):
        TensorArg("x", broadcast="row")
    ok = PointwiseRegion("r", [x], [("y", PointwiseOp("relu", ["x"]))], "y")
    with pytest.raises(ValueError):
        conv_epilogue.generate_pointwise(ok, "nwhc")
    with pytest.raises(ValueError):
        conv_epilogue.generate_pointwise(ok, vector_width=3)
    with pytest.raises(ValueError):
        pool.generate_pool2d("max", 3, 1, 2)  # padding > k/2
    with pytest.raises(ValueError):
        depthwise_conv.generate_depthwise_conv2d(9)
    with pytest.raises(ValueError):
        pool.generate_pool2d("max", 3, pre_activation="frobnicate")


def test_grid_block_and_index64():
    ks = conv_epilogue.generate_pointwise(all_ops_region(torch.float16), "nhwc", 8)
    assert ks.grid_block(0)[0] == (0, 1, 1)
    assert ks.grid_block(8 * 256 * 3 + 1)[0] == (4, 1, 1)
    assert ks.grid_block(10**9)[0][0] == 1 << 16  # grid-stride: capped grid
    with pytest.raises(ValueError):
        ks.grid_block(2**31)
    assert source.needs_index64(2**31) and not source.needs_index64(2**30)
    ks64 = conv_epilogue.generate_pointwise(all_ops_region(torch.float16), "nhwc", 8, index64=True)
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
    region = PointwiseRegion("r", [TensorArg("x", torch.float16), TensorArg("b", torch.float16, "channel")],
                             [("y", PointwiseOp("add", ["x", "b"]))], "y", torch.float16)
    x = torch.zeros(2, 16, 3, 3).to(memory_format=torch.channels_last).half()
    b, out = torch.zeros(16).half(), torch.empty_like(x)
    assert conv_epilogue.choose_vector_width(region, "nhwc", {"x": x, "b": b}, out) == 8
    assert conv_epilogue.choose_vector_width(region, "nchw", {"x": x, "b": b}, out) == 1  # HW = 9
    bb = torch.zeros(17).half()[1:]  # misaligned channel vector
    assert conv_epilogue.choose_vector_width(region, "nhwc", {"x": x, "b": bb}, out) == 1
    x12 = torch.zeros(2, 12, 4, 4).half()
    assert conv_epilogue.choose_vector_width(region, "nhwc", {"x": x12, "b": torch.zeros(12).half()}, x12) == 4
    assert conv_epilogue.choose_vector_width(region, "nchw", {"x": x12, "b": torch.zeros(12).half()}, x12) == 8
    ks = conv_epilogue.generate_pointwise(region, "nchw", 8)
    with pytest.raises(ValueError):  # HW % 8 != 0 violates the contract: refused, never launched
        conv_epilogue.launch_pointwise(ks, {"x": x.contiguous(), "b": b}, torch.empty_like(x.contiguous()))
    with pytest.raises(ValueError):  # wrong memory layout
        conv_epilogue.launch_pointwise(ks, {"x": x, "b": b}, out)
    empty = torch.empty(0, 16, 4, 4).half()
    assert conv_epilogue.launch_pointwise(ks, {"x": empty, "b": b}, torch.empty_like(empty)).numel() == 0


def test_depthwise_weight_layouts():
    w = torch.arange(2 * 3 * 3.0).reshape(2, 1, 3, 3)
    assert depthwise_conv.prepare_depthwise_weight(w, "nchw").shape == (2, 3, 3)
    wn = depthwise_conv.prepare_depthwise_weight(w, "nhwc")
    assert wn.shape == (3, 3, 2) and wn[1, 2, 1] == w[1, 0, 1, 2]


# --------------------------------------------------------------------- reference executor
EAGER = {
    "identity": lambda a, p: a, "neg": lambda a, p: -a, "relu": lambda a, p: F.relu(a),
    "hardtanh": lambda a, p: F.hardtanh(a, *(p or (-1.0, 1.0))),
    "leaky_relu": lambda a, p: F.leaky_relu(a, *(p or (0.01,))), "silu": lambda a, p: F.silu(a),
    "gelu": lambda a, p: F.gelu(a), "gelu_tanh": lambda a, p: F.gelu(a, approximate="tanh"),
    "hardswish": lambda a, p: F.hardswish(a), "hardsigmoid": lambda a, p: F.hardsigmoid(a),
    "sigmoid": lambda a, p: torch.sigmoid(a), "tanh": lambda a, p: torch.tanh(a),
    "exp": lambda a, p: torch.exp(a), "abs": lambda a, p: torch.abs(a),
    "clamp": lambda a, p: torch.clamp(a, *p), "cast": lambda a, p: a.to(p[0]).to(a.dtype),
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
}


@st.composite
def regions_and_inputs(draw):
    dt = st.sampled_from(DTYPES)
    ins = [TensorArg("x0", draw(dt))]
    for j in range(1, draw(st.integers(1, 4))):
        ins.append(TensorArg(f"x{j}", draw(dt), draw(st.sampled_from(["full", "channel", "scalar"]))))
    names, ops = [a.name for a in ins], []
    for k in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["unary", "unary", "binary", "const"]))
        if kind == "unary":
            op, p = draw(st.sampled_from(UNARY_SPECS))
            ops.append((f"v{k}", PointwiseOp(op, [draw(st.sampled_from(names))], p)))
        elif kind == "binary":
            op = draw(st.sampled_from(sorted(csnip.BINARY_OPS)))
            ops.append((f"v{k}", PointwiseOp(op, [draw(st.sampled_from(names)) for _ in range(2)])))
        else:
            op = draw(st.sampled_from(sorted(csnip.BINARY_OPS)))
            c = draw(st.sampled_from([0.5, -2.0, 3.0, 1e-3, 0.1]))
            ops.append((f"v{k}", PointwiseOp(op, [draw(st.sampled_from(names))], (c,))))
        names.append(f"v{k}")
    region = PointwiseRegion("rand", ins, ops, draw(st.sampled_from(names[len(ins) - 1:])), draw(dt))
    shape = (draw(st.integers(0, 2)), draw(st.integers(1, 6)), draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    channels_last = draw(st.booleans())
    tensors = {}
    for a in ins:
        n = {"full": shape, "channel": (shape[1],), "scalar": ()}[a.broadcast]
        t = (torch.rand(n, generator=g) * 6 - 3).to(a.dtype)
        tensors[a.name] = t.to(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t
    return region, shape, tensors


@settings(max_examples=30, deadline=None)
@given(regions_and_inputs())
def test_reference_matches_eager_torch(case):
    """PointwiseRegion.reference == eager torch: op by op (on the reference's own inputs,
    so errors do not compound), plus broadcasting and the final rounding end to end."""
    region, shape, tensors = case
    trace: dict = {}
    out = region.reference(tensors, trace=trace)
    assert out.shape == shape and out.dtype == region.out_dtype
    view = {"full": lambda t: t, "channel": lambda t: t.view(1, -1, 1, 1), "scalar": lambda t: t}
    for a in region.inputs:  # eager broadcasting of the raw inputs
        torch.testing.assert_close(trace[a.name].expand(shape),
                                   view[a.broadcast](tensors[a.name]).float().expand(shape))
    for ssa, op in region.ops:
        xs = [trace[i] for i in op.inputs]
        if op.op in csnip.BINARY_OPS:
            want = EAGER[op.op](xs[0], xs[1] if len(xs) == 2 else op.params[0])
        else:
            want = EAGER[op.op](xs[0], tuple(op.params))
        torch.testing.assert_close(trace[ssa], want, rtol=2e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(out, trace[region.output].expand(shape).to(region.out_dtype),
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["relu", "hardswish", "gelu", "silu", ("hardtanh", (0.0, 6.0))], ids=str)
def test_reference_conv_epilogue_region_vs_eager(dtype, act):
    """A typical lowered region (x * scale[c] + shift[c] + residual -> act) vs eager torch
    in the native dtype."""
    op, p = (act, ()) if isinstance(act, str) else act
    region = PointwiseRegion("bn_add_act", [TensorArg("x", dtype), TensorArg("sc", dtype, "channel"),
                                            TensorArg("sh", dtype, "channel"), TensorArg("res", dtype)],
                             [("m", PointwiseOp("mul", ["x", "sc"])), ("a", PointwiseOp("add", ["m", "sh"])),
                              ("r", PointwiseOp("add", ["a", "res"])), ("y", PointwiseOp(op, ["r"], p))],
                             "y", dtype)
    g = torch.Generator().manual_seed(3)
    x, res = (torch.randn(2, 8, 5, 5, generator=g).to(dtype) for _ in range(2))
    sc, sh = (torch.randn(8, generator=g).to(dtype) for _ in range(2))
    got = region.reference({"x": x, "sc": sc, "sh": sh, "res": res})
    want = EAGER[op](x * sc.view(1, -1, 1, 1) + sh.view(1, -1, 1, 1) + res, p)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


# --------------------------------------------------------------------- GPU: launch and compare
def _cuda_inputs(region, shape, layout, seed, offset_elems=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    tensors = {}
    for a in region.inputs:
        n = {"full": shape, "channel": (shape[1],), "scalar": (1,)}[a.broadcast]
        t = torch.rand(n, generator=g, device="cuda") * 6 - 3
        tensors[a.name] = t.to(a.dtype).contiguous(memory_format=fmt if a.broadcast == "full" else torch.contiguous_format)
    return tensors


def _tol(dtype):
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


@gpu
@settings(max_examples=30, deadline=None)
@given(regions_and_inputs(), st.sampled_from(LAYOUTS),
       st.sampled_from([(0, 3, 4, 4), (1, 1, 1, 1), (2, 8, 7, 9), (3, 16, 5, 5), (1, 24, 13, 13), (2, 64, 8, 8)]),
       st.sampled_from([None, 1, 8]), st.integers(0, 1000))
def test_gpu_pointwise_matches_reference(case, layout, shape, vec, seed):
    region = case[0]
    tensors = _cuda_inputs(region, shape, layout, seed)
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    out = torch.empty(shape, dtype=region.out_dtype, device="cuda", memory_format=fmt)
    if vec is None:
        vec = conv_epilogue.choose_vector_width(region, layout, tensors, out)
    elif not conv_epilogue.vector_width_ok(region, layout, vec, shape, {k: v.data_ptr() for k, v in tensors.items()},
                               out.data_ptr()) or vec * max(d.itemsize for d in region.dtypes()) > 32:
        vec = 1
    ks = conv_epilogue.generate_pointwise(region, layout, vec)
    conv_epilogue.launch_pointwise(ks, tensors, out)
    trace: dict = {}
    ref = region.reference({k: (v.reshape(()) if a.broadcast == "scalar" else v) for a in region.inputs
                            for k, v in [(a.name, tensors[a.name])]}, trace=trace)
    mag = max([t.abs().nan_to_num(0, 0, 0).max().item() for t in trace.values() if t.numel()] + [1.0])
    tol = _tol(region.out_dtype)
    torch.testing.assert_close(out, ref, rtol=max(tol, 1e-4), atol=1e-4 * mag * mag + tol, equal_nan=True)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_pointwise_all_ops_odd_and_index64(layout, dtype):
    region = all_ops_region(dtype)
    for shape, i64 in [((3, 5, 7, 11), False), ((2, 16, 8, 8), True), ((0, 5, 3, 3), False)]:
        tensors = _cuda_inputs(region, shape, layout, 0)
        out = torch.empty_like(tensors["x"])
        vec = conv_epilogue.choose_vector_width(region, layout, tensors, out)
        conv_epilogue.launch_pointwise(conv_epilogue.generate_pointwise(region, layout, vec, index64=i64), tensors, out)
        ref = region.reference({**tensors, "s": tensors["s"].reshape(())})
        torch.testing.assert_close(out, ref, rtol=_tol(dtype), atol=_tol(dtype) * 10, equal_nan=True)


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
            xa = x.float() if act is None else EAGER[act](x.float(), ())
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
        if epi and epi.activation:
            want = EAGER[epi.activation](want, ())
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
    region = PointwiseRegion("g", [TensorArg("x")], [("y", PointwiseOp("silu", ["x"]))], "y")
    ks = conv_epilogue.generate_pointwise(region, "nchw", 4)
    ck = ks.compile()
    ck.load()  # load the module before capture
    x = torch.randn(4, 8, 16, 16, device="cuda")
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # launches go to torch's current stream
        y = x * 2
        conv_epilogue.launch_pointwise(ks, {"x": y}, out, kernel=ck)
    torch.cuda.current_stream().wait_stream(s)
    torch.testing.assert_close(out, F.silu(x * 2))
    graph, static_out = torch.cuda.CUDAGraph(), torch.empty_like(x)
    with torch.cuda.graph(graph):
        conv_epilogue.launch_pointwise(ks, {"x": x}, static_out, kernel=ck)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(static_out, F.silu(x))


@gpu
def test_gpu_programmatic_launch_chain_keeps_stream_order():
    """Twenty dependent kernels ping-ponging between two large buffers (each reads what the previous
    one wrote and overwrites what it read), launched with programmatic dependent launch where the
    device has it (sm_90+; before that the same chain runs without it), eagerly and replayed from a
    CUDA graph: the result is the sequential one."""
    add = conv_epilogue.generate_pointwise(PointwiseRegion("pdl_add", [TensorArg("x")],
                                                [("y", PointwiseOp("add", ["x"], (1.0,)))], "y"), "nchw", 4)
    mul = conv_epilogue.generate_pointwise(PointwiseRegion("pdl_mul", [TensorArg("x")],
                                                [("y", PointwiseOp("mul", ["x"], (0.5,)))], "y"), "nchw", 4)
    ks = (add, mul)
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
            conv_epilogue.launch_pointwise(ks[k % 2], {"x": bufs[k % 2]}, bufs[(k + 1) % 2], kernel=cks[k % 2])

    def expected(x):
        for k in range(20):
            x = x + 1.0 if k % 2 == 0 else x * 0.5
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


@needs_nvrtc
def test_pending_kernels_overlap_and_isolate_a_failure():
    """The executor's background compilation: an item's kernels are filled when that item is
    asked for (the others may still compile); a kernel that fails leaves its item without any
    kernel, the other items keep theirs, and the report records every kernel in order, the bad
    one with its NVRTC log."""
    from types import SimpleNamespace

    from fxopt.backends.cuda.runtime.executor import PendingKernels

    def item(*sources):
        return SimpleNamespace(sources={i: source.KernelSource(n, s, (), "test") for i, (n, s) in enumerate(sources)},
                               kernels={})

    good1, good2 = item(unique_source(), unique_source()), item(unique_source())
    bad = item(unique_source(), ("fx_bad_kernel", 'extern "C" __global__ void fx_bad_kernel() { garbage( }'))
    info = {"kernels": []}
    pending = PendingKernels([good1, bad, good2], info)
    pending.ready([good2])
    assert len(good2.kernels) == 1 and good2.kernels[0].compiled
    assert good1.kernels == {} and info["kernels"] == []  # not asked for yet, nothing recorded yet
    pending.finish()
    assert len(good1.kernels) == 2 and bad.kernels == {}
    names = [ks.name for it in (good1, bad, good2) for ks in it.sources.values()]
    assert [k.name for k in info["kernels"]] == names
    assert [k.compiled for k in info["kernels"]] == [True, True, True, False, True]
    assert "garbage" in info["kernels"][3].error and pending.compile_s > 0
