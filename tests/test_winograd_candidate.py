"""The generated F(2x2, 3x3) pipeline as a cuda-executor candidate (backends/cuda/kernels/winograd.py):
its torch emulation against F.conv2d for odd sizes and every epilogue, the filter transform's
generated expressions, NVRTC compiling its sources (no GPU needed), which convolutions it is offered
for and why it declines the others, its place in the families' table and the executor's plan;
on a GPU (``-m gpu``) the candidate against a float64 convolution."""
from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxopt.backends.cuda import compiler as nvrtc
from fxopt.backends.cuda.codegen.epilogue import template_epilogue
from fxopt.backends.cuda.kernels import FAMILIES, winograd
from fxopt.ops import fused_conv_ref

if os.environ.get("FXOPT_REQUIRE_NVRTC") == "1":
    needs_nvrtc = pytest.mark.usefixtures()
else:
    needs_nvrtc = pytest.mark.skipif(not nvrtc.nvrtc_available(), reason="NVRTC (cuda.core) not usable")
gpu = pytest.mark.gpu
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
EPILOGUES = [(False, False, "none", ()), (True, False, "relu", ()), (False, True, "silu", ()),
             (True, True, "hardtanh", (0.0, 0.5)), (True, True, "leaky_relu", (0.1,)), (True, False, "gelu", ())]


def _case(n, c, k, h, w, pad, epi, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    bias_on, res_on, act, params = epi
    x = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    wt = torch.randn(k, c, 3, 3, generator=g, dtype=torch.float64) / (3 * c ** 0.5)
    bias = torch.randn(k, generator=g, dtype=torch.float64) if bias_on else None
    oh, ow = h + 2 * pad - 2, w + 2 * pad - 2
    res = torch.randn(n, k, oh, ow, generator=g, dtype=torch.float64) if res_on else None
    want = F.conv2d(x, wt, bias, padding=pad) + (res if res_on else 0)
    want = {"none": lambda y: y, "relu": F.relu, "silu": F.silu, "gelu": F.gelu,
            "hardtanh": lambda y: F.hardtanh(y, *params), "leaky_relu": lambda y: F.leaky_relu(y, *params)}[act](want)
    cast = [t if t is None else t.to(dtype) for t in (x, wt, bias, res)]
    return cast, want


def _odd_cases():
    """1-3 pixel images, 1-7 channels, paddings 0-2 (where an output pixel remains), every epilogue."""
    for i, (h, w, pad) in enumerate(itertools.product((1, 2, 3), (1, 2, 3), (0, 1, 2))):
        if h + 2 * pad < 3 or w + 2 * pad < 3:
            continue
        c, k = 1 + (i * 3) % 7, 1 + (i * 5) % 7
        yield (1 + i % 3, c, k, h, w, pad, EPILOGUES[i % len(EPILOGUES)], i)


@pytest.mark.parametrize("n,c,k,h,w,pad,epi,seed", list(_odd_cases()))
def test_reference_matches_conv2d_for_odd_sizes(n, c, k, h, w, pad, epi, seed):
    (x, wt, bias, res), want = _case(n, c, k, h, w, pad, epi, torch.float64, seed)
    got = winograd.winograd_conv2d_reference(x, wt, pad, bias, res, epi[2], epi[3])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)  # exact transforms: float64 rounding only
    for dtype in (torch.float32, torch.float16, torch.bfloat16):  # the candidate's numerics: fp32 inside
        (xd, wd, bd, rd), _ = _case(n, c, k, h, w, pad, epi, dtype, seed)
        got = winograd.winograd_conv2d_reference(xd, wd, pad, bd, rd, epi[2], epi[3], compute_dtype=torch.float32)
        rtol, atol = winograd.tolerance(dtype)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)


def test_tolerance_is_the_winograd_2x2_algorithms():
    from fxopt.conv_algorithms import get_algorithm

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert winograd.tolerance(dtype) == get_algorithm("winograd_2x2_3x3").tolerance(dtype)


def test_filter_transform_code_is_g_g_gt():
    g = torch.randn(3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    env = {f"g{i}_{j}": g[i, j].item() for i in range(3) for j in range(3)}
    for name, expr in winograd.winograd_transform_code(winograd.WINO_G, [[f"g{i}_{j}" for j in range(3)]
                                                                        for i in range(3)], "u"):
        env[name] = eval(expr.replace("0.5f", "0.5").replace("0.f", "0.0"), {}, dict(env))
    G = torch.tensor(winograd.WINO_G, dtype=torch.float64)
    got = torch.tensor([[env[f"u{i}_{j}"] for j in range(4)] for i in range(4)], dtype=torch.float64)
    torch.testing.assert_close(got, G @ g @ G.T)


def _conv_node(x, w, bias=False, res=False, stride=1, padding=1, dilation=1, groups=1, act="none", params=(),
               algorithm="direct", how="forced"):
    """A graph with one fused_conv node over fake-free meta values (what the planners read)."""
    g = fx.Graph()
    xs, ws = g.placeholder("x"), g.placeholder("w")
    xs.meta["val"], ws.meta["val"] = x, w
    out = F.conv2d(x, w, None, stride, padding, dilation, groups)
    if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        out = out.contiguous(memory_format=torch.channels_last)
    b = r = None
    if bias:
        b = g.placeholder("b")
        b.meta["val"] = torch.zeros(w.shape[0], dtype=x.dtype)
    if res:
        r = g.placeholder("r")
        r.meta["val"] = torch.zeros_like(out)
    pair = (lambda v: [v, v] if isinstance(v, int) else list(v))
    node = g.call_function(fused_conv_ref, (xs, ws, b, r, pair(stride), pair(padding), pair(dilation), groups, act,
                                            list(params), algorithm, None))
    node.meta["val"], node.meta["fxopt_conv_algorithm_how"] = out, how
    return node


def test_offered_for_stride1_3x3_dense_convs_and_declined_with_a_reason():
    x, w = torch.randn(2, 4, 5, 6), torch.randn(3, 4, 3, 3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for fmt in (torch.contiguous_format, torch.channels_last):
            xd = x.to(dtype).contiguous(memory_format=fmt)
            for bias, res in ((False, False), (True, True)):
                cands = winograd.plan_winograd(_conv_node(xd, w.to(dtype), bias, res, act="relu"))
                assert len(cands) == 1 and cands[0].label == "winograd2x2", (dtype, fmt)
                assert set(cands[0].sources) == {"filter", "in", "out"}
                layout = "nhwc" if fmt == torch.channels_last else "nchw"
                assert all(ks.meta["layout"] == layout for ks in cands[0].sources.values())
    assert winograd.plan_winograd(_conv_node(x, w, padding=0))
    declined = {
        "groups": _conv_node(x, torch.randn(4, 2, 3, 3), groups=2),
        "stride": _conv_node(x, w, stride=2),
        "dilation": _conv_node(x, w, dilation=2, padding=2),
        "5x5": _conv_node(x, torch.randn(3, 4, 5, 5), padding=2),
        "padding": _conv_node(x, w, padding=(1, 0)),
        "forced": _conv_node(x, w, algorithm="winograd_4x4_3x3", how="forced"),
        "float64": _conv_node(x.double(), w.double()),
    }
    for what, node in declined.items():
        reason = winograd.decline_reason(node)
        assert winograd.plan_winograd(node) == [] and reason and "\n" not in reason, what
    assert "groups" in winograd.decline_reason(declined["groups"])
    assert "stride 1" in winograd.decline_reason(declined["stride"])
    assert winograd.decline_reason(_conv_node(x, w, algorithm="gemm", how="measured")) is None


def test_is_a_family_of_the_executor_table():
    assert [f.name for f in FAMILIES].count("winograd") == 1
    fam = next(f for f in FAMILIES if f.name == "winograd")
    assert fam.alone and fam.plan(_conv_node(torch.randn(1, 2, 3, 3), torch.randn(2, 2, 3, 3)), None)


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_candidate_sources_compile(dtype):
    kernels = []
    for layout, wl, pad in itertools.product(("nchw", "nhwc"), ("oihw", "ohwi"), (0, 1, 2)):
        kernels.append(winograd.generate_winograd_filter_transform(dtype, wl, layout))
        kernels.append(winograd.generate_winograd_input_transform(dtype, layout, pad, torch.float32))
    for layout, (b, r, act, p) in itertools.product(("nchw", "nhwc"), EPILOGUES):
        kernels.append(winograd.generate_winograd_output_transform(
            dtype, layout, template_epilogue(b, r, act, list(p)), torch.float32))
    kernels.append(winograd.generate_winograd_filter_transform(dtype, "oihw", "nhwc", index64=True))
    out = nvrtc.compile_many(kernels, arch="sm_90")
    assert all(k.compiled and k.pdl_safe for k in out)


@needs_nvrtc
def test_executor_plans_and_compiles_it_on_the_cpu():
    """The cuda executor on CPU tensors (what ``fxopt fuzz`` and the sanitizer sample plan)."""
    import fxopt
    from fxopt.fuzz.coverage import kernel_family

    model = nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Conv2d(5, 4, 3, padding=1, stride=2)).eval()
    report = fxopt.explain(model, torch.randn(1, 3, 3, 2), options={"executor": "cuda", "autotune_cache": False})
    wino = [k for k in report.kernels if kernel_family(k.name) == "conv:winograd"]
    assert {k.name.split("_")[2] for k in wino} == {"filter", "in", "out"} and all(k.compiled for k in wino)


@gpu
@on_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_gpu_candidate_matches_conv2d(dtype):
    for (n, c, k, h, w, pad, epi, seed), fmt in itertools.product(
            list(_odd_cases())[::3] + [(2, 16, 24, 14, 9, 1, EPILOGUES[3], 99)],
            (torch.contiguous_format, torch.channels_last)):
        (x, wt, bias, res), want = _case(n, c, k, h, w, pad, epi, dtype, seed)
        x = x.contiguous(memory_format=fmt)
        node = _conv_node(x, wt, epi[0], epi[1], padding=pad, act=epi[2], params=epi[3])
        res = None if res is None else torch.empty_like(node.meta["val"]).copy_(res).cuda()
        x, wt, bias = x.cuda(), wt.cuda(), None if bias is None else bias.cuda()
        (cand,) = winograd.plan_winograd(node)
        cand.kernels = {key: ks.compile() for key, ks in cand.sources.items()}
        got = cand(x, wt, bias, res, [1, 1], [pad, pad], [1, 1], 1, epi[2], list(epi[3]))
        want_strides = node.meta["val"].stride()
        assert got is not None and all(d == 1 or a == b for d, a, b in zip(got.shape, got.stride(), want_strides))
        rtol, atol = winograd.tolerance(dtype)
        torch.testing.assert_close(got.double().cpu(), want, rtol=rtol, atol=atol)


# -- the generated fp32 C run on the CPU: the kernels compiled by the host C++ compiler -------------
_HOST = r"""
#include <math.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__ __restrict
struct fx_dim3 { unsigned x, y, z; };
static fx_dim3 blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
"""


class _HostKernel:
    """A generated fp32 kernel compiled for the CPU: one thread whose grid-stride loop covers the grid.
    ``built``: the loaded kernels by (name, source): a source the candidates generate again (the
    same kernel for several shapes and layouts) is compiled once."""

    def __init__(self, ks, tmp, built: dict):
        import ctypes
        import subprocess

        self.ctypes = ctypes
        self.fn = built.get((ks.name, ks.source))
        if self.fn is not None:
            return
        src = tmp / f"{ks.name}_{len(built)}.cpp"
        src.write_text(_HOST + ks.source)
        r = subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", str(src.with_suffix(".so")), str(src)],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        self.fn = built[(ks.name, ks.source)] = getattr(ctypes.CDLL(str(src.with_suffix(".so"))), ks.name)

    def launch(self, grid, block, args):
        c = self.ctypes
        self.fn(*[c.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else c.c_longlong(int(a)) for a in args])


class _HostWinograd(winograd.WinogradConv):
    device_type = "cpu"


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="no host C++ compiler")
def test_candidate_pipeline_runs_its_generated_fp32_code_on_the_cpu(tmp_path):
    """The candidate's own call (filter, input transform, product, output transform with the epilogue)
    with the generated fp32 kernels compiled for the host, against F.conv2d: the kernels' indexing
    in both layouts and weight layouts."""
    shapes = [(2, 3, 5, 4, 4, 1), (1, 1, 1, 2, 3, 1), (3, 7, 3, 3, 2, 0), (1, 5, 2, 3, 6, 2)]
    built: dict = {}
    for (n, c, h, w, k, pad), fmt, wfmt, epi in itertools.product(
            shapes, (torch.contiguous_format, torch.channels_last), (torch.contiguous_format, torch.channels_last),
            EPILOGUES[2:4]):
        (x, wt, bias, res), want = _case(n, c, k, h, w, pad, epi, torch.float32, n * 7 + c)
        x, wt = x.contiguous(memory_format=fmt), wt.contiguous(memory_format=wfmt)
        node = _conv_node(x, wt, epi[0], epi[1], padding=pad, act=epi[2], params=epi[3])
        res = None if res is None else torch.empty_like(node.meta["val"]).copy_(res)  # in the output's layout
        if fmt == torch.contiguous_format and wfmt == torch.channels_last and x.shape[1] > 1 < min(want.shape[1:]):
            # a channels_last weight makes eager's output channels_last: not one layout with the input
            assert "layout" in winograd.decline_reason(node)
            continue
        (planned,) = winograd.plan_winograd(node) or pytest.fail(winograd.decline_reason(node))
        cand = _HostWinograd(node, planned.spec)
        cand.kernels = {key: _HostKernel(ks, tmp_path, built) for key, ks in cand.sources.items()}
        got = cand(x, wt, bias, res, [1, 1], [pad, pad], [1, 1], 1, epi[2], list(epi[3]))
        assert got is not None and all(d == 1 or a == b for d, a, b in
                                       zip(got.shape, got.stride(), node.meta["val"].stride()))
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
        assert cand(x.double(), wt, bias, res, [1, 1], [pad, pad], [1, 1], 1, epi[2], list(epi[3])) is None
