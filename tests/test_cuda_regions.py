"""Generated-kernel candidates for depthwise convs, max pooling and global average pooling
(backends/cuda/schedule/conv.py, schedule/pool.py): which nodes they take and decline, that their kernels compile with
NVRTC (CPU), and that they compute what the node computes (GPU, hypothesis over shapes)."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fxopt
import fxopt.testing
from fxopt.backends import torch_ref
from fxopt.backends.cuda.codegen.epilogue import has_bias, has_residual
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda.kernels.depthwise_conv import DepthwiseConv, plan_depthwise
from fxopt.backends.cuda.kernels.pool import GlobalAvgPool, MaxPool, plan_global_avgpool, plan_maxpool
from fxopt.tolerances import relative_error

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class MobileBlock(nn.Module):
    """stem conv -> max pool -> depthwise 3x3 + BN + ReLU6 -> 1x1 -> global average pool."""

    def __init__(self, c=16, k=3, stride=1, dilation=1, pool_k=3, pool_stride=2, pool_pad=1, ceil=False):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.pool = nn.MaxPool2d(pool_k, pool_stride, pool_pad, ceil_mode=ceil)
        self.dw = nn.Conv2d(c, c, k, stride, padding=dilation * (k // 2), dilation=dilation, groups=c, bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = nn.ReLU6()
        self.pw = nn.Conv2d(c, 2 * c, 1)
        self.gap = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        y = self.pool(self.stem(x))
        y = self.act(self.bn(self.dw(y)))
        return torch.flatten(self.gap(self.pw(y)), 1)


def _randomize_bn(m):
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 2.0)
            mod.weight.data.uniform_(0.5, 1.5)
    return m


def lowered(model, x, options=None):
    """The graph the executor plans on: the pipeline's output with fused ops made direct."""
    r = fxopt.explain(model, x, options=dict({"executor": "torch", "conv_algorithm": "direct"}, **(options or {})))
    return torch_ref.lower(r.graphs[0].after)


def planned(gm):
    out = {}
    for node in gm.graph.nodes:
        for planner in (plan_depthwise, plan_maxpool, plan_global_avgpool):
            c = planner(node)
            if c is not None:
                out.setdefault(type(c), []).append((node, c))
    return out


@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_plans_depthwise_maxpool_and_global_avgpool(layout):
    gm = lowered(MobileBlock().eval(), torch.randn(2, 3, 16, 16), {"layout": layout})
    p = planned(gm)
    assert set(p) == {MaxPool, DepthwiseConv, GlobalAvgPool}
    assert all(len(v) == 1 for v in p.values())  # the stem and the 1x1 conv are not depthwise
    dw = p[DepthwiseConv][0][1]
    assert has_bias(dw.epilogue) and not has_residual(dw.epilogue)  # BN folded into a bias
    assert dw.sources[0].meta["weight_layout"] == "ckk"
    want = "nhwc" if layout == "channels_last" else "nchw"
    assert {c.layout for v in p.values() for _, c in v} == {want}


@needs_nvrtc
def test_region_kernels_compile_and_are_reported():
    r = fxopt.explain(MobileBlock().eval(), torch.randn(2, 3, 16, 16), options={"executor": "cuda"})
    names = [k.name for k in r.kernels]
    assert any(n.startswith("fx_maxpool") for n in names), names
    assert any(n.startswith("fx_dw3x3") for n in names), names
    # the global average pool reads the 1x1 conv's output with the conv's epilogue fused in: one
    # generated reduction kernel (a lone mean would also get the fx_gap template as a candidate)
    assert any({"aten.mean.dim", "conv_epilogue_ref"} <= set(k.ops) for k in r.kernels), names
    assert all(k.compiled for k in r.kernels), [k.error for k in r.kernels if not k.compiled]


def test_executor_generates_the_graphs_code_once_after_its_rewrites(monkeypatch):
    """The cuda executor splits conv epilogues and puts one node per region in the graph, then
    generates the module's code where it is first called (``pipeline.module_of``), not after each
    rewrite: none inside ``attach_kernels``; the emulated kernels then compute what eager does."""
    from fxopt.backends.cuda.runtime import executor

    made, real = [], torch.fx.GraphModule.recompile
    inside, attach = [], executor.attach_kernels
    monkeypatch.setattr(torch.fx.GraphModule, "recompile",
                        lambda self: (made.append(bool(inside) and type(self).__name__ != "RegionReference"),
                                      real(self))[1])
    monkeypatch.setattr(executor, "attach_kernels",
                        lambda *a, **k: (inside.append(1), attach(*a, **k), inside.clear())[1])
    torch.manual_seed(0)
    model, x = MobileBlock().eval(), torch.randn(2, 3, 16, 16)
    r = fxopt.explain(model, x, options={"executor": "cuda", "emulate_kernels": True})
    assert r.graphs[0].executor_details["conv_epilogues_moved"] > 0 and r.kernels
    assert made.count(True) == 0  # not after the splits and the regions (each region's reference: its own)
    compiled = torch.compile(model, backend="fxopt", options={"executor": "cuda", "emulate_kernels": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


@needs_nvrtc
@settings(max_examples=10)  # each example: a compile and 3-6 NVRTC compilations
@given(k=st.sampled_from([1, 3, 5, 7]), stride=st.integers(1, 2), dilation=st.integers(1, 3),
       pool=st.sampled_from([(3, 2, 1, False), (2, 2, 0, False), (3, 2, 0, True), (3, 1, 1, False)]),
       layout=st.sampled_from(["contiguous", "channels_last"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_region_kernels_compile_for_random_configurations(k, stride, dilation, pool, layout, dtype):
    model = MobileBlock(8, k, stride, dilation, *pool).eval().to(dtype)
    r = fxopt.explain(model, torch.randn(1, 3, 13, 13, dtype=dtype), options={"executor": "cuda", "layout": layout})
    names = [kr.name for kr in r.kernels]
    assert any(n.startswith(f"fx_dw{k}x{k}") for n in names), names
    assert any(n.startswith("fx_maxpool") for n in names), names
    assert any("aten.mean.dim" in kr.ops for kr in r.kernels), names
    assert all(kr.compiled for kr in r.kernels), [kr.error for kr in r.kernels if not kr.compiled]


def test_declines_what_the_templates_do_not_cover():
    # channel multiplier 2, dilated max pool, max pool whose indices are returned, mean over C
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 8, 3, groups=4)
            self.pool = nn.MaxPool2d(2, dilation=2)

        def forward(self, x):
            y = self.pool(self.conv(x))
            v, idx = nn.functional.max_pool2d(y, 2, return_indices=True)
            return v.mean(dim=1), idx

    gm = lowered(Odd().eval(), torch.randn(1, 4, 20, 20))
    assert planned(gm) == {}
    # a 9x9 depthwise kernel is beyond the direct template (1..7)
    big = nn.Sequential(nn.Conv2d(8, 8, 9, padding=4, groups=8)).eval()
    assert planned(lowered(big, torch.randn(1, 8, 12, 12))) == {}


def test_candidates_decline_at_run_time_without_a_kernel():
    gm = lowered(MobileBlock().eval(), torch.randn(2, 3, 16, 16))
    for cands in planned(gm).values():
        for node, c in cands:
            assert c.kernel is None  # not compiled here: calling it declines instead of failing
            args = [torch.randn(tuple(a.meta["val"].shape)) if isinstance(a, torch.fx.Node) else a for a in node.args]
            assert c(*args) is None


# ---------------------------------------------------------------------------- GPU: values
def _check_on_gpu(model, x, layout, dtype, tol):
    model = _randomize_bn(model).eval().cuda().to(dtype)
    x = x.cuda().to(dtype)
    if layout == "channels_last":
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    gm = lowered(model, x, {"layout": layout})
    from fxopt.backends.cuda.runtime.executor import _compile
    p = planned(gm)
    cands = [c for v in p.values() for _, c in v]
    info = {"kernels": []}
    _compile(cands, info)
    assert all(k.compiled for k in info["kernels"])
    for node, c in (nc for v in p.values() for nc in v):
        args = []
        for i, a in enumerate(node.args):
            if isinstance(a, torch.fx.Node):
                v = a.meta["val"]
                t = torch.randn(tuple(v.shape), device="cuda", dtype=v.dtype)
                if layout == "channels_last" and t.dim() == 4 and not (isinstance(c, DepthwiseConv) and i == 1):
                    t = t.contiguous(memory_format=torch.channels_last)
                args.append(t)
            else:
                args.append(a)
        with torch.no_grad():
            want, got = node.target(*args), c(*args)
        assert got is not None, f"{c.name} declined"
        want, got = (want[0], got[0]) if isinstance(want, tuple) else (want, got)
        assert got.shape == want.shape and got.dtype == want.dtype
        if got.dim() == 4 and got.shape[2] * got.shape[3] > 1:
            assert got.stride() == want.stride(), (c.name, got.stride(), want.stride())
        assert relative_error(got, want) <= tol, c.name


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@settings(max_examples=6)  # x 6 dtype/layout combinations, each example a compile
@given(c=st.sampled_from([8, 24, 32]), k=st.sampled_from([3, 5, 7]), stride=st.integers(1, 2),
       dilation=st.integers(1, 2), pool=st.sampled_from([(3, 2, 1, False), (2, 2, 0, False), (3, 2, 0, True)]),
       hw=st.integers(9, 23), n=st.integers(1, 3))
def test_region_candidates_match_the_nodes_on_gpu(dtype, layout, c, k, stride, dilation, pool, hw, n):
    model = MobileBlock(c, k, stride, dilation, *pool)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _check_on_gpu(model, torch.randn(n, 3, hw, hw), layout, dtype, tol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_mobile_block_matches_eager_and_measures_region_candidates(dtype, tmp_path):
    m = _randomize_bn(MobileBlock()).eval().cuda().to(dtype)
    graphs = []
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json")}, graphs)
    with torch.no_grad():
        for batch in (1, 4):
            x = torch.randn(batch, 3, 32, 32, device="cuda", dtype=dtype)
            assert relative_error(c(x), m(x)) <= (1e-3 if dtype == torch.float32 else 1e-2)
    choices = graphs[0].executor_details["node_choices"]
    measured = {name for e in choices.values() for name in {**e["ms"], **e.get("pruned", {})}}
    assert {"generated_maxpool", "generated_depthwiseconv"} <= measured, choices
    # the global average pool, with the 1x1 conv's epilogue fused in, is a region measured against its ops
    regions = graphs[0].executor_details["regions"]
    gap = [n for n, r in regions.items() if "aten.mean.dim" in r["ops"]]
    assert gap and {"generated", "reference"} <= set(choices[gap[0]]["ms"]) | set(choices[gap[0]].get("pruned", {})), \
        choices


def test_vectorized_nhwc_depthwise_is_planned_only_for_channels_last_and_whole_vectors():
    from fxopt.backends.cuda.kernels.depthwise_conv import DepthwiseConvVec, plan_depthwise_vec

    for layout, channels, want in (("channels_last", 16, True), ("contiguous", 16, False), ("channels_last", 12, False)):
        model = MobileBlock(channels).eval().half()
        gm = lowered(model, torch.randn(2, 3, 16, 16).half(), {"layout": layout})
        plans = [p for p in (plan_depthwise_vec(n) for n in gm.graph.nodes) if p is not None]
        assert bool(plans) == want, (layout, channels)
        for p in plans:
            assert isinstance(p, DepthwiseConvVec) and p.sources[0].meta["vec"] == 8


@needs_nvrtc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("k,stride,dilation", [(3, 1, 1), (3, 2, 1), (5, 2, 1), (7, 1, 1), (3, 1, 2)])
def test_vectorized_nhwc_depthwise_compiles(dtype, k, stride, dilation):
    from fxopt.backends.cuda.codegen.epilogue import template_epilogue
    from fxopt.backends.cuda.kernels.depthwise_conv import generate_depthwise_conv2d_nhwc_vec
    from fxopt.backends.cuda.compiler import compile_kernel

    h = 9
    oh = (h + 2 * (k // 2) * dilation - dilation * (k - 1) - 1) // stride + 1
    ks = generate_depthwise_conv2d_nhwc_vec(2, 24, h, h, oh, oh, k, stride, (k // 2) * dilation, dilation, dtype,
                                            template_epilogue(True, True, ("silu", ())))
    assert compile_kernel(ks.source, ks.name, "sm_90", (), ks.param_types).compiled


def test_channels_first_candidate_only_for_large_kernel_depthwise_convs_in_channels_last():
    from fxopt.conv_algorithms import NCHW_MIN_KERNEL
    from fxopt.backends.cuda.kernels.conv_library import plan_conv_in_nchw
    from fxopt.ops import fused_conv_ref

    for layout, k, want in (("channels_last", 31, True), ("channels_last", NCHW_MIN_KERNEL, True),
                            ("channels_last", 5, False), ("contiguous", 31, False)):
        gm = lowered(MobileBlock(16, k=k).eval(), torch.randn(2, 3, 32, 32), {"layout": layout})
        convs = [n for n in gm.graph.nodes if n.target is fused_conv_ref]
        chosen = [n for n in convs if plan_conv_in_nchw(n)]
        assert len(chosen) == int(want), (layout, k)
        for n in chosen:  # the depthwise conv, never the stem or the 1x1
            assert n.args[7] == 16 and tuple(n.args[1].meta["val"].shape[2:]) == (k, k)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [8, 2])  # depthwise (8 of 1 channel), few wide groups (2 of 4)
def test_channels_first_candidate_computes_the_conv_and_hands_it_back_channels_last(residual, dtype, groups):
    from fxopt.backends.cuda.kernels.conv_library import conv_in_nchw
    from fxopt.ops import fused_conv_ref

    cl = torch.channels_last
    x = torch.randn(2, 8, 20, 20).to(dtype).contiguous(memory_format=cl)
    w = torch.randn(8, 8 // groups, 9, 9).to(dtype).contiguous(memory_format=cl)
    b = torch.randn(8).to(dtype)
    res = torch.randn(2, 8, 10, 10).to(dtype).contiguous(memory_format=cl) if residual else None
    args = (x, w, b, res, [2, 2], [4, 4], [1, 1], groups, "silu", [])
    got, want = conv_in_nchw(*args), fused_conv_ref(*args)
    assert got.is_contiguous(memory_format=cl) and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 2e-2,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_large_kernel_depthwise_conv_measures_its_channels_first_candidate(batch, tmp_path):
    m = _randomize_bn(MobileBlock(64, k=31)).eval().cuda().half()
    graphs = []
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json")}, graphs)
    x = torch.randn(batch, 3, 64, 64, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        assert relative_error(c(x), m(x)) <= 1e-2
    choices = graphs[0].executor_details["node_choices"]
    assert any("nchw" in {**e["ms"], **e.get("pruned", {})} for e in choices.values()), choices


class _FewGroups(nn.Module):
    def __init__(self, groups, width):
        super().__init__()
        c = groups * width
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.grouped = nn.Conv2d(c, c, 3, padding=1, groups=groups)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.grouped(torch.relu(self.stem(x)))))


@pytest.mark.parametrize("groups,width,want", [(2, 32, True), (4, 16, True), (8, 16, True), (4, 8, False),
                                               (16, 16, False), (1, 32, False)])
def test_channels_first_candidate_for_few_wide_groups_in_channels_last(groups, width, want):
    """A conv of 2-8 groups of 16+ channels each gets the channels-first candidate (cuDNN's channels_last
    kernels slice each group out per call); narrower or more groups, and dense convs, do not."""
    from fxopt.backends.cuda.kernels.conv_library import plan_conv_in_nchw
    from fxopt.ops import fused_conv_ref

    gm = lowered(_FewGroups(groups, width).eval(), torch.randn(2, 3, 8, 8), {"layout": "channels_last"})
    convs = [n for n in gm.graph.nodes if n.target is fused_conv_ref]
    chosen = [n.args[7] for n in convs if plan_conv_in_nchw(n)]
    assert chosen == ([groups] if want else []), (groups, width, chosen)


@pytest.mark.gpu
@needs_gpu
def test_few_wide_groups_conv_measures_its_channels_first_candidate(tmp_path):
    m = _randomize_bn(_FewGroups(2, 64)).eval().cuda().half()
    graphs = []
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json"), "layout": "channels_last"},
                                         graphs)
    x = torch.randn(16, 3, 28, 28, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        assert relative_error(c(x), m(x)) <= 1e-2
    choices = graphs[0].executor_details["node_choices"]
    assert any("nchw" in {**e["ms"], **e.get("pruned", {})} for e in choices.values()), choices
