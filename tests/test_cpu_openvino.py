"""bfloat16 on the cpu executor (bfloat16 models and float32 models under bfloat16 autocast), and
OpenVINO as one more candidate of its runner (fxopt.backends.openvino): chosen where it is faster
and right, declined where its outputs differ, absent, or refusing a graph -- every case correct."""
from __future__ import annotations

import builtins
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.backends import cpu
from fxopt.backends import openvino as ovb
from fxopt.testing import SeedCNN
from fxopt.tolerances import relative_error, tolerance
from test_cpu_executor import check_fresh_outputs_and_reread_inputs, check_watched_bound_call

pytestmark = pytest.mark.skipif(cpu.onednn_available() is not None, reason=str(cpu.onednn_available()))
needs_ov = pytest.mark.skipif(ovb.why_unavailable() is not None, reason=str(ovb.why_unavailable()))
BF16_RTOL = tolerance(torch.bfloat16)[0]


class Net(nn.Module):
    """conv-bn-relu, a depthwise conv-bn-relu6, a residual, a linear head: MobileNet in small."""

    def __init__(self, c=16):
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.dw, self.b1 = nn.Conv2d(c, c, 3, padding=1, groups=c, bias=False), nn.BatchNorm2d(c)
        self.pw, self.b2 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = F.relu(self.b0(self.stem(x)))
        y = F.relu6(self.b1(self.dw(x)))
        y = self.b2(self.pw(y)) + x
        return self.head(y.mean((2, 3)))


def _net() -> nn.Module:
    torch.manual_seed(0)
    m = Net()
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.5, 0.5)
            mod.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _compile(model, x, options=None, autocast=False):
    """(compiled model's output, its graph report) for one call."""
    graphs: list = []
    compiled = fxopt.testing.compile_with_fxopt(model, {"autotune_cache": False, **(options or {})}, graphs)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = compiled(x)
        again = compiled(x)  # the decided way
    torch.testing.assert_close(again, out, rtol=0, atol=0) if not isinstance(out, tuple) else None
    (g,) = graphs
    return out, g


def _skip_without_bf16():
    if cpu.dtype_unsupported(torch.bfloat16):
        pytest.skip("no bfloat16 oneDNN here")


# -- bfloat16 through the cpu executor ----------------------------------------------------------
def test_bf16_model_runs_onednn_convs_within_the_bf16_tolerance_of_fp32_eager():
    _skip_without_bf16()
    m, x = _net(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = m(x)
    out, g = _compile(_net().bfloat16(), x.bfloat16(), {"cpu_openvino": False, "cpu_onnxruntime": False})
    assert out.dtype == torch.bfloat16
    assert g.executor_details["onednn"]["convs"] == 3 and not g.executor_details["onednn"]["declined"]
    assert relative_error(out.float(), ref) <= BF16_RTOL


def test_autocast_graph_runs_its_convs_in_onednn_in_bf16():
    _skip_without_bf16()
    m, x = _net(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", torch.bfloat16):
            eager_amp = m(x)
    out, g = _compile(m, x, {"cpu_openvino": False, "cpu_onnxruntime": False}, autocast=True)
    assert out.dtype == eager_amp.dtype == torch.bfloat16
    # the casts autocast puts around each conv do not keep a conv from oneDNN
    assert g.executor_details["onednn"]["convs"] == 3, g.executor_details["onednn"]
    assert relative_error(out.float(), ref) <= BF16_RTOL
    assert relative_error(out.float(), eager_amp.float()) <= BF16_RTOL


# -- the OpenVINO candidate -----------------------------------------------------------------------
def _delayed(fn, s):
    def slow(*args):
        time.sleep(s)
        return fn(*args)

    return slow


@pytest.fixture
def slow_torch_graphs(monkeypatch):
    """The optimized and baseline graphs 30 ms slower: OpenVINO, where it runs and is right, wins."""
    init = cpu.CpuRunner.__init__

    def slowed(self, fn, baseline, *a, **k):
        init(self, _delayed(fn, 0.03), baseline and _delayed(baseline, 0.03), *a, **k)

    monkeypatch.setattr(cpu.CpuRunner, "__init__", slowed)


#: the OpenVINO ways of the runner (with torch's thread count, and with one thread where torch has more)
OV_WAYS = ("openvino", "openvino 1 thread")
OV_MS = {"openvino": "openvino_ms", "openvino 1 thread": "openvino_1t_ms"}


def _decision(g) -> dict:
    (d,) = g.executor_details["cpu_runner"].decisions()
    return d


@needs_ov
def test_openvino_is_chosen_where_faster_and_matches_eager(slow_torch_graphs):
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = m(x)
    out, g = _compile(m, x, {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False})
    assert g.executor_details["openvino_candidate"] == "timed per signature (inference precision f32)"
    d = _decision(g)
    assert d["runs"] in OV_WAYS and d[OV_MS[d["runs"]]] < d["optimized_ms"], d
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # float32 stays float32


@needs_ov
def test_openvino_runs_bf16_only_for_bf16_graphs(slow_torch_graphs):
    _skip_without_bf16()
    m, x = _net(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = m(x)
    out, g = _compile(_net().bfloat16(), x.bfloat16(),
                      {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False})
    want = "bf16" if ovb.cpu_has_bf16() else "f32"
    assert g.executor_details["openvino_candidate"] == f"timed per signature (inference precision {want})"
    assert _decision(g)["runs"] in OV_WAYS
    assert out.dtype == torch.bfloat16 and relative_error(out.float(), ref) <= BF16_RTOL
    out, g = _compile(m, x, {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False}, autocast=True)
    assert g.executor_details["openvino_candidate"] == f"timed per signature (inference precision {want})"
    assert relative_error(out.float(), ref) <= BF16_RTOL


@needs_ov
def test_openvino_reads_strided_bf16_weights_right(slow_torch_graphs):
    """Weights that are strided views (channels_last filters; a package's are slices of one blob):
    OpenVINO gets dense copies (it read such bfloat16 constants as dense: relative error 0.5)."""
    _skip_without_bf16()
    m, x = _net(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = m(x)
    strided = _net().bfloat16().to(memory_format=torch.channels_last)
    assert not strided.stem.weight.is_contiguous()
    out, g = _compile(strided, x.bfloat16(), {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False})
    d = _decision(g)
    assert d["runs"] in OV_WAYS and "failed" not in d, d
    assert relative_error(out.float(), ref) <= BF16_RTOL


@needs_ov
def test_openvino_is_declined_where_its_outputs_differ(slow_torch_graphs, monkeypatch):
    call = ovb.OvRunner.__call__
    def off_by_one_percent(self, *args):
        out = call(self, *args)
        return type(out)(t * 1.01 for t in out) if isinstance(out, (list, tuple)) else out * 1.01

    monkeypatch.setattr(ovb.OvRunner, "__call__", off_by_one_percent)
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = m(x)
    out, g = _compile(m, x, {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False})
    d = _decision(g)
    assert d["runs"] not in OV_WAYS, d
    assert all("outputs differ from the reference" in d["failed"][w] for w in OV_WAYS if w in d["failed"]), d
    assert "outputs differ from the reference" in d["failed"]["openvino"], d
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_without_openvino_the_executor_runs_as_before(monkeypatch):
    real = builtins.__import__

    def no_openvino(name, *a, **k):
        if name == "openvino" or name.startswith("openvino."):
            raise ImportError("No module named 'openvino'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_openvino)
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = m(x)
    out, g = _compile(m, x, {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False})
    assert g.executor_details["openvino_candidate"].startswith("none (openvino is not importable")
    assert "openvino_ms" not in _decision(g)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    _, off = _compile(m, x, {"cpu_openvino": False, "cpu_onnxruntime": False})
    assert off.executor_details["openvino_candidate"] == "none (option cpu_openvino=False)"


@torch.library.custom_op("fxopt_test_ov::wiggle", mutates_args=())
def wiggle(x: torch.Tensor) -> torch.Tensor:
    return x + 0.5 * torch.sin(x)


@wiggle.register_fake
def _(x):
    return torch.empty_like(x)


class Unconvertible(nn.Module):
    """A conv and an op OpenVINO has no conversion rule for."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return wiggle(F.relu(self.conv(x)))


@needs_ov
def test_a_graph_openvino_refuses_runs_the_torch_graphs(slow_torch_graphs):
    torch.manual_seed(0)
    m, x = Unconvertible().eval(), torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        ref = m(x)
    out, g = _compile(m, x, {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False})
    d = _decision(g)
    assert d["runs"] in ("optimized graph", "baseline graph") and "openvino" in d["failed"], d
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@needs_ov
def test_openvino_rebuilds_after_an_in_place_weight_change(slow_torch_graphs):
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    graphs: list = []
    options = {"autotune_cache": False, "cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False}
    compiled = fxopt.testing.compile_with_fxopt(m, options, graphs)
    with torch.no_grad():
        compiled(x)
        m.conv1.weight.mul_(0.5)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    assert _decision(graphs[0])["runs"] in OV_WAYS


@needs_ov
@pytest.mark.parametrize("out_buffer_bytes", [ovb.OUT_BUFFER_BYTES, 0])
def test_openvino_request_is_reused_and_outputs_are_fresh(slow_torch_graphs, monkeypatch, out_buffer_bytes):
    """One infer request per signature, inputs shared again only where they moved; every call's
    outputs are its own (small ones copied out of buffers shared once, large ones written into new
    tensors): an earlier output never changes, an input changed in place is read afresh."""
    monkeypatch.setattr(ovb, "OUT_BUFFER_BYTES", out_buffer_bytes)
    torch.manual_seed(0)
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    graphs: list = []
    compiled = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": False, "cpu_onnxruntime": False,
                                                    "cpu_openvino": True, "cpu_generated_c": False}, graphs)
    check_fresh_outputs_and_reread_inputs(compiled, m, x)
    assert _decision(graphs[0])["runs"] in OV_WAYS
    cpu_runner = graphs[0].executor_details["cpu_runner"]
    runner = cpu_runner.ways[_decision(graphs[0])["runs"]]
    assert runner.builds == 1 and len(runner.models) == 1
    (req,) = runner.models.values()
    assert (req.out_bufs is None) == (out_buffer_bytes == 0)


@needs_ov
def test_openvino_inputs_taking_turns_strided_or_requiring_grad(slow_torch_graphs):
    """The previous call's request is reused without a look-up: inputs taking turns (new memory, one
    that requires grad, a non-contiguous one; Dynamo gives the last two graphs of their own, the
    strided one with symbolic sizes, which the OpenVINO candidate declines up front) each read as
    eager reads them; the contiguous inputs' graphs run OpenVINO, each on one compiled model."""
    torch.manual_seed(0)
    m = SeedCNN().eval()
    xa, xb = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 32, 32)
    xs = torch.randn(3, 32, 2, 32).permute(2, 0, 1, 3)  # (2, 3, 32, 32), not contiguous
    xg = torch.randn(2, 3, 32, 32).requires_grad_()
    graphs: list = []
    compiled = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": False, "cpu_onnxruntime": False,
                                                    "cpu_openvino": True, "cpu_generated_c": False}, graphs)
    with torch.no_grad():
        for x in (xa, xb, xg, xa, xs, xg, xb):
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    for g in graphs[:2]:  # contiguous inputs; the second requires grad
        runner = g.executor_details["cpu_runner"]
        (d,) = runner.decisions()
        assert d["runs"] in OV_WAYS, d
        assert runner.ways[d["runs"]].builds == 1 and len(runner.ways[d["runs"]].models) == 1
    for g in graphs[2:]:  # symbolic sizes: declined up front (no export that fails at the first call)
        assert g.executor_details["openvino_candidate"].startswith("none (symbolic sizes"), g.executor_details
        assert "failed" not in g.executor_details["cpu_runner"].decisions()[0]


@needs_ov
def test_fixed_weights_openvino_request_bound_once_per_signature():
    """Where no weight is watched (a package's), the runner keeps, per signature, a call bound to
    OpenVINO's request of that signature; evicted (more signatures than the models kept), the bound
    call takes the full path and compiles again; a strided input is read as eager reads it. Watched
    weights: a bound call that checks them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w, b):
        return (F.conv2d(x, w, b, padding=1).relu(),)

    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(4)
    gm = make_fx(f)(x, w, b)
    ov = ovb.OvRunner(gm, [1, 2], "f32", max_models=1, watch=False)

    def slow(*args):
        time.sleep(0.02)
        return f(*args)

    runner = cpu.CpuRunner(slow, None, static_indices=[1, 2], rounds=3, openvino=ov)
    torch.testing.assert_close(runner(x, w, b)[0], f(x, w, b)[0], rtol=1e-5, atol=1e-5)
    (d,) = runner.decisions()
    assert d["runs"] == "openvino"
    (bound,) = runner._chosen.values()
    assert bound is not ov and bound.__qualname__.startswith("bound_call")
    xs = torch.randn(3, 8, 2, 8).permute(2, 0, 1, 3)  # (2, 3, 8, 8), not contiguous
    torch.testing.assert_close(bound(xs, w, b)[0], f(xs, w, b)[0], rtol=1e-5, atol=1e-5)
    x3 = torch.randn(3, 3, 8, 8)
    torch.testing.assert_close(runner(x3, w, b)[0], f(x3, w, b)[0], rtol=1e-5, atol=1e-5)  # evicts batch 2's
    builds = ov.builds
    torch.testing.assert_close(runner(x, w, b)[0], f(x, w, b)[0], rtol=1e-5, atol=1e-5)
    assert ov.builds == builds + 1  # batch 2's model compiled again through the full path
    check_watched_bound_call(ovb.OvRunner(gm, [1, 2], "f32"), f, x, w, b)


@needs_ov
def test_openvino_ways_share_one_conversion_per_signature(slow_torch_graphs, monkeypatch):
    """OpenVINO timed with torch's threads and with one: one export and conversion for both, each
    compiling its own model; the conversion let go once the signature is decided."""
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no second OpenVINO way")
    calls = []
    convert = ovb.OvRunner._convert

    def counted(self, args):
        calls.append(self.threads)
        return convert(self, args)

    monkeypatch.setattr(ovb.OvRunner, "_convert", counted)
    m, x = SeedCNN().eval(), torch.randn(2, 3, 32, 32)
    out, g = _compile(m, x, {"cpu_onnxruntime": False, "cpu_openvino": True, "cpu_generated_c": False})
    d = _decision(g)
    assert "openvino_ms" in d and "openvino_1t_ms" in d, d
    runner = g.executor_details["cpu_runner"]
    assert len(calls) == 1 and runner.openvino.builds == 1 and runner.openvino_1t.builds == 1, calls
    assert runner.openvino_1t.threads == 1 and runner.openvino.threads is None
    assert len(runner.openvino.conversions) == 0  # let go once the signature was decided
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-5)
