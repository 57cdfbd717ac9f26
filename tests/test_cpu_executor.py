"""The cpu executor: oneDNN fused convolutions with packed weights, and the runner that keeps the
faster of the optimized and the unoptimized graph (fxopt.backends.cpu)."""
from __future__ import annotations

import re
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fxopt
from fxopt.backends import cpu, cpu_timing
from fxopt.testing import SeedCNN
from fxopt.ops import ACTIVATIONS, fused_conv_ref

pytestmark = pytest.mark.skipif(cpu.onednn_available() is not None, reason=str(cpu.onednn_available()))

PARAMS = {"hardtanh": [-1.0, 2.0], "leaky_relu": [0.1]}
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=5e-2)}


class Block(nn.Module):
    """conv-bn-relu, conv-bn + residual, relu: what the oneDNN path exists for."""

    def __init__(self, c=16):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        y = F.relu(self.b1(self.c1(x)))
        y = F.relu(self.b2(self.c2(y)) + x)
        return self.head(y.mean((2, 3)))


def _randomized(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


# -- OneDnnConv against the reference ----------------------------------------------------------
@given(act=st.sampled_from(sorted(ACTIVATIONS)), residual=st.booleans(), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), groups=st.sampled_from([1, 2, 4]),
       stride=st.sampled_from([1, 2]), k=st.sampled_from([1, 3]), n=st.integers(1, 3), hw=st.integers(3, 9),
       nhwc=st.booleans())
def test_onednn_conv_matches_the_reference(act, residual, bias, dtype, groups, stride, k, n, hw, nhwc):
    if cpu.dtype_unsupported(dtype):
        return
    g = torch.Generator().manual_seed(n * 100 + hw)
    fmt = torch.channels_last if nhwc else torch.contiguous_format
    x = torch.randn(n, 8, hw, hw, generator=g).to(dtype).contiguous(memory_format=fmt)
    w = (torch.randn(8, 8 // groups, k, k, generator=g) / (8 // groups * k * k) ** 0.5).to(dtype)
    b = torch.randn(8, generator=g).to(dtype) if bias else None
    pad = [k // 2] * 2
    ref_shape = F.conv2d(x, w, None, stride, pad, 1, groups).shape
    r = torch.randn(ref_shape, generator=g).to(dtype).contiguous(memory_format=fmt) if residual else None
    params = PARAMS.get(act, [])
    conv = cpu.OneDnnConv([stride] * 2, pad, [1, 1], groups, act, params, nhwc=nhwc)
    got = conv(x, w, b, r)
    want = fused_conv_ref(x, w, b, r, [stride] * 2, pad, [1, 1], groups, act, params)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert got.stride() == want.stride() and got.dtype == want.dtype


def test_weight_is_packed_once_and_again_after_an_in_place_change():
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(8, 8, 3, 3), torch.randn(8)
    conv = cpu.OneDnnConv([1, 1], [1, 1], [1, 1], 1, "relu", [])
    conv(x, w, b, None)
    conv(x, w, b, None)
    assert conv.packs == 1
    w.mul_(-1.0)  # what an optimizer step does
    got = conv(x, w, b, None)
    assert conv.packs == 2
    torch.testing.assert_close(got, F.relu(F.conv2d(x, w, b, padding=1)))


def test_a_call_in_another_memory_format_falls_back_to_the_reference(monkeypatch):
    x, w = torch.randn(1, 8, 5, 5), torch.randn(8, 8, 3, 3)
    nhwc = cpu.OneDnnConv([1, 1], [1, 1], [1, 1], 1, "relu", [], nhwc=True)
    nchw = cpu.OneDnnConv([1, 1], [1, 1], [1, 1], 1, "relu", [], nhwc=False)
    with monkeypatch.context() as m:  # neither may reach oneDNN here
        m.setattr(cpu, "_CONV_POINTWISE", None)
        got = nhwc(x, w, None, None)
        assert nchw(x.contiguous(memory_format=torch.channels_last), w, None, None).is_contiguous(
            memory_format=torch.channels_last)
    assert nhwc.packs == 0 and got.is_contiguous()
    torch.testing.assert_close(got, F.relu(F.conv2d(x, w, padding=1)))
    assert nchw(x, w, None, None).is_contiguous() and nchw.packs == 0  # NCHW: the weight unpacked


# -- the lowering: which convs it takes, and why not --------------------------------------------
def test_explain_shows_onednn_convs_and_declined_ones():
    m, x = _randomized(Block()), torch.randn(2, 3, 12, 12)
    r = fxopt.explain(m, x)
    g = r.graphs[0]
    assert g.executor == "cpu"
    assert g.executor_details["onednn"]["convs"] == 3
    text = str(r)
    assert "3 convolutions as fused oneDNN calls" in text and "runs the" in text
    forced = fxopt.explain(m, x, options={"conv_algorithm": {"c1": "winograd_2x2_3x3", "*": "direct"}})
    declined = forced.graphs[0].executor_details["onednn"]["declined"]
    assert list(declined.values()) == ["algorithm winograd_2x2_3x3"]
    nchw = fxopt.explain(m, x, options={"layout": "contiguous"})
    assert nchw.graphs[0].executor_details["onednn"] == {"convs": 3, "declined": {}}
    assert not any(isinstance(mod, cpu.OneDnnConv) and mod.nhwc for mod in nchw.graphs[0].executor_details[
        "cpu_runner"].fn.modules())


def test_torch_executor_keeps_nchw_and_no_onednn():
    r = fxopt.explain(_randomized(Block()), torch.randn(2, 3, 12, 12), options={"executor": "torch"})
    g = r.graphs[0]
    assert g.executor == "torch" and "onednn" not in g.executor_details
    assert any("keeps NCHW on CPU" in p.summary for p in g.passes if p.name == "layout")


class _PermutedHead(nn.Module):
    """CPU fuzz e64f6c30d5 (seed 191): convolutions on a channels_last input, then a channels-last
    permute that a linear layer views flat."""

    def __init__(self):
        super().__init__()
        self.c0, self.c1 = nn.Conv2d(2, 2, 1, bias=False), nn.Conv2d(2, 2, 1, bias=False)
        self.bn, self.fc0, self.fc1 = nn.BatchNorm2d(2), nn.Linear(2, 1), nn.Linear(1, 2, bias=False)

    def forward(self, x):
        x = x - x.mean((1,), keepdim=True)
        x = torch.abs(self.c0(x))
        x = torch.abs(self.bn(self.c1(x)) + x)
        return self.fc1(F.gelu(self.fc0(x.permute(0, 2, 3, 1)))).permute(0, 3, 1, 2)


def test_a_view_the_new_formats_would_refuse_reads_a_contiguous_copy():
    """The layout pass propagates its formats before it drops redundant conversions; a view that
    their strides would refuse reads a contiguous copy instead of failing the pass (the model ran
    unoptimized, with a warning). Eager's values and strides."""
    import warnings

    m = _PermutedHead().eval()
    x = torch.randn(2, 2, 2, 1).contiguous(memory_format=torch.channels_last)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxopt.FxoptFallbackWarning)
        r = fxopt.explain(m, x, options={"executor": "cpu", "cpu_onnxruntime": False, "autotune_cache": False})
        compiled = torch.compile(m, backend="fxopt", options={"cpu_onnxruntime": False, "autotune_cache": False})
        with torch.no_grad():
            got, want = compiled(x), m(x)
    (layout,) = [p for g in r.graphs for p in g.passes if p.name == "layout"]
    assert layout.changed and "kept before views" in layout.summary, layout.summary
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.stride() == want.stride()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_model_matches_eager_and_sees_weight_updates(dtype):
    if cpu.dtype_unsupported(dtype):
        pytest.skip("no bfloat16 oneDNN here")
    m = _randomized(Block()).to(dtype)
    x = torch.randn(2, 3, 12, 12, dtype=dtype)
    compiled = torch.compile(m, backend="fxopt", options={"baseline_check": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), **TOL[dtype])
        m.c1.weight.mul_(0.5)  # in place, as an optimizer step: folded and packed weights refresh
        m.b2.running_var.mul_(2.0)
        torch.testing.assert_close(compiled(x), m(x), **TOL[dtype])


# -- the runner: never slower than the unoptimized graph ----------------------------------------
def _slow(ms: float, tag: str):
    def fn(*args):
        time.sleep(ms / 1e3)
        return tag

    return fn


def test_runner_runs_the_faster_graph_per_signature():
    runner = cpu.CpuRunner(_slow(8, "optimized"), _slow(1, "baseline"), static_indices=[1], rounds=3)
    w = torch.ones(3)
    assert runner(torch.ones(2, 3), w) == "baseline"
    assert runner(torch.ones(2, 3), w) == "baseline"
    (d,) = runner.decisions()
    assert d["runs"] == "baseline graph" and d["baseline_ms"] < d["optimized_ms"]
    runner.fn = _slow(0, "optimized")  # another signature is decided afresh
    assert runner(torch.ones(4, 3), w) == "optimized"
    assert [d["runs"] for d in runner.decisions()] == ["baseline graph", "optimized graph"]


def test_runner_keeps_the_optimized_graph_on_a_tie_and_without_a_baseline():
    tie = cpu.CpuRunner(_slow(2, "optimized"), _slow(2, "baseline"), static_indices=[], margin=0.5, rounds=3)
    assert tie(torch.ones(1)) == "optimized"
    assert tie(torch.ones(1)) == "optimized" and tie.decisions()[0]["runs"] == "optimized graph"
    alone = cpu.CpuRunner(_slow(0, "optimized"), None, static_indices=[])
    assert alone(torch.ones(1)) == "optimized" and alone.decisions()[0]["why"] == "no alternative"


def test_runner_times_a_bounded_number_of_signatures():
    calls = []
    runner = cpu.CpuRunner(lambda *a: calls.append("o") or "optimized", _slow(0, "baseline"), static_indices=[],
                           rounds=3, max_timed=2)
    runner.fn = _slow(20, "optimized")  # far apart: a loaded host's hiccup does not reverse them
    runner(torch.ones(1))
    runner(torch.ones(2))  # two signatures timed: the baseline won both
    runner.fn = lambda *a: calls.append("o") or "optimized"
    assert runner(torch.ones(3)) == "baseline" and calls == []  # the third is not timed
    assert runner.decisions()[-1]["why"].startswith("2 signatures timed")


def test_runner_checks_the_majority_way_at_a_signature_it_does_not_time():
    def slow_double(x):
        time.sleep(0.02)
        return x * 2

    factor = [2.0]
    runner = cpu.CpuRunner(slow_double, None, static_indices=[], rounds=3, max_timed=1,
                           onnxruntime=lambda x: x * factor[0])
    runner(torch.ones(1))
    assert runner.decisions()[0]["runs"] == "onnxruntime"
    factor[0] = 3.0  # wrong from now on: the next signature, not timed, keeps the optimized graph
    torch.testing.assert_close(runner(torch.ones(2)), torch.full((2,), 2.0))
    d = runner.decisions()[-1]
    assert d["runs"] == "optimized graph" and "onnxruntime" in d["failed"] and d["why"].startswith("1 signatures")


def test_runner_decisions_are_cached_across_compiles(tmp_path):
    from fxopt.autotune import AutotuneCache

    cache = (AutotuneCache.for_option(str(tmp_path / "tune.json")), "cpu-test", "code")
    first = cpu.CpuRunner(_slow(6, "optimized"), _slow(0, "baseline"), static_indices=[], decisions_cache=cache,
                          rounds=3)
    first(torch.ones(2))
    calls = []
    second = cpu.CpuRunner(_slow(0, "optimized"), lambda *a: calls.append(1) or "baseline", static_indices=[],
                           decisions_cache=cache)
    assert second(torch.ones(2)) == "baseline" and calls == [1]  # no timing: one call
    assert second.decisions()[0]["cached"] is True


def test_report_names_the_graph_that_runs():
    r = fxopt.explain(_randomized(Block()), torch.randn(2, 3, 12, 12))
    (d,) = r.graphs[0].executor_details["cpu_runner"].decisions()
    assert d["runs"] in cpu.CpuRunner.KEYS and d["threads"] == torch.get_num_threads()


def test_report_shows_every_way_it_timed():
    """The CPU table of ``fxopt explain`` gives the time of every way the runner timed (ONNX
    Runtime with one thread and OpenVINO too, where installed) beside the one that runs."""
    r = fxopt.explain(_randomized(Block()), torch.randn(2, 3, 12, 12),
                      options={"cpu_openvino": True, "autotune_cache": False})
    (d,) = r.graphs[0].executor_details["cpu_runner"].decisions()
    names = {"optimized_ms": "optimized", "baseline_ms": "unoptimized", "onnxruntime_ms": "ONNX Runtime",
             "onnxruntime_1t_ms": "ONNX Runtime 1 thread", "openvino_ms": "OpenVINO"}
    line = next(ln for ln in r.cpu_table().splitlines() if ln.strip().startswith("runs the"))
    for key, name in names.items():
        shown = re.search(rf"{re.escape(name)} (\d+\.\d{{3}}) ms", line)
        assert (shown is not None) == (key in d), (key, line)
        assert shown is None or shown.group(1) == f"{d[key]:.3f}", (key, line)


def test_fixed_weights_onnxruntime_session_bound_once_per_signature():
    """Where no weight is watched (a package's), the runner keeps, per signature, a call bound to ONNX
    Runtime's session of that signature; evicted (more signatures than the sessions kept), the bound
    call takes the full path and builds it again. Watched weights: a bound call that checks them.
    Eager's values."""
    pytest.importorskip("onnxruntime")
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.backends.onnxrt import OrtRunner

    def f(x, w, b):
        return (F.conv2d(x, w, b, padding=1).relu(),)

    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    gm = make_fx(f)(x, w, b)
    params = {n.name for n in gm.graph.nodes if n.op == "placeholder"} - {"x_1"}
    ort = OrtRunner(gm, params, {}, "CPUExecutionProvider", False, max_sessions=1, spin="short", fallback=False,
                    watch=False)
    def slow(*args):
        time.sleep(0.02)
        return f(*args)

    runner = cpu.CpuRunner(slow, None, static_indices=[1, 2], rounds=3, onnxruntime=ort)
    torch.testing.assert_close(runner(x, w, b)[0], f(x, w, b)[0], rtol=1e-5, atol=1e-5)
    (d,) = runner.decisions()
    assert d["runs"] == "onnxruntime"
    (bound,) = runner._chosen.values()
    assert bound is not ort and bound.__qualname__.startswith("bound_call")
    x3 = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(runner(x3, w, b)[0], f(x3, w, b)[0], rtol=1e-5, atol=1e-5)  # evicts batch 2's
    builds = ort.builds
    torch.testing.assert_close(runner(x, w, b)[0], f(x, w, b)[0], rtol=1e-5, atol=1e-5)
    assert ort.builds == builds + 1  # batch 2's session built again through the full path
    check_watched_bound_call(OrtRunner(gm, params, {}, "CPUExecutionProvider", False, spin="short", fallback=False),
                             f, x, w, b)


def check_watched_bound_call(way, f, x, w, b):
    """A way's bound call with watched weights: eager's values before and after an in-place weight
    change and a replaced weight, each change built into the way once, none in between."""
    w, b = w.clone(), b.clone()
    call = way.bound([x, w, b])
    torch.testing.assert_close(call(x, w, b)[0], f(x, w, b)[0], rtol=1e-5, atol=1e-5)
    builds = way.builds
    call(x, w, b)
    assert way.builds == builds
    w.mul_(-0.5)
    torch.testing.assert_close(call(x, w, b)[0], f(x, w, b)[0], rtol=1e-5, atol=1e-5)
    call(x, w, b)
    assert way.builds == builds + 1
    b2 = torch.randn_like(b)
    torch.testing.assert_close(call(x, w, b2)[0], f(x, w, b2)[0], rtol=1e-5, atol=1e-5)
    assert way.builds == builds + 2


def test_runner_times_onnxruntime_too_and_leaves_it_out_where_it_fails():
    runner = cpu.CpuRunner(_slow(6, "same"), _slow(4, "same"), static_indices=[], rounds=3,
                           onnxruntime=_slow(0, "same"))
    assert runner(torch.ones(2)) == "same"
    (d,) = runner.decisions()
    assert d["runs"] == "onnxruntime" and d["onnxruntime_ms"] < d["baseline_ms"] < d["optimized_ms"]
    # outputs that differ from the reference's: left out, however fast
    runner = cpu.CpuRunner(_slow(6, "optimized"), _slow(4, "baseline"), static_indices=[], rounds=3,
                           onnxruntime=_slow(0, "onnxruntime"))
    assert runner(torch.ones(2)) in ("baseline", "optimized")
    (d,) = runner.decisions()
    assert "outputs differ" in d["failed"]["onnxruntime"]

    def broken(*args):
        raise RuntimeError("no ONNX translation")

    runner = cpu.CpuRunner(_slow(3, "optimized"), None, static_indices=[], rounds=3, onnxruntime=broken)
    assert runner(torch.ones(2)) == "optimized"
    (d,) = runner.decisions()
    assert d["runs"] == "optimized graph" and "no ONNX translation" in d["failed"]["onnxruntime"]


def test_compiled_cnn_may_run_in_onnxruntime_on_the_cpu_and_matches_eager():
    torch.manual_seed(0)
    m = SeedCNN().eval()
    x = torch.randn(2, 3, 32, 32)
    graphs: list = []
    compiled = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": False}, graphs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
        m.conv1.weight.mul_(0.5)  # a weight changed in place: ONNX Runtime's session is rebuilt
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    (g,) = graphs
    assert g.executor_details["onnxruntime_candidate"] == "timed per signature"
    (d,) = g.executor_details["cpu_runner"].decisions()
    assert "onnxruntime_ms" in d and d["runs"] in cpu.CpuRunner.KEYS
    off: list = []
    with torch.no_grad():
        fxopt.testing.compile_with_fxopt(m, {"cpu_onnxruntime": False}, off)(x)
    assert off[0].executor_details["onnxruntime_candidate"] == "none (option cpu_onnxruntime=False)"
    assert "onnxruntime_ms" not in off[0].executor_details["cpu_runner"].decisions()[0]


def test_burst_medians_leave_out_the_call_after_a_switch_and_extend_close_calls():
    """A way that is fast in a stream of its own calls but slow right after another way ran (its
    thread pool waking, the other's still spinning) is timed as a stream runs it; two ways within
    ``close`` get more rounds."""
    last = [None]

    def way(name, ms, after_switch_ms):
        def fn():
            time.sleep((after_switch_ms if last[0] != name else ms) / 1e3)
            last[0] = name

        return fn

    fns = {"a_ms": way("a", 3, 3), "b_ms": way("b", 1, 30)}
    medians, rounds = cpu.burst_medians(fns, {"a_ms": 3, "b_ms": 1}, rounds=2, close=0.1)
    assert medians["b_ms"] < medians["a_ms"] and rounds == 2, medians
    even = {"a_ms": way("c", 2, 2), "b_ms": way("d", 2, 2)}
    _, rounds = cpu.burst_medians(even, {"a_ms": 2, "b_ms": 2}, rounds=2, close=0.5)
    assert rounds == 4
    calls = []
    far = {"a_ms": way("e", 1, 1), "b_ms": lambda: calls.append(1) or time.sleep(0.02)}
    medians, _ = cpu.burst_medians(far, {"a_ms": 1, "b_ms": 20}, rounds=3, close=0.1)
    # out of the race after one round: one burst of two calls discarded, BURST_MIN - 1 timed
    assert len(calls) == 2 + cpu_timing.BURST_MIN - 1 and medians["b_ms"] > 10 * medians["a_ms"]


def test_steady_bursts_time_a_way_as_a_stream_of_its_calls_runs():
    """Packages' steady bursts: a way slow for its first several calls after another way ran (a
    runtime's workers waking) but faster in a stream of its calls wins there, where one discarded
    call per burst ranks it behind a way that is steady but slower; a package's runner times that way
    and keeps its decisions apart from a compile's."""
    last, count = [None], [0]

    def busy(ms):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < ms / 1e3:
            pass

    def waking(name, ms, slow_ms, slow_calls):
        def fn():
            count[0] = count[0] + 1 if last[0] == name else 1
            busy(slow_ms if count[0] <= slow_calls else ms)
            last[0] = name

        return fn

    # slow for 30 calls (18 ms): past a compile's discarded BURST_WARM_MS (20 calls here), not a package's 20 ms
    fns = {"a_ms": waking("a", 0.1, 0.6, 30), "b_ms": waking("b", 0.15, 0.15, 0)}
    first = {"a_ms": 0.1, "b_ms": 0.15}
    short, _ = cpu.burst_medians(fns, first, rounds=2, close=0.1)
    steady, _ = cpu.burst_medians(fns, first, rounds=2, close=0.1, steady=True)
    assert short["a_ms"] > short["b_ms"] and steady["a_ms"] < steady["b_ms"], (short, steady)
    assert steady["a_ms"] == pytest.approx(0.1, rel=0.5)
    # slow for its first four calls (a runtime's workers waking, 12 ms): a compile's bursts discard them (10)
    # (one discarded call ranked it behind the steady but slower way, as ONNX Runtime behind OpenVINO)
    fns = {"a_ms": waking("c", 1.0, 3.0, 4), "b_ms": waking("d", 1.5, 1.5, 0)}
    short, _ = cpu.burst_medians(fns, {"a_ms": 1.0, "b_ms": 1.5}, rounds=2, close=0.1)
    assert short["a_ms"] < short["b_ms"] and short["a_ms"] == pytest.approx(1.0, rel=0.3), short
    runner = cpu.CpuRunner(lambda *a: None, None, [], decisions_cache=(None, None, "code"), steady=True)
    compile_runner = cpu.CpuRunner(lambda *a: None, None, [], decisions_cache=(None, None, "code"))
    sig = ((torch.Size([1]), (1,), torch.float32),)
    assert runner._cache_key(sig).startswith("cpu_runner|steady-bursts")
    assert compile_runner._cache_key(sig) != runner._cache_key(sig)


@pytest.mark.parametrize("out_buffer_bytes", [None, 0])
def test_onnxruntime_io_binding_gives_fresh_outputs_and_reads_inputs_at_the_call(monkeypatch, out_buffer_bytes):
    """The CPU session's IO binding is kept across calls: inputs bound again only where they moved,
    small outputs copied out of buffers bound once (or, large, written into new tensors): an
    earlier output never changes, an input changed in place is read afresh."""
    from fxopt.backends import onnxrt

    if out_buffer_bytes is not None:
        monkeypatch.setattr(onnxrt, "CPU_OUT_BUFFER_BYTES", out_buffer_bytes)
    init = cpu.CpuRunner.__init__

    def slowed(self, fn, baseline, *a, **k):  # the torch graphs 30 ms slower: ONNX Runtime runs
        def slow(f):
            return lambda *args: time.sleep(0.03) or f(*args)
        init(self, slow(fn), baseline and slow(baseline), *a, **k)

    monkeypatch.setattr(cpu.CpuRunner, "__init__", slowed)
    torch.manual_seed(0)
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    graphs: list = []
    compiled = fxopt.testing.compile_with_fxopt(
        m, {"autotune_cache": False, "cpu_openvino": False, "cpu_generated_c": False}, graphs)
    check_fresh_outputs_and_reread_inputs(compiled, m, x)
    runner = graphs[0].executor_details["cpu_runner"]
    runs = runner.decisions()[0]["runs"]
    assert runs in ("onnxruntime", "onnxruntime 1 thread"), runner.decisions()
    (session,) = runner.ways[runs].sessions.values()
    assert session._cpu_binding is not None and (session._out_bufs is None) == (out_buffer_bytes == 0)
    # its workers spin between a run's operators and briefly after it (not ORT's default, unbounded)
    opts = session.sess.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.spin_duration_us") == str(onnxrt.CPU_SPIN_US)
    with pytest.raises(Exception):  # not set: ORT's default, spinning
        opts.get_session_config_entry("session.intra_op.allow_spinning")


def test_runner_gives_a_tie_to_onnxruntime_with_several_threads():
    """Within ``margin`` of the torch graphs, ONNX Runtime runs where there are several threads (its
    pool degrades gracefully when another process takes a core; OpenMP regions wait), the
    optimized graph with one thread."""
    threads = torch.get_num_threads()
    try:
        for n, expected in ((2, "onnxruntime"), (1, "optimized graph")):
            torch.set_num_threads(n)
            runner = cpu.CpuRunner(_slow(4, "same"), None, static_indices=[], margin=0.5, rounds=2,
                                   onnxruntime=_slow(4, "same"))
            assert runner(torch.ones(1)) == "same"
            assert runner.decisions()[0]["runs"] == expected, runner.decisions()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_runner_takes_an_engine_with_one_thread_only_where_it_wins_by_the_margin(engine):
    def runner(many_ms, one_ms):
        return cpu.CpuRunner(_slow(20, "same"), None, static_indices=[], margin=0.5, rounds=2,
                             **{engine: _slow(many_ms, "same"), f"{engine}_1t": _slow(one_ms, "same")})

    tie = runner(4, 4)
    assert tie(torch.ones(1)) == "same" and tie.decisions()[0]["runs"] == engine, tie.decisions()
    win = runner(12, 2)
    assert win(torch.ones(1)) == "same" and win.decisions()[0]["runs"] == f"{engine} 1 thread", win.decisions()
    assert win.decisions()[0][f"{engine}_1t_ms"] < win.decisions()[0][f"{engine}_ms"]


def check_fresh_outputs_and_reread_inputs(compiled, m, x) -> None:
    """Every call's outputs are its own (an earlier output never changes) and an input changed in
    place is read afresh: what a runtime's buffers bound once across calls must keep."""
    with torch.no_grad():
        a = compiled(x)
        kept = a.clone()
        x2 = torch.randn_like(x)
        b = compiled(x2)
        torch.testing.assert_close(a, kept, rtol=0, atol=0)
        torch.testing.assert_close(b, m(x2), rtol=1e-4, atol=1e-5)
        x2.mul_(-2.0)  # same memory, new values
        torch.testing.assert_close(compiled(x2), m(x2), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(b, m(x2 / -2.0), rtol=1e-4, atol=1e-5)


def test_onnxruntime_candidates_export_each_signature_once_and_again_after_a_weight_change(monkeypatch):
    """The all-threads and one-thread ONNX Runtime candidates share one ONNX export per signature
    while the runner decides it, and keep none after (an export holds a copy of every weight); a
    weight change (a compile's weights may change) rebuilds each session, with the new weights."""
    from fxopt import onnx_graph

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # two threads: the one-thread candidate too
    exported = []
    real = onnx_graph.graph_to_onnx
    monkeypatch.setattr(onnx_graph, "graph_to_onnx", lambda *a, **k: exported.append(1) or real(*a, **k))
    calls = []  # the runner's flat arguments (parameters and input), to call each candidate with
    call = cpu.CpuRunner.__call__
    monkeypatch.setattr(cpu.CpuRunner, "__call__", lambda self, *a: calls.append(a) or call(self, *a))
    torch.manual_seed(0)
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    graphs: list = []
    compiled = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": False, "cpu_openvino": False}, graphs)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x))
        runner = graphs[0].executor_details["cpu_runner"]
        ort, ort1 = runner.ways["onnxruntime"], runner.ways["onnxruntime 1 thread"]
        assert ort.exports is ort1.exports and len(exported) == 1 and ort.builds == ort1.builds == 1
        assert len(ort.exports) == 0  # let go once the signature was decided
        next(m.parameters()).mul_(0.5)  # both candidates must see it
        for way in (ort, ort1):
            out = way(*calls[-1])
            torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, m(x))
        assert len(exported) == 3 and ort.builds == ort1.builds == 2 and len(ort.exports) == 0


class _BoundWay:
    """An ONNX Runtime-like way: 20 ms a call through its own dispatch, 2 ms through ``bound``."""

    def __init__(self):
        self.bound_calls = 0

    def __call__(self, *args):
        time.sleep(0.02)
        return "same"

    def bound(self, args):
        def run(*a):
            self.bound_calls += 1
            time.sleep(0.002)
            return "same"
        return run


def test_runner_times_a_way_through_the_call_it_would_run():
    """A way with a call bound once per signature (``OrtRunner.bound``) is timed through that call,
    which is what runs once it is chosen, not through its per-call dispatch."""
    way = _BoundWay()
    runner = cpu.CpuRunner(_slow(8, "same"), None, static_indices=[], margin=0.1, rounds=2, onnxruntime=way)
    assert runner(torch.ones(1)) == "same"
    decision = runner.decisions()[0]
    assert decision["runs"] == "onnxruntime" and decision["onnxruntime_ms"] < 8, decision
    assert way.bound_calls > 2


def test_shared_builds_are_kept_only_while_a_signature_is_decided():
    from fxopt.backends.engine_calls import SharedBuilds

    shared, built = SharedBuilds(), []

    def build(v):
        return lambda: built.append(v) or v

    assert shared.get("s", (1,), build("a")) == "a" and len(shared) == 0  # outside a decision: not kept
    with shared.deciding():
        assert shared.get("s", (1,), build("b")) == "b" and shared.get("s", (1,), build("c")) == "b"
        assert shared.get("s", (2,), build("d")) == "d"  # other weights: built again
        assert len(shared) == 1
    assert len(shared) == 0 and built == ["a", "b", "d"]
    with pytest.raises(ValueError), shared.deciding():
        shared.get("s", (1,), build("e"))
        raise ValueError("a way failed")
    assert len(shared) == 0
