"""Nearest and bilinear upsampling as index maps (backends/cuda/schedule/index_rules.py), on the
CPU: a gather at compile-time constant indices (AOTAutograd's decomposition of
``F.interpolate(mode="nearest" | "bilinear")``) is lowered as loads of its input at index
expressions, fused with the pointwise ops around it, and its index arithmetic gets no kernel
(bilinear's interpolation weights are folded into constants by ``fold_constants``); gathers at
other indices (read from an input) decline with their reason. Every region's IR against its ATen ops, the compiled model against eager
(values, shapes, strides), the undecomposed upsampling ops against their kernels, and a hypothesis
property over sizes, scales, modes, memory formats and dtypes."""
import itertools
from fractions import Fraction

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxopt.backends import torch_ref
from fxopt.backends.cuda import ir
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda.schedule import index_rules
from fxopt.backends.cuda.schedule.fusion import schedule
from fxopt.backends.cuda.schedule.generated import RegionReference
from fxopt.backends.cuda.schedule.rewrite import rewrite, split_conv_epilogues
from fxopt.testing import check_fusion, compile_with_fxopt
from fxopt.testing.fusion import capture, check_regions
from fxopt.testing.strategies import CNNCase

aten = torch.ops.aten
CL = {"layout": "channels_last"}
CONTIGUOUS = {"layout": "contiguous"}
GATHER = "aten._unsafe_index.Tensor"


class UpBlock(nn.Module):
    """Upsampling, pointwise ops, a convolution (and the upsampled activation returned too where
    ``both``)."""

    def __init__(self, mode="nearest", scale=2, c=4, both=False, align=False):
        super().__init__()
        self.mode, self.scale, self.both = mode, scale, both
        self.kw = {"align_corners": align} if mode == "bilinear" else {}
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        y = torch.relu(F.interpolate(x, scale_factor=self.scale, mode=self.mode, **self.kw) * 2.0 + 1.0)
        return (self.conv(y), y) if self.both else self.conv(y)


class RealGather(nn.Module):
    """Rows picked by an index the caller passes: a gather, not an index map."""

    def __init__(self, c=4):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, rows):
        return self.conv(torch.relu(x[:, :, rows] * 2.0))


def _case(model, shape, dtype=torch.float32, cl=False):
    torch.manual_seed(0)
    m = model.eval().to(dtype)
    x = torch.randn(shape).to(dtype)
    if cl:
        m, x = m.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    return m, x


def _schedule(model, inputs, layout=CL):
    (report, _), = capture(model, inputs, {"executor": "torch", **layout})
    gm = torch_ref.lower(report.after)
    split_conv_epilogues(gm)  # as the cuda executor does
    return gm, schedule(gm, strict=True)


def _ops(sched) -> list:
    return [op for r in sched.regions for op in r.ops]


def _fused_graph(gm, sched):
    """``gm`` with each region replaced by its node, as the cuda executor leaves it."""
    rewrite(gm, sched.regions, [RegionReference(gm, r) for r in sched.regions])
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def _same_strides(t, strides) -> bool:
    return all(d == 1 or a == b for d, a, b in zip(t.shape, t.stride(), strides))


def _compiled_matches_eager(m, inputs, layout, dtype):
    graphs: list = []
    fast = compile_with_fxopt(m, {"executor": "cuda", **layout}, graphs)
    with torch.no_grad():
        got, want = fast(*inputs), m(*inputs)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    tol = 2e-2 if dtype == torch.float16 else 1e-4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
        assert g.shape == w.shape and g.dtype == w.dtype
        assert _same_strides(g, w.stride()), (g.stride(), w.stride())
    return graphs


# ---------------------------------------------------------------------------- structure
@pytest.mark.parametrize("cl", [False, True])
def test_upsample_pointwise_conv_is_one_region_without_gather_or_arange_kernels(cl):
    m, x = _case(UpBlock(), (2, 4, 5, 7), cl=cl)
    gm, sched = _schedule(m, (x,), CL if cl else CONTIGUOUS)
    assert len(sched.regions) == 1, [(r.name, r.ops) for r in sched.regions]
    region, = sched.regions
    assert GATHER in region.ops and "aten.relu.default" in region.ops
    assert [n.op for n in region.inputs] == ["placeholder"]  # reads the input, no index tensor
    assert not any(isinstance(e, ir.Load) and e.buf != 0 for s in region.kernel.stores for e in ir.walk(s.value))
    assert all("conv" in n for n in sched.unfused), sched.unfused  # only the convolution is left
    left = _fused_graph(gm, sched)
    names = [str(n.target) for n in left]
    assert not any("arange" in t or "_unsafe_index" in t or "_to_copy" in t for t in names), names


def test_the_region_reads_its_input_at_halved_coordinates():
    m, x = _case(UpBlock(), (2, 4, 5, 7), cl=True)
    _, sched = _schedule(m, (x,))
    loads = [e for s in sched.regions[0].kernel.stores for e in ir.walk(s.value) if isinstance(e, ir.Load)]
    assert loads and all(any(isinstance(a, ir.index.FloorDiv) and a.div == 2 for a, _ in e.offset.terms)
                         for e in loads), loads


def test_an_index_read_from_an_input_is_a_real_gather_and_declines():
    m, x = _case(RealGather(), (2, 4, 5, 7))
    rows = torch.tensor([4, 0, 1, 1, 2])
    _, sched = _schedule(m, (x, rows), CONTIGUOUS)
    reasons = [w for n, w in sched.unfused.items() if n.startswith("index")]
    assert len(reasons) == 1 and "not a compile-time constant" in reasons[0] and "graph input" in reasons[0], \
        sched.unfused
    assert "aten.index.Tensor" not in _ops(sched)
    check_fusion(CNNCase(m, (x, rows), torch.float32), CONTIGUOUS)
    _compiled_matches_eager(m, (x, rows), CONTIGUOUS, torch.float32)


class ConstantIndex(nn.Module):
    """Rows repeated by a literal list index and columns by ``arange // 2``: constant indices."""

    def forward(self, x):
        y = x[:, :, [0, 0, 1, 1, 2, 2]]
        return torch.sigmoid(y[:, :, :, torch.arange(2 * x.shape[-1], device=x.device) // 2] * 2.0)


def test_constant_list_and_arange_indices_are_index_maps():
    m, x = _case(ConstantIndex(), (2, 3, 3, 5))
    gm, sched = _schedule(m, (x,), CONTIGUOUS)
    assert len(sched.regions) == 1 and not sched.unfused, (_ops(sched), sched.unfused)
    assert sum(n.target is aten.index.Tensor for n in sched.regions[0].covered) == 2
    left = [str(n.target) for n in _fused_graph(gm, sched)]
    assert not any("arange" in t or "index" in t or "lift_fresh" in t for t in left), left
    check_fusion(CNNCase(m, (x,), torch.float32), CONTIGUOUS)
    _compiled_matches_eager(m, (x,), CONTIGUOUS, torch.float32)


@pytest.mark.parametrize("cl", [False, True])
@pytest.mark.parametrize("align", [False, True])
def test_bilinear_upsampling_is_one_region_with_folded_weights(cl, align):
    """Bilinear's four gathers are index maps (the floor of the source position clamped at 0, and
    that plus one clamped at ``n - 1``), its interpolation weights constants folded by
    ``fold_constants``: the upsampling and the pointwise ops around it are one region, and nothing
    but the convolution runs as PyTorch runs it."""
    m, x = _case(UpBlock("bilinear", align=align), (2, 4, 5, 7), cl=cl)
    layout = CL if cl else CONTIGUOUS
    graphs = _compiled_matches_eager(m, (x,), layout, torch.float32)
    low = graphs[0].lowered
    ops = [op for r in low.regions.values() for op in r["ops"]]
    assert len(low.regions) == 1 and GATHER in ops, low.regions
    assert all("conv" in n for n in low.unfused), low.unfused
    assert not any("arange" in r["kernel"] or "clamp" in r["kernel"] for r in low.regions.values())
    folded, = [p.summary for p in graphs[0].passes if p.name == "fold_constants"]
    assert "(2 tensor creations among them: generated constants)" in folded, folded
    for s in check_fusion(CNNCase(m, (x,), torch.float32), layout):
        assert s.unfused.keys() <= {n for n in s.unfused if "conv" in n}, s.unfused


def test_the_executor_reports_one_region_and_no_index_kernels():
    m, x = _case(UpBlock(both=True), (2, 4, 5, 7), cl=True)
    graphs = _compiled_matches_eager(m, (x,), CL, torch.float32)
    lowered = graphs[0].lowered
    ops = [op for r in lowered.regions.values() for op in r["ops"]]
    assert GATHER in ops and not any("arange" in r["kernel"] for r in lowered.regions.values())
    assert all("conv" in n for n in lowered.unfused), lowered.unfused
    assert all(not a.startswith(("arange", "_to_copy", "unsqueeze")) for r in lowered.regions.values()
               for a in r["inputs"])


# ---------------------------------------------------------------------------- the maps
def test_fit_finds_nearest_exact_clamped_and_constant_maps():
    fit = index_rules.fit
    assert fit(list(range(6)), 6, [Fraction(1)]) == index_rules.Map1(1, 0, 1)
    assert fit([i // 2 for i in range(10)], 5, [Fraction(1, 2)]).values(10) == [i // 2 for i in range(10)]
    exact = fit([(2 * i + 1) * 2 // 6 for i in range(7)], 5, [Fraction(2, 3)])
    assert exact is not None and exact.values(7) == [(2 * i + 1) // 3 for i in range(7)]
    clamped = fit([0, 0, 1, 2, 3, 3], 4, [Fraction(5, 6)])
    assert clamped is not None and clamped.hi == 3
    assert fit([3, 3, 3], 5, []) == index_rules.Map1(0, 3, 1)
    half = fit([0, 0, 0, 1, 1, 2, 2, 3], 4, [Fraction(1, 2)])  # bilinear's: floor((i + 0.5) / 2 - 0.5)
    assert half is not None and half.lo == 0 and half.values(8) == [0, 0, 0, 1, 1, 2, 2, 3]
    nxt = fit([1, 1, 1, 2, 2, 3, 3, 3], 4, [Fraction(1, 2)])  # its second neighbour, clamped on both sides
    assert nxt is not None and (nxt.lo, nxt.hi) == (1, 3)
    corners = fit([0, 0, 0, 1, 1, 2], 3, [Fraction(2, 5)])  # align_corners: floor(i * 2 / 5)
    assert corners is not None and corners.values(6) == [0, 0, 0, 1, 1, 2]
    assert fit([2, 0, 1], 3, [Fraction(1)]) is None  # a permutation


def _upsample_graph(op, args, x):
    g = fx.Graph()
    p = g.placeholder("x")
    u = g.call_function(op, (p,) + tuple(args))
    g.output((g.call_function(aten.relu.default, (u,)),))
    gm = fx.GraphModule(nn.Module(), g)
    FakeTensorProp(gm).propagate(x)
    return gm


UNDECOMPOSED = [aten.upsample_nearest2d.vec, aten._upsample_nearest_exact2d.vec]


@pytest.mark.parametrize("op", UNDECOMPOSED, ids=["nearest", "nearest_exact"])
@pytest.mark.parametrize("cl", [False, True])
def test_undecomposed_upsampling_is_an_index_map_matching_its_kernel(op, cl):
    checked = 0
    for h, w, s in itertools.product((1, 2, 3, 5, 7, 9), (1, 4, 6, 9), (2.0, 3.0, 1.5, 0.5, 0.7, 1 / 3, 2.5)):
        x = torch.randn(1, 3, h, w)
        x = x.to(memory_format=torch.channels_last) if cl else x
        try:
            want = op(x, None, [s, s])
        except RuntimeError:
            continue  # an empty output
        gm = _upsample_graph(op, (None, [s, s]), x)
        sched = check_regions(gm, [x], 1e-6, 1e-6)
        assert not sched.unfused and len(sched.regions) == 1, (h, w, s, sched.unfused)
        out = sched.regions[0].kernel.outputs[0]
        assert _same_strides(want, out.strides), (out.strides, want.stride())
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("op", [aten.upsample_nearest2d.default, aten._upsample_nearest_exact2d.default])
def test_undecomposed_with_output_size_and_scales(op):
    x = torch.randn(2, 3, 4, 5)
    for size, scales in [((6, 7), (None, None)), ((6, 7), (1.2, 1.3)), ((9, 2), (2.25, 0.4)), ((3, 5), (None, 1.0))]:
        gm = _upsample_graph(op, (list(size),) + scales, x)
        sched = check_regions(gm, [x], 1e-6, 1e-6)
        assert not sched.unfused, (size, scales, sched.unfused)


def test_a_clamp_that_binds_is_a_choice_between_two_loads():
    x = torch.randn(1, 2, 4, 4)
    gm = _upsample_graph(aten.upsample_nearest2d.default, ([6, 4], 1.2, None), x)
    sched = check_regions(gm, [x], 1e-6, 1e-6)
    k = sched.regions[0].kernel
    assert any(isinstance(e, ir.Where) for s in k.stores for e in ir.walk(s.value))


def test_kernels_rounding_differently_decline():
    """Out == in with a scale that is not 1: the CPU kernel copies, the CUDA kernel scales."""
    x = torch.randn(1, 2, 3, 3)
    gm = _upsample_graph(aten.upsample_nearest2d.vec, (None, [1.3, 1.3]), x)
    sched = schedule(gm, strict=True)
    reason, = sched.unfused.values()
    assert "round the source index" in reason


# ---------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("mode", ["nearest", "nearest-exact", "bilinear"])
@pytest.mark.parametrize("scale", [2, 1.5, 0.5, (2, 3)], ids=str)
@pytest.mark.parametrize("dtype,cl", [(torch.float32, True), (torch.float16, True), (torch.float32, False)])
def test_every_region_matches_its_aten_ops_and_the_model_matches_eager(mode, scale, dtype, cl):
    m, x = _case(UpBlock(mode, scale, both=True), (2, 4, 5, 7), dtype, cl)
    layout = CL if cl else CONTIGUOUS
    scheds = check_fusion(CNNCase(m, (x,), dtype), layout,
                          compile_kernels=nvrtc_available() and dtype == torch.float16 and scale == 1.5)
    for s in scheds:
        assert GATHER in _ops(s) and not any("index" in n or "arange" in n for n in s.unfused), s.unfused
    _compiled_matches_eager(m, (x,), layout, dtype)


# ---------------------------------------------------------------------------- property
class Upsample(nn.Module):
    def __init__(self, mode, scale, align=False):
        super().__init__()
        self.mode, self.scale = mode, scale
        self.kw = {"align_corners": align} if mode == "bilinear" else {}

    def forward(self, x):
        return F.interpolate(x, scale_factor=self.scale, mode=self.mode, **self.kw) * 2.0 - 1.0


@settings(max_examples=12, deadline=None)
@given(h=st.integers(1, 9), w=st.integers(1, 9), scale=st.sampled_from([2, 3, 1.5, 0.5, (2, 3)]),
       mode=st.sampled_from(["nearest", "nearest-exact", "bilinear"]), align=st.booleans(), cl=st.booleans(),
       half=st.booleans())
def test_property_upsampling_matches_eager(h, w, scale, mode, align, cl, half):
    sh, sw = scale if isinstance(scale, tuple) else (scale, scale)
    assume(int(h * sh) > 0 and int(w * sw) > 0)
    dtype = torch.float16 if half else torch.float32
    m, x = _case(Upsample(mode, scale, align), (2, 3, h, w), dtype, cl)
    layout = CL if cl else CONTIGUOUS
    for s in check_fusion(CNNCase(m, (x,), dtype), layout):
        assert GATHER in _ops(s) and not s.unfused, s.unfused
    _compiled_matches_eager(m, (x,), layout, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode,scale", [("nearest", 2), ("nearest", 1.5), ("nearest-exact", 3), ("nearest", (2, 3)),
                                        ("bilinear", 2), ("bilinear", 1.5), ("bilinear", 0.5)])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_upsampling_fused_on_the_gpu_gives_eagers_results(mode, scale, fmt):
    """The generated kernel with the upsampling's index map runs on the GPU: eager's values, shapes
    and strides, and no gather left on the reference executor."""
    from fxopt.testing import compile_with_fxopt

    torch.manual_seed(0)
    m = UpBlock(mode, scale, c=16, both=True).cuda().half().eval().to(memory_format=fmt)
    x = torch.randn(3, 16, 7, 5, device="cuda", dtype=torch.float16).contiguous(memory_format=fmt)
    graphs = []
    c = compile_with_fxopt(m, {"executor": "cuda", "autotune_cache": False}, graphs)
    with torch.no_grad():
        got, want = c(x), m(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
        assert g.shape == w.shape and g.stride() == w.stride()
    unfused = graphs[0].lowered.unfused
    assert not any("_unsafe_index" in k for k in unfused), unfused
    torch.compiler.reset()
