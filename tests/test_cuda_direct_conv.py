"""Direct convolution (+ fused max pool) kernels, backends/cuda/codegen/direct_conv.py and schedule/conv.py: which convs and
conv -> pool pairs they take and decline, that every generated variant compiles with NVRTC (CPU),
the executor's pair rewrite (CPU, with the measurement stubbed), and that the kernels compute
what PyTorch computes (GPU, hypothesis over shapes, layouts and dtypes)."""
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
from fxopt.backends.cuda.runtime import executor as X, measure
from fxopt.backends.cuda.runtime import groups
from fxopt.backends.cuda.codegen.epilogue import has_residual, template_epilogue
from fxopt.backends.cuda.kernels.direct_conv import MAX_UNROLLED, cout_tile, generate_direct_conv2d
from fxopt.backends.cuda.compiler import compile_many, nvrtc_available
from fxopt.backends.cuda.kernels.direct_conv import launch_direct_conv2d
from fxopt.backends.cuda.kernels.direct_conv import plan_conv_maxpool, plan_conv_maxpool_groups, plan_direct_conv
from fxopt.ops import fused_conv_ref
from fxopt.testing.models import SeedCNN
from fxopt.tolerances import relative_error

aten = torch.ops.aten
needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def lowered(model, x, options=None):
    r = fxopt.explain(model, x, options=dict({"executor": "torch", "conv_algorithm": "direct"}, **(options or {})))
    return torch_ref.lower(r.graphs[0].after)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


# ---------------------------------------------------------------------------- planning (CPU)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_plans_both_seedcnn_convs_and_both_conv_pool_pairs(layout):
    gm = lowered(SeedCNN().eval(), torch.randn(2, 3, 32, 32), {"layout": layout})
    convs = [n for n in gm.graph.nodes if n.target is fused_conv_ref]
    assert len(convs) == 2
    for node in convs:
        cands = plan_direct_conv(node)
        assert 2 <= len(cands) <= 3 and len({c.label for c in cands}) == len(cands)
        smallest = min(c.sources[0].meta["cout_tile"] for c in cands)
        split = [c.sources[0].meta for c in cands if "_split" in c.label]
        # batch 2: few pixels, so the smallest tile is also measured with its input channels split
        # over lanes (3 -> 4 lanes, 6 -> 8)
        assert len(split) == 1 and split[0]["split"] == {3: 4, 6: 8}[node.args[0].meta["val"].shape[1]]
        assert split[0]["cout_tile"] == smallest
        for c in cands:
            assert c.spec["epilogue"] == template_epilogue(True, False, ("relu", ()))
            assert c.spec["layout"] == ("nhwc" if layout == "channels_last" else "nchw")
            assert c.pool is None and c.conv_size == tuple(node.meta["val"].shape[2:])
    pools = [n for n in gm.graph.nodes if n.target is aten.max_pool2d_with_indices.default]
    pairs = [plan_conv_maxpool(p) for p in pools]
    assert [conv for conv, _ in pairs] == convs
    for conv, cands in pairs:
        assert all(c.pool == ((2, 2), (2, 2), (0, 0), False) for c in cands)
        assert all(c.sources[0].meta["pool"] == c.pool for c in cands)


def test_declines_what_the_template_does_not_cover():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.grouped = nn.Conv2d(4, 8, 3, groups=2)
            self.big = nn.Conv2d(8, 8, 9)   # 8 * 81 = 648 > 512
            self.shared = nn.Conv2d(8, 4, 1)

        def forward(self, x):
            y = self.big(self.grouped(x))
            s = torch.relu(self.shared(y))
            v, idx = F.max_pool2d(s, 2, return_indices=True)  # indices used
            return F.max_pool2d(s, 2) + v, idx                 # the conv has two users

    gm = lowered(Odd().eval(), torch.randn(1, 4, 20, 20))
    by_name = {n.name: n for n in gm.graph.nodes}
    convs = [n for n in gm.graph.nodes if n.target is fused_conv_ref]
    assert [len(plan_direct_conv(c)) > 0 for c in convs] == [False, False, True]
    assert all(plan_conv_maxpool(n) is None for n in by_name.values())


def test_a_forced_algorithm_is_kept_and_an_automatic_one_is_measured_against():
    gm = lowered(SeedCNN().eval(), torch.randn(2, 3, 32, 32), {"conv_algorithm": "gemm"})
    convs = [n for n in gm.graph.nodes if n.target is fused_conv_ref]
    assert [(c.args[10], c.meta["fxopt_conv_algorithm_how"]) for c in convs] == [("gemm", "forced")] * 2
    pools = [n for n in gm.graph.nodes if n.target is aten.max_pool2d_with_indices.default]
    assert not any(plan_direct_conv(c) for c in convs)  # the user asked for gemm: nothing competes
    assert all(plan_conv_maxpool(p) is None for p in pools)
    for c in convs:  # the same choice made by measuring: the generated kernels are candidates
        c.meta["fxopt_conv_algorithm_how"] = "measured"
    assert all(len(plan_direct_conv(c)) >= 2 for c in convs)
    assert [plan_conv_maxpool(p)[0] for p in pools] == convs
    del convs[0].meta["fxopt_conv_algorithm_how"]  # a graph that never went through the pass
    assert not plan_direct_conv(convs[0]) and plan_conv_maxpool(pools[0]) is None


@pytest.mark.parametrize("algorithm", ["fft", "gemm"])
def test_measuring_inputs_prepack_the_random_weight(algorithm):
    """A conv with a prepacked weight is measured with the prepacking of the random weight it is
    given, so the reference and the generated candidates compute the same convolution."""
    gm = lowered(SeedCNN().eval(), torch.randn(2, 3, 32, 32), {"conv_algorithm": algorithm})
    conv = next(n for n in gm.graph.nodes if n.target is fused_conv_ref)
    assert conv.args[10] == algorithm
    args = measure.real_args(conv)
    with torch.no_grad():
        got = fused_conv_ref(*args)
        want = fused_conv_ref(*args[:10], "direct", None)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_conv_with_a_residual_gets_no_pool_fusion():
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return F.max_pool2d(torch.relu(self.conv(x) + x), 2)

    gm = lowered(Res().eval(), torch.randn(1, 4, 8, 8))
    conv = next(n for n in gm.graph.nodes if n.target is fused_conv_ref)
    assert plan_direct_conv(conv) and has_residual(plan_direct_conv(conv)[0].spec["epilogue"])
    assert all(plan_conv_maxpool(n) is None for n in gm.graph.nodes)


def test_cout_tile_keeps_enough_threads_and_fits_shared_memory():
    assert cout_tile(1 << 20, 64, 27) == 16           # plenty of pixels: the widest tile
    assert cout_tile(196, 6, 75) == 1                 # batch 1: one channel per thread
    assert cout_tile(1 << 20, 16, 512) * 512 <= 12288
    assert cout_tile(1 << 20, 64, 147) * 147 <= MAX_UNROLLED  # a 7x7 stem: NVRTC-friendly unrolling
    from fxopt.backends.cuda.kernels.direct_conv import _tiles
    stem = {"cin": 3, "cout": 64, "k": (7, 7)}
    assert all(t * 147 <= MAX_UNROLLED for t in _tiles(stem, torch.empty(1, 64, 112, 112)))
    with pytest.raises(ValueError):
        generate_direct_conv2d(16, 8, 3, epilogue=template_epilogue(residual=True), pool=((2, 2), (2, 2), (0, 0)))
    with pytest.raises(ValueError):
        generate_direct_conv2d(64, 8, 3)              # reduction 576
    with pytest.raises(ValueError):
        generate_direct_conv2d(3, 8, 3, weight_layout="hwio")


def test_split_variant_only_for_few_pixels():
    from fxopt.backends.cuda.kernels.direct_conv import FEW_PIXELS
    gm = lowered(SeedCNN().eval(), torch.randn(64, 3, 32, 32))  # 64 x 28 x 28 outputs: many pixels
    conv = next(n for n in gm.graph.nodes if n.target is fused_conv_ref)
    assert 64 * 28 * 28 > FEW_PIXELS and not any("split" in c.label for c in plan_direct_conv(conv))
    with pytest.raises(ValueError, match="split"):
        generate_direct_conv2d(3, 6, 5, split=3)
    from fxopt.backends.cuda.kernels.direct_conv import split_lanes
    assert [split_lanes(c) for c in (1, 2, 3, 6, 16)] == [1, 2, 4, 8, 8]


def test_launch_checks_weight_and_channels_before_launching():
    ks = generate_direct_conv2d(3, 6, 5, epilogue=template_epilogue(bias=True))
    x, out = torch.randn(1, 3, 8, 8), torch.empty(1, 6, 4, 4)
    with pytest.raises(ValueError, match="weight"):
        launch_direct_conv2d(ks, x, torch.randn(6, 3, 3, 3), out, torch.randn(6))
    with pytest.raises(ValueError, match="weight"):
        w = torch.randn(6, 3, 5, 5).contiguous(memory_format=torch.channels_last)
        launch_direct_conv2d(ks, x, w, out, torch.randn(6))
    with pytest.raises(ValueError, match="bias"):
        launch_direct_conv2d(ks, x, torch.randn(6, 3, 5, 5), out, None)
    assert launch_direct_conv2d(ks, x[:0], torch.randn(6, 3, 5, 5), out[:0], torch.randn(6)).numel() == 0


@needs_nvrtc
@settings(max_examples=12, deadline=None)  # each example: 1 NVRTC compilation
@given(cin=st.integers(1, 8), cout=st.integers(1, 24), k=st.integers(1, 7), stride=st.integers(1, 3),
       padding=st.integers(0, 3), dilation=st.integers(1, 2),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       layout=st.sampled_from(["nchw", "nhwc"]), wl=st.sampled_from(["oihw", "ohwi"]),
       pool=st.sampled_from([None, ((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 2), (1, 1))]),
       bias=st.booleans(), act=st.sampled_from([None, "relu", ("hardtanh", (0.0, 6.0)), "silu"]),
       tile=st.integers(1, 16), split=st.sampled_from([1, 2, 4, 8]))
def test_every_variant_compiles_with_nvrtc(cin, cout, k, stride, padding, dilation, dtype, layout, wl, pool,
                                           bias, act, tile, split):
    ks = generate_direct_conv2d(cin, cout, k, stride, padding, dilation, dtype, layout, template_epilogue(bias, False, act),
                                wl, pool, min(tile, cout), split=split)
    assert ("__shfl_xor_sync" in ks.source) == (split > 1)
    (compiled,) = compile_many([ks])
    assert compiled.pdl_safe
    assert compiled.compiled


# ---------------------------------------------------------------------------- executor rewrite (CPU)
@needs_nvrtc
def test_pair_rewrite_replaces_conv_and_pool_and_keeps_values(monkeypatch):
    model = SeedCNN().eval()
    x = torch.randn(2, 3, 32, 32)
    gm = lowered(model, x)
    pairs = plan_conv_maxpool_groups(gm.graph)
    assert [g.nodes for g in pairs] == [[c, p] for p in gm.graph.nodes if (c := (plan_conv_maxpool(p) or [None])[0])]
    assert all(g.keep_out == {g.nodes[1], *g.nodes[1].users} for g in pairs)
    info = {"kernels": []}
    X._compile([c for g in pairs for c in g.candidates], info)
    assert info["kernels"] and all(k.compiled for k in info["kernels"])

    def fake_measure(node, candidates, graphed):  # the generated candidate "wins"
        gen = sorted(n for n in candidates if n != "reference")[0]
        return {"ms": {n: (1.0 if n == gen else 2.0) for n in candidates}, "errors": {}, "choice": gen}

    monkeypatch.setattr(measure, "measure", fake_measure)
    from fxopt.autotune import AutotuneCache
    decisions = {}

    class Ctx:
        measurements = 0

    tuning = measure.Tuning(AutotuneCache(None), "dev", True, Ctx)
    for g in pairs:
        assert groups.fuse_group(gm, g, tuning, decisions)
    gm.graph.lint()
    gm.recompile()
    assert aten.max_pool2d_with_indices.default not in targets(gm)
    assert fused_conv_ref not in targets(gm)
    assert sum(getattr(t, "__name__", "").startswith("fx_dconv_pool") for t in targets(gm)) == 2
    assert len(decisions) == 2 and all("+" in k for k in decisions)
    with torch.no_grad():  # on the CPU the candidates decline and the chained reference runs
        torch.testing.assert_close(gm(*_inputs_by_shape(gm, model, x))[0], model(x))


def _inputs_by_shape(gm, model, x):
    """The lowered graph's inputs (parameters and x, in the graph's order): every SeedCNN tensor
    has a shape of its own."""
    by_shape = {tuple(p.shape): p for p in model.parameters()}
    by_shape[tuple(x.shape)] = x
    return [by_shape[tuple(n.meta["val"].shape)] for n in gm.graph.nodes if n.op == "placeholder"]


# ---------------------------------------------------------------------------- GPU: values
def _reference(x, w, b, res, stride, padding, dilation, act, pool):
    """In float64: fp32 convolutions through cuDNN may use TF32."""
    y = F.conv2d(x.double(), w.double(), None if b is None else b.double(), stride, padding, dilation)
    if res is not None:
        y = y + res.double()
    y = {None: y, "relu": torch.relu(y), "silu": F.silu(y)}[act] if not isinstance(act, tuple) else y.clamp(0, 6)
    if pool is not None:
        y = F.max_pool2d(y, pool[0], pool[1], pool[2], ceil_mode=pool[3])
    return y


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), cin=st.integers(1, 8), cout=st.integers(1, 24), k=st.integers(1, 7),
       stride=st.integers(1, 3), padding=st.integers(0, 3), dilation=st.integers(1, 2), hw=st.integers(7, 20),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       layout=st.sampled_from(["nchw", "nhwc"]), wl=st.sampled_from(["oihw", "ohwi"]),
       pool=st.sampled_from([None, ((2, 2), (2, 2), (0, 0), False), ((3, 3), (2, 2), (1, 1), False),
                             ((3, 3), (2, 2), (0, 0), True), ((2, 2), (1, 1), (0, 0), False)]),
       bias=st.booleans(), residual=st.booleans(), act=st.sampled_from([None, "relu", ("hardtanh", (0.0, 6.0)), "silu"]),
       tile=st.integers(1, 16), split=st.sampled_from([1, 2, 4, 8]))
def test_kernels_match_pytorch_on_gpu(n, cin, cout, k, stride, padding, dilation, hw, dtype, layout, wl, pool,
                                      bias, residual, act, tile, split):
    from fxopt.backends.cuda.kernels.pool import pool2d_output_size

    ch = (hw + 2 * padding - dilation * (k - 1) - 1) // stride + 1
    if ch < 1 or (pool is not None and ch < pool[0][0]):
        return
    residual = residual and pool is None
    mf = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = torch.randn(n, cin, hw, hw, device="cuda", dtype=dtype).contiguous(memory_format=mf)
    w = (torch.randn(cout, cin, k, k, device="cuda", dtype=dtype) * 0.2).contiguous(
        memory_format=torch.channels_last if wl == "ohwi" else torch.contiguous_format)
    b = torch.randn(cout, device="cuda", dtype=dtype) if bias else None
    res = torch.randn(n, cout, ch, ch, device="cuda", dtype=dtype).contiguous(memory_format=mf) if residual else None
    ks = generate_direct_conv2d(cin, cout, k, stride, padding, dilation, dtype, layout,
                                template_epilogue(bias, residual, act), wl, pool and pool[:3], min(tile, cout), split=split)
    oh = ch if pool is None else pool2d_output_size(ch, ch, *pool)[0]
    out = torch.empty(n, cout, oh, oh, device="cuda", dtype=dtype).contiguous(memory_format=mf)
    launch_direct_conv2d(ks, x, w, out, b, res, (ch, ch))
    want = _reference(x, w, b, res, stride, padding, dilation, act, pool)
    assert relative_error(out.double(), want) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch", [1, 64])
def test_compiled_seedcnn_matches_eager_and_measures_the_fused_pair(dtype, batch, tmp_path):
    m = SeedCNN().eval().cuda().to(dtype)
    graphs = []
    # the algorithm of each conv is measured (under compute-sanitizer conv2 once chose gemm): the
    # generated conv + pool is measured against whichever was chosen
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json")}, graphs)
    x = torch.randn(batch, 3, 32, 32, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double())  # fp32 convs (eager's and cuDNN's here) may use TF32
        assert relative_error(c(x), want) <= (2e-3 if dtype == torch.float32 else 1e-2)
    choices = graphs[0].executor_details["node_choices"]
    pairs = {k: v for k, v in choices.items() if "+" in k and "max_pool" in k}
    assert len(pairs) == 2, choices
    for entry in pairs.values():
        assert any(name.startswith("generated_directconv_maxpool") for name in {**entry["ms"], **entry.get("pruned", {})}), \
            entry


def test_measuring_prunes_a_candidate_far_slower_than_the_fastest(monkeypatch):
    """A candidate whose plain runs take more than 10x the fastest timed one plus 0.5 ms is not
    timed as a CUDA graph (about 110 of its runs) and is not chosen; one within the bound is timed,
    and the fastest wins. The first candidate (the reference) is always timed. A fake clock by name."""
    gm = lowered(SeedCNN().eval(), torch.randn(2, 3, 32, 32))
    conv = next(n for n in gm.graph.nodes if n.target is fused_conv_ref)
    graphed_ms = {"reference": 0.2, "near": 1.9, "far": 30.0, "best": 0.1}
    plain = {"near": 2.4, "far": 31.0, "best": 0.15}  # near: 2.4 <= 10 * 0.2 + 0.5
    timed = []

    def named(name):
        def run(*args):
            return fused_conv_ref(*args)
        run.label = name
        return run

    def fake_graphed(fn, args, reps=1, iters=10):
        timed.append(fn.label)
        return graphed_ms[fn.label]

    monkeypatch.setattr(measure, "time_graphed_ms", fake_graphed)
    monkeypatch.setattr(measure, "plain_ms", lambda fn, args, runs=2: plain[fn.label])
    cands = {n: named(n) for n in ("reference", "near", "far", "best")}
    r = measure.measure(conv, cands, graphed=True)
    assert timed == ["reference", "near", "best"]
    assert r["pruned"] == {"far": 31.0} and "far" not in r["ms"] and r["errors"]["far"] == 0.0
    assert r["choice"] == "best"
    # the bound follows the fastest timed so far: after "best" (0.1 ms), "near" is pruned too
    timed.clear()
    r = measure.measure(conv, {n: cands[n] for n in ("reference", "best", "near", "far")}, graphed=True)
    assert timed == ["reference", "best"] and set(r["pruned"]) == {"near", "far"} and r["choice"] == "best"
