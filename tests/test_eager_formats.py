"""fxopt/eager_formats.py on the GPU fuzzer's failing programs (Dynamo on fake CUDA tensors)."""
import contextlib
import math

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt.backend import _graph_output_formats, fxopt_backend
from fxopt.eager_formats import eager_output_formats, eager_output_values, same_strides
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



def _compile_on_fake_cuda(make, shape, backend, fmt=CL):
    """``make()`` compiled with ``backend`` and called once, on a fake CUDA input of ``shape`` in ``fmt``."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = make().eval()
        x = torch.empty(shape, device="cuda").contiguous(memory_format=fmt)
        torch.compiler.reset()
        with torch.no_grad():
            torch.compile(model, backend=backend)(x)
    torch.compiler.reset()


def _on_fake_cuda(name, backend):
    make, shape, _ = CASES[name]
    _compile_on_fake_cuda(make, shape, backend)


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
        report, got, want = _replayed_on_fake_cuda(_WinogradResidual, (1, 16, 1, 2),
                                                   {"conv_algorithm": "winograd_2x2_3x3"})
        assert report.fallback is None and want == [(32, 1, 32, 16)]  # eager's: channels_last
        assert [strides for strides, _ in got] == [[(32, 1, 32, 16)]] * 2, got


def _replayed_on_fake_cuda(make, shape, options, fmt=CL):
    """(report, per graph the runner may replay: (output strides, aliased output pairs)) of ``make()`` compiled
    by the cuda executor on a fake CUDA input, and eager's output strides (Dynamo's, as eager_formats corrects)."""
    seen = []

    def backend(gm, ex):
        fxopt_backend(gm, ex, options={"executor": "cuda", "autotune_cache": False, **options}, _sink=seen)
        runner = seen[-1].lowered.cudagraph_runner
        got = []
        with torch.no_grad(), ex[0].fake_mode:
            for g in (runner.fn, runner.baseline):
                outs = g(*ex)
                keys = [o.untyped_storage()._cdata for o in outs]
                got.append(([o.stride() for o in outs],
                            [(i, j) for i in range(len(outs)) for j in range(i + 1, len(outs)) if keys[i] == keys[j]]))
        seen.append((got, [v.stride() for v in eager_output_values(gm)]))
        return gm.forward

    _compile_on_fake_cuda(make, shape, backend, fmt)
    report, (got, want) = seen
    return report, got, want


class _Returned(nn.Module):
    def __init__(self, body, ret):
        super().__init__()
        self.body, self.ret = body, ret

    def forward(self, x):
        return self.ret(self.body(x))


GPU_FUZZ_FORMATS = {  # the GPU fuzzer's programs (seed 72, 2026-11-28): model, input shape, options, aliased outputs
    # a pointwise op over a transposed output: the copy into eager's (permuted) strides
    "2e22e3cf84": (lambda: _Returned(S(nn.Conv2d(16, 16, 3, padding=1, groups=2, bias=False), Abs(), Abs(),
                                       nn.Conv2d(16, 16, 1, bias=False), Abs()), lambda x: x.transpose(2, 3) * 1.5),
                   (1, 16, 2, 2), {"conv_algorithm": "direct"}, []),
    # return x, x.transpose(2, 3) where the transpose is dense channels_last: both read one copy
    "f1b43b3664": (lambda: _Returned(S(nn.Conv2d(12, 16, 3, padding=1, groups=4, bias=False), Abs(),
                                       nn.Conv2d(16, 16, 1, bias=False), Abs()), lambda x: (x, x.transpose(2, 3))),
                   (1, 12, 1, 2), {"conv_algorithm": "winograd_2x2_3x3"}, [(0, 1)]),
    # one-channel convolutions before a flatten: the view reads a contiguous copy (the layout pass failed)
    "e489bb7fe8": (lambda: S(nn.Conv2d(16, 16, 3, padding=1, bias=False), Abs(), nn.BatchNorm2d(16),
                             nn.BatchNorm2d(16), nn.Conv2d(16, 1, 3, padding=1, bias=False), Abs(),
                             nn.Conv2d(1, 2, 3, padding=1, bias=False), Abs(), nn.Flatten(), nn.Linear(4, 1)),
                   (1, 16, 2, 1), {"conv_algorithm": "winograd_2x2_3x3"}, []),
}


@pytest.mark.parametrize("tag", sorted(GPU_FUZZ_FORMATS))
def test_what_the_runner_replays_has_eagers_strides_and_aliasing(tag):
    make, shape, options, aliased = GPU_FUZZ_FORMATS[tag]
    report, got, want = _replayed_on_fake_cuda(make, shape, {**options, "strict": True},
                                               fmt=NCHW if tag == "e489bb7fe8" else CL)
    assert report.fallback is None
    for strides, pairs in got:  # the optimized graph, and the unoptimized one the runner may replay
        assert len(strides) == len(want) and all(same_strides(torch.Size(s), s, w) or s == w
                                                 for s, w in zip(strides, want)), (strides, want)
        assert pairs == aliased, pairs


def test_layout_keeps_a_conversion_before_a_view_its_input_would_refuse():
    """e489bb7fe8: a dropped conversion of a one-channel value changed its size-1 strides; the next
    convolution then chose channels_last, and the flatten's view of [1, 2, 2, 1] failed."""
    report, _, _ = _replayed_on_fake_cuda(GPU_FUZZ_FORMATS["e489bb7fe8"][0], (1, 16, 2, 1),
                                          {"conv_algorithm": "winograd_2x2_3x3", "strict": True}, fmt=NCHW)
    notes = next(p for p in report.passes if p.name == "layout").notes
    assert any("kept before views" in n for n in notes), notes
    from fxopt.fakeprop import view_problem
    assert view_problem(report.after) is None


def test_dense_order_and_the_run_time_copy_into_eagers_strides():
    from fxopt.eager_formats import dense_order, with_eager_strides

    assert dense_order((1, 16, 2, 2), (64, 1, 16, 32)) == [0, 3, 2, 1]
    assert dense_order((2, 3), (3, 1)) == [0, 1] and dense_order((2, 3), (1, 2)) == [1, 0]
    assert dense_order((2, 3), (0, 1)) is None and dense_order((2, 3), (4, 1)) is None  # expanded; gaps
    want = torch.empty(1, 2, 4, 4)  # eager's: contiguous
    cl = torch.randn(1, 2, 4, 4).contiguous(memory_format=CL)  # what a kernel gave instead
    fn = with_eager_strides(lambda x: (cl, x, x[:, :1]), [want, want, None])
    a, b, c = fn(x := torch.randn(1, 2, 4, 4))
    assert b is x and c.stride() == x[:, :1].stride()  # an input handed back, an unknown: untouched
    assert a.stride() == want.stride() and torch.equal(a, cl)
    # an output the third is a view of: both moved, the view rebuilt on the copy (aliasing kept)
    fn = with_eager_strides(lambda: (cl, cl[:, :1]), [want, None])
    a, c = fn()
    assert a.stride() == want.stride() and torch.equal(a, cl) and torch.equal(c, cl[:, :1])
    assert c.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    fn = with_eager_strides(lambda: (cl,), [want])
    (a,) = fn()
    assert a.stride() == want.stride() and torch.equal(a, cl)
    assert with_eager_strides(len, [None]) is len  # nothing to compare: the function itself


def test_outputs_that_are_views_of_each_other_get_eagers_strides_together():
    """A split of a channels_last [1, 3, 1, 2] whose first piece a Winograd conv wrote contiguous, the
    pieces concatenated, the result returned with its transpose: ATen's cat took the contiguous
    format, eager's channels_last (strides (6, 2, 2, 1) against (6, 1, 6, 3)). The output and its
    view are now copied together; views that cannot be rebuilt on the copy keep the old layout."""
    from fxopt.eager_formats import with_eager_strides

    want = torch.empty(1, 3, 1, 2).contiguous(memory_format=CL)
    x = torch.randn(1, 3, 1, 2)
    a, b = with_eager_strides(lambda: (x, x.transpose(2, 3)), [want, want.transpose(2, 3)])()
    assert a.stride() == want.stride() and b.stride() == want.transpose(2, 3).stride()  # size-1 dims too
    assert torch.equal(a, x) and torch.equal(b, x.transpose(2, 3))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()

    def views(t):
        return (t, t[:, 1:3], t[1], t.permute(0, 2, 3, 1), t[:, :, ::2], t[:, 2:3].expand(2, 4, 3, 5))

    x, want = torch.randn(2, 4, 3, 5), torch.empty(2, 4, 3, 5).contiguous(memory_format=CL)
    outs = with_eager_strides(lambda: views(x), list(views(want)))()
    for o, ref, w in zip(outs, views(x), views(want)):
        assert torch.equal(o, ref) and o.stride() == w.stride() and o.storage_offset() == w.storage_offset()
    # a view that is not one of x's layouts' (a flattening reshape) cannot move: all stay as they are
    flat = x.view(-1)
    a, f = with_eager_strides(lambda: (x, flat), [want, None])()
    assert a is x and f is flat
    # a view eager would lay out otherwise than the moved copy gives: nothing moves
    a, t = with_eager_strides(lambda: (x, x.transpose(1, 2)), [want, torch.empty(2, 3, 4, 5)])()
    assert a is x


def test_eagers_output_layouts_are_measured_where_running_the_graph_is_harmless():
    """be7f1a0376 on the GPU: the prediction from fake values said channels_last where eager's kernels
    gave contiguous; Dynamo's graph run once on the real example inputs says what eager gives."""
    from fxopt.eager_formats import measured_output_values

    graphs = []

    def backend(gm, ex):
        graphs.append((gm, ex))
        return gm.forward

    def record(fn, *args):
        graphs.clear()
        torch.compiler.reset()
        with torch.no_grad():
            torch.compile(fn, backend=backend)(*args)
        torch.compiler.reset()
        return graphs[0]

    x = torch.randn(1, 2, 4, 4).contiguous(memory_format=CL)
    gm, ex = record(lambda t: (torch.abs(t), t.transpose(2, 3) * 2), x)
    got = measured_output_values(gm, ex)
    assert [v.device.type for v in got] == ["meta", "meta"]
    assert [v.stride() for v in got] == [torch.abs(x).stride(), (x.transpose(2, 3) * 2).stride()]
    gm, ex = record(lambda t: torch.nn.functional.dropout(t, 0.5, True), x)  # draws random numbers: not run
    assert measured_output_values(gm, ex) is None
    gm, ex = record(lambda t: t.clone().add_(1), x)  # in place: not run
    assert measured_output_values(gm, ex) is None
    gm, ex = record(lambda t: torch.ops.aten.add_.Tensor(t.clone(), 1), x)  # an ATen overload that writes
    assert measured_output_values(gm, ex) is None
    with FakeTensorMode() as mode:  # fake inputs: nothing to run
        fake = mode.from_tensor(x)
    assert measured_output_values(gm, [fake]) is None


def test_a_concatenation_returned_with_its_transpose_has_eagers_strides_end_to_end():
    """The case above through the whole backend (the fuzzer's check: values and strides of every output)."""
    from fxopt.fuzz import Program
    from fxopt.fuzz.check import run_program

    source = ("import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n        self.m0 = nn.Conv2d(1, 1, 3, padding=1)\n\n"
              "    def forward(self, x):\n        p0, p1, p2 = torch.split(x, [1, 1, 1], dim=1)\n"
              "        x = torch.cat([self.m0(p0), p1, p2], 1)\n        return x, x.transpose(2, 3)\n")
    for algorithm in ("winograd_2x2_3x3", "auto"):
        p = Program(source=source, shape=(1, 3, 1, 2), dtype="float32", fmt="channels_last", mode="inference",
                    seed=0, options={"conv_algorithm": algorithm, "executor": "torch"}, layers=[], ops=[])
        run_program(p, "cpu", outcome={})  # raises Mismatch on a stride or value that differs from eager's


def _draw_view(draw, t):
    """A chain of up to three view ops on ``t`` (the same chain replays on another tensor)."""
    from hypothesis import strategies as st

    ops = []
    shape = list(t.shape)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["slice", "select", "permute", "transpose", "unsqueeze", "expand"]))
        d = draw(st.integers(0, len(shape) - 1))
        if kind == "slice" and shape[d] > 1:
            start = draw(st.integers(0, shape[d] - 1))
            step = draw(st.integers(1, 2))
            ops.append(lambda v, d=d, s=start, k=step: v.narrow(d, s, v.shape[d] - s)[(slice(None),) * d + (slice(None, None, k),)])
            shape[d] = len(range(start, shape[d], step))
        elif kind == "select" and len(shape) > 1:
            i = draw(st.integers(0, shape[d] - 1))
            ops.append(lambda v, d=d, i=i: v.select(d, i))
            shape.pop(d)
        elif kind == "permute":
            order = draw(st.permutations(range(len(shape))))
            ops.append(lambda v, o=tuple(order): v.permute(o))
            shape = [shape[o] for o in order]
        elif kind == "transpose" and len(shape) > 1:
            e = draw(st.integers(0, len(shape) - 1))
            ops.append(lambda v, d=d, e=e: v.transpose(d, e))
            shape[d], shape[e] = shape[e], shape[d]
        elif kind == "unsqueeze":
            ops.append(lambda v, d=d: v.unsqueeze(d))
            shape.insert(d, 1)
        elif kind == "expand" and 1 in shape:
            k = shape.index(1)
            n = draw(st.integers(1, 3))
            ops.append(lambda v, k=k, n=n: v.expand(*[n if j == k else -1 for j in range(v.dim())]))
            shape[k] = n

    def apply(v):
        for op in ops:
            v = op(v)
        return v
    return apply


@pytest.mark.parametrize("seed", [0])
def test_property_outputs_and_their_views_moved_together_keep_values_aliasing_and_get_eagers_strides(seed):
    """Hypothesis: an output in one dense layout, views of it (slices, selects, permutes, expands)
    returned beside it, eager's layout another: every output keeps its values; where the outputs
    move they share one storage again and each has the strides eager's layout gives that view;
    where they do not, they are the very tensors the graph gave."""
    from hypothesis import given, settings, strategies as st

    from fxopt.eager_formats import with_eager_strides

    @settings(max_examples=60, deadline=None)
    @given(data=st.data())
    def check(data):
        shape = data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=4))
        mine, theirs = (data.draw(st.permutations(range(len(shape)))) for _ in range(2))

        def laid_out(order, fill):
            base = torch.arange(math.prod(shape), dtype=torch.float32) if fill else torch.empty(math.prod(shape))
            return base.view([shape[d] for d in order]).permute([list(order).index(d) for d in range(len(shape))])

        t, want = laid_out(mine, True), laid_out(theirs, False)
        chains = [_draw_view(data.draw, t) for _ in range(data.draw(st.integers(0, 3)))]
        outs = with_eager_strides(lambda: (t, *[c(t) for c in chains]), [want] + [c(want) for c in chains])()
        refs = [t] + [c(t) for c in chains]
        wants = [want] + [c(want) for c in chains]
        for o, r in zip(outs, refs):
            assert torch.equal(o, r)
        moved = outs[0] is not t
        if moved:
            ptr = outs[0].untyped_storage().data_ptr()
            for o, w in zip(outs, wants):
                assert o.untyped_storage().data_ptr() == ptr
                assert same_strides(o.shape, o.stride(), w.stride()), (o.stride(), w.stride())
        else:
            assert all(o.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for o in outs)
            assert same_strides(t.shape, t.stride(), want.stride()) or len(outs) > 1

    check()
