"""fxopt/eager_formats.py on the GPU fuzzer's failing programs (Dynamo on fake CUDA tensors)."""
import contextlib

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt.backend import _graph_output_formats, fxopt_backend
from fxopt.eager_formats import eager_output_formats
from fxopt.testing import compile_with_fxopt

CL, NCHW = torch.channels_last, torch.contiguous_format


S = nn.Sequential


def up(mode="nearest"):
    return nn.Upsample(scale_factor=2, mode=mode)


class Abs(nn.Module):
    def forward(self, x):
        return torch.abs(x)


class Twice(nn.Module):
    """``y = x; return x, <aux>``: the fuzzer's second output (a6d9fae0a3, fd5d5f69d6)."""

    def __init__(self, aux: str):
        super().__init__()
        self.aux = aux

    def forward(self, x):
        return x, {"y": x, "t": x.transpose(2, 3), "s": x[:, :1]}[self.aux]


class _First(nn.Module):
    """``(f(x), y)`` of ``(x, y)``: a view output whose base is no output."""

    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, xy):
        return self.f(xy[0]), xy[1]


CASES = {  # model, input shape, eager's format
    "nearest": (lambda: S(up()), (1, 2, 1, 2), CL),  # df12e891cd
    "nearest-bn": (lambda: S(up(), nn.BatchNorm2d(2)), (1, 2, 1, 2), CL),  # 2d1ca3ed3d
    "bilinear": (lambda: S(up("bilinear")), (1, 8, 1, 2), CL),  # 9ebabf9937
    "conv-bilinear": (lambda: S(nn.Conv2d(4, 4, 3, padding=1), Abs(), up("bilinear")), (1, 4, 2, 2), CL),  # 09a86e0483
    "maxpool-abs-nearest": (lambda: S(nn.MaxPool2d(2, 1), Abs(), up()), (1, 2, 4, 4), CL),  # f8210112bf
    "maxpool-nearest-bn": (lambda: S(nn.MaxPool2d(2, 1), up(), nn.BatchNorm2d(2)), (1, 2, 4, 4), CL),  # ed0117f339
    "one-channel-conv": (lambda: S(nn.Conv2d(8, 1, 3, padding=1), Abs(), nn.BatchNorm2d(1), nn.Conv2d(1, 2, 3, padding=1),
                             Abs(), nn.BatchNorm2d(2)), (1, 8, 1, 2), NCHW),  # f2bea686c5
    "maxpool-nearest-twice": (lambda: S(nn.MaxPool2d(2, 1), up(), Twice("y")), (1, 2, 4, 4), CL),  # a6d9fae0a3
    "bilinear-transposed": (lambda: S(up("bilinear"), Twice("t")), (1, 8, 1, 2), CL),  # fd5d5f69d6
    "nearest-abs-sliced": (lambda: S(up(), Twice("s"), _First(Abs())), (1, 2, 1, 2), CL),
}



def _on_fake_cuda(name, backend):
    make, shape, _ = CASES[name]
    with FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device("cuda"):
            model = make().eval()
        x = torch.empty(shape, device="cuda").contiguous(memory_format=CL)
        torch.compiler.reset()
        with torch.no_grad():
            torch.compile(model, backend=backend)(x)
    torch.compiler.reset()


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_formats_correct_dynamos_fake_values(name):
    seen = []
    _on_fake_cuda(name, lambda gm, ex: seen.append((_graph_output_formats(gm, "example_value"),
                                                    eager_output_formats(gm))) or gm.forward)
    (dynamo, eager), = seen
    assert dynamo[0] is not CASES[name][2]
    assert all(f is CASES[name][2] for f in eager if f is not None) and eager[0] is not None, (dynamo, eager)


@pytest.mark.parametrize("name", ["nearest", "bilinear", "maxpool-abs-nearest"])
def test_the_cuda_executor_plans_eagers_output_strides(name):
    reports = []
    _on_fake_cuda(name, lambda gm, ex: fxopt_backend(gm, ex, options={"executor": "cuda", "autotune_cache": False},
                                                     _sink=reports) and gm.forward)
    (report,) = reports
    assert report.fallback is None and report.lowered.regions, report.fallback
    for o in next(n for n in report.after.graph.nodes if n.op == "output").args[0]:
        assert o.meta["val"].is_contiguous(memory_format=CL), o.meta["val"].stride()


@pytest.mark.parametrize("name,device", [("one-channel-conv", "cpu")] + [
    pytest.param(k, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])
    for k in sorted(CASES)])
def test_compiled_outputs_have_eagers_strides(name, device):
    torch.manual_seed(0)
    model, x = CASES[name][0]().eval().to(device), torch.randn(CASES[name][1], device=device).to(memory_format=CL)
    fast = compile_with_fxopt(model, {"executor": "cuda", "autotune_cache": False} if device == "cuda" else {}, [])
    with torch.no_grad():
        want = model(x)
        for _ in range(1 + (device == "cuda")):  # the CUDA-graph capture, then a replay
            got = fast(x)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
                assert all(n == 1 or a == b for n, a, b in zip(w.shape, g.stride(), w.stride())), (g.stride(), w.stride())


@pytest.mark.parametrize("name", ["nearest", "maxpool-nearest-twice", "bilinear-transposed", "nearest-abs-sliced"])
def test_every_graph_the_runner_may_replay_hands_out_eagers_strides(name):
    """The CUDA-graph runner replays the optimized graph or, where it measures faster, the graph as
    AOTAutograd handed it over (its baseline, PyTorch's own kernels): both hand out eager's strides
    (GPU fuzz a6d9fae0a3: the baseline's decomposed upsample was contiguous; fd5d5f69d6: a transposed
    second output viewed the contiguous value). Both graphs run on the fake CUDA input; eager's
    strides are Dynamo's graph's on the CPU, where upsampling keeps channels_last as on CUDA."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    make, shape, _ = CASES[name]
    seen = []

    def backend(gm, ex):
        fxopt_backend(gm, ex, options={"executor": "cuda", "autotune_cache": False}, _sink=seen)
        runner = seen[-1].lowered.cudagraph_runner
        with torch.no_grad(), ex[0].fake_mode:
            got = {k: [o.stride() for o in g(*ex)] for k, g in (("optimized", runner.fn), ("baseline", runner.baseline))}
            with unset_fake_temporarily():
                want = [o.stride() for o in gm(torch.randn(shape).contiguous(memory_format=CL))]
        seen.append((got, want))
        return gm.forward

    _on_fake_cuda(name, backend)
    (report, (got, want)) = seen
    assert report.fallback is None and "output_formats" in {p.name for p in report.passes if p.changed}
    assert torch.empty_strided((1,) * 4, want[0]).dim() == 4 and len(want) == len(got["baseline"])
    for k, strides in got.items():
        assert strides == want, (k, strides, want)
    report.after.graph.lint()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("name", ["nearest", "maxpool-nearest-twice", "bilinear-transposed", "nearest-abs-sliced"])
def test_the_baseline_replay_hands_out_eagers_strides(name, monkeypatch):
    """Where the runner measures the unoptimized graph faster it replays that one: forced here."""
    from fxopt.backends.cuda.runtime import cudagraphs

    monkeypatch.setattr(cudagraphs, "choose", lambda timings, margin: "baseline graph")
    torch.manual_seed(0)
    model, x = CASES[name][0]().eval().cuda(), torch.randn(CASES[name][1], device="cuda").to(memory_format=CL)
    reports: list = []
    fast = compile_with_fxopt(model, {"executor": "cuda", "autotune_cache": False}, reports)
    with torch.no_grad():
        want = model(x)
        for _ in range(2):
            got = fast(x)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
                assert all(n == 1 or a == b for n, a, b in zip(w.shape, g.stride(), w.stride())), (g.stride(), w.stride())
    assert all(d["runs"] == "baseline graph" for d in reports[0].lowered.cudagraph_runner.decisions())


def test_restore_output_formats_copies_a_value_once_for_its_views_of_any_rank():
    """An output eager has channels_last and its views (a select, a transpose) read one copy;
    an input's view is left alone (its strides are the input's)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.eager_formats import restore_output_formats

    def f(x):
        y = torch.abs(x)
        return y, y.select(1, 0), y.transpose(2, 3), x.transpose(2, 3)

    x = torch.randn(1, 3, 4, 5)
    gm = make_fx(f, tracing_mode="fake")(x)
    e = torch.empty(1, 3, 4, 5).contiguous(memory_format=CL)
    strides = [e.stride(), e.select(1, 0).stride(), e.transpose(2, 3).stride(), e.transpose(2, 3).stride()]
    notes = restore_output_formats(gm, [CL, None, None, None], strides)
    assert len(notes) == 3 and sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes) == 1
    gm.graph.lint()
    gm.recompile()
    got = gm(x)
    assert [t.stride() for t in got[:3]] == strides[:3] and got[3].stride() == x.transpose(2, 3).stride()
    for g, w in zip(got, f(x)):
        torch.testing.assert_close(g, w)
    assert restore_output_formats(gm, [CL, None, None, None], strides[:3] + [x.transpose(2, 3).stride()]) == []


def test_a_view_output_of_a_returned_value_keeps_aliasing_it():
    """``return y, y.transpose(2, 3)``: eager's two outputs share memory. Where only the view's
    strides differ from eager's (the value's format is eager's by its metadata: a [1, 16, 1, 2]
    value, channels_last and NCHW at once), the view is not moved onto a copy the value does not
    share (GPU fuzz f1b43b3664: outputs alias [], eager's [(0, 1)]); where one copy gives both
    eager's strides, both read it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.eager_formats import restore_output_formats

    def f(x):
        y = torch.abs(x)
        return y, y.transpose(2, 3)

    x = torch.randn(1, 16, 1, 2).contiguous(memory_format=CL)
    gm = make_fx(f, tracing_mode="fake")(x)
    e = torch.empty(1, 16, 1, 2)  # eager's: NCHW, the view a transpose of it
    assert restore_output_formats(gm, [None, None], [(32, 1, 32, 16), e.transpose(2, 3).stride()]) == []
    assert not any(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)  # aliasing kept
    notes = restore_output_formats(gm, [None, None], [e.stride(), e.transpose(2, 3).stride()])
    assert len(notes) == 1 and "output 0" in notes[0]
    assert sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes) == 1
    gm.graph.lint()
    gm.recompile()
    y, t = gm(x)
    assert t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
    assert y.stride() == e.stride() and t.stride() == e.transpose(2, 3).stride()


class _WinogradResidual(nn.Module):
    """GPU fuzz eaa5b52212: a 1x1 convolution, abs, then a 3x3 convolution + BatchNorm + residual + GELU
    on [1, 16, 1, 2] channels_last, option conv_algorithm="winograd_2x2_3x3"."""

    def __init__(self):
        super().__init__()
        self.m0, self.m1 = nn.Conv2d(16, 16, 1, bias=False), nn.Conv2d(16, 16, 3, padding=1, bias=False)
        self.m2 = nn.BatchNorm2d(16)

    def forward(self, x):
        x = torch.abs(torch.abs(self.m0(x)))
        return nn.functional.gelu(self.m2(self.m1(x)) + x)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_algorithms_convolution_has_the_direct_convolutions_strides(device):
    """The layout pass may hand a Winograd convolution a contiguous input and a channels_last weight;
    PyTorch's convolution then gives channels_last (the format the fake implementation promises) where
    the algorithm's result is contiguous: fused_conv's result takes the direct convolution's strides."""
    from fxopt.ops import conv_by_algorithm, direct_conv

    with FakeTensorMode(allow_non_fake_inputs=True) if device == "cuda" else contextlib.nullcontext():
        x = torch.randn(1, 16, 1, 2, device=device)
        w = torch.randn(16, 16, 3, 3, device=device).contiguous(memory_format=CL)
        want = direct_conv(x, w, None, [1, 1], [1, 1], [1, 1], 1)
        assert want.is_contiguous(memory_format=CL) and not want.is_contiguous()
        if device == "cpu":
            got = conv_by_algorithm(x, w, None, [1, 1], [1, 1], [1, 1], 1, "winograd_2x2_3x3", None)
            assert got.stride() == want.stride()
            torch.testing.assert_close(got, want, rtol=1e-3, atol=3e-3)
    if device == "cuda":  # the whole graph on fake CUDA tensors: what the runner replays has the graph's strides
        seen = []

        def backend(gm, ex):
            fxopt_backend(gm, ex, options={"executor": "cuda", "autotune_cache": False,
                                           "conv_algorithm": "winograd_2x2_3x3"}, _sink=seen)
            runner = seen[-1].lowered.cudagraph_runner
            with torch.no_grad(), ex[0].fake_mode:
                seen.append([[o.stride() for o in g(*ex)] for g in (runner.fn, runner.baseline)])
            return gm.forward

        with FakeTensorMode(allow_non_fake_inputs=True):
            with torch.device("cuda"):
                model = _WinogradResidual().eval()
            xc = torch.empty((1, 16, 1, 2), device="cuda").contiguous(memory_format=CL)
            torch.compiler.reset()
            with torch.no_grad():
                torch.compile(model, backend=backend)(xc)
        torch.compiler.reset()
        report, strides = seen
        assert report.fallback is None
        assert strides == [[(32, 1, 32, 16)]] * 2, strides  # eager's: channels_last
