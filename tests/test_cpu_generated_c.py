"""The cpu executor's generated C way (backends/cpu_c.py, c_source.py, c_emit.py, c_kernels.py): whole
graphs as one C function, checked against eager on random CNNs and on each op's corner cases
(padding, strides, dilation, groups, pools' modes, NaN), declined with a reason where it does not
handle a graph, and chosen by the runner only where it measures faster and its outputs match."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from torch._dynamo.backends.common import aot_autograd

import fxopt
from fxopt.backends import cpu_c
from fxopt.backends.c_build import CompileError, build
from fxopt.backends.c_emit import Declined
from fxopt.backends.c_source import ENTRY, generate
from fxopt.testing import SeedCNN
from fxopt.testing.strategies import cnn_cases
from test_cpu_executor import check_fresh_outputs_and_reread_inputs, check_watched_bound_call

pytestmark = pytest.mark.skipif(cpu_c.why_unavailable() is not None, reason=str(cpu_c.why_unavailable()))


@pytest.fixture(autouse=True)
def _generated_c_on(monkeypatch):
    """The option's default as users have it (the suite's conftest turns it off elsewhere)."""
    monkeypatch.setenv("FXOPT_CPU_GENERATED_C", "1")


def aten_graph(model: nn.Module, x: torch.Tensor):
    """(the graph AOTAutograd hands a backend, its real flat arguments) for ``model(x)``."""
    got = {}

    def compiler(gm, _):
        def run(*args):
            got["args"] = list(args)
            return gm(*args)
        got["gm"] = gm
        return run

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=compiler), dynamic=False)(x)
    return got["gm"], got["args"]


def run_generated(gm, args) -> list:
    runner = cpu_c.CRunner(gm, [], watch=False)
    out = runner(*args)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def check(model: nn.Module, x: torch.Tensor, rtol=1e-4, atol=1e-5) -> None:
    model = model.eval()
    gm, args = aten_graph(model, x)
    got = run_generated(gm, args)
    with torch.no_grad():
        want = model(x)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)


class Convs(nn.Module):
    def __init__(self, cin, cout, k, stride, padding, dilation, groups, act):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, padding, dilation, groups)
        self.bn = nn.BatchNorm2d(cout)
        self.act = act
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


@pytest.mark.parametrize("cin,cout,k,stride,padding,dilation,groups,size", [
    (3, 6, 5, 1, 0, 1, 1, 32),    # seedcnn's first layer: along the rows
    (6, 16, 5, 1, 0, 1, 1, 14),   # small image, 16 channels: along the channels
    (16, 32, 3, 1, 1, 1, 1, 16),  # padding
    (8, 8, 3, 2, 1, 1, 8, 17),    # depthwise, stride 2, odd size
    (4, 12, 3, 1, 2, 2, 2, 11),   # dilation, groups
    (5, 7, (1, 3), (2, 1), (0, 1), 1, 1, 9),  # rectangular kernel and strides, odd channel counts
    (3, 40, 3, 2, 1, 1, 1, 40),   # a strided row wider than a vector, several channel tiles
])
def test_convolutions_match_eager(cin, cout, k, stride, padding, dilation, groups, size):
    """Each geometry with each activation as its epilogue: five convolutions of one input in one graph
    (one compile), each with its BatchNorm and activation absorbed."""
    torch.manual_seed(0)
    acts = [nn.ReLU(), nn.Hardswish(), nn.SiLU(), nn.ReLU6(), nn.GELU()]
    model = Each(nn.ModuleList(Convs(cin, cout, k, stride, padding, dilation, groups, a) for a in acts)).eval()
    x = torch.randn(2, cin, size, size)
    gm, args = aten_graph(model, x)
    src = generate(gm, args).source
    assert all(f"+ {name}" in src for name in ("relu", "hardswish", "silu", "hardtanh", "gelu")), src[:2000]
    check(model, x)


class Each(nn.Module):
    """Every module of ``mods`` on the same input."""

    def __init__(self, mods):
        super().__init__()
        self.mods = mods

    def forward(self, x):
        return tuple(mod(x) for mod in self.mods)


def test_layouts_both_taken():
    """The layout choice: a wide row fills the lanes along the row, a 10x10 image with 16 channels
    along the channels; both appear in the source."""
    gm, args = aten_graph(SeedCNN().eval(), torch.randn(1, 3, 32, 32))
    src = generate(gm, args).source
    assert "convolution along rows" in src and "convolution along channels" in src


class Pools(nn.Module):
    def forward(self, x):
        a = F.max_pool2d(x, 3, 2, 1, ceil_mode=True)
        b = F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)
        c = F.avg_pool2d(x, 2)
        d = F.adaptive_avg_pool2d(x, (3, 2))
        return a, b, c, d, x.mean((2, 3), keepdim=True), torch.sigmoid(x) * x.mean((-1, -2), keepdim=True)


def test_pools_and_broadcasts_match_eager():
    torch.manual_seed(0)
    check(Pools(), torch.randn(2, 3, 9, 7))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pools_and_pointwise_shared_out_over_threads(threads):
    """At batch 1 (no tiles) each pool, mean and elementwise layer shares its planes out over the
    threads, as the convolutions do its rows: the same outputs at any thread count, one with more
    threads than planes (3 over a 1x1x...) included."""
    torch.manual_seed(0)
    m = Pools().eval()
    x = torch.randn(1, 3, 9, 7)
    gm, args = aten_graph(m, x)
    runner = cpu_c.CRunner(gm, [], watch=False, threads=threads)
    got = runner(*args)
    src = next(iter(runner.sources.values()))
    assert src.count("for (int q = q_0; q < q_1; q++)") >= 6  # 4 pools, 2 means, the sigmoid and product
    assert "if (part != 0) return;" not in src.split("/* output")[0]
    with torch.no_grad():
        want = m(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    one = cpu_c.CRunner(gm, [], watch=False, threads=1)(*args)
    for g, w in zip(got, one):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_nan_propagates_like_eager():
    m = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Hardtanh())
    x = torch.randn(1, 2, 8, 8)
    x[0, 0, 3, 3] = float("nan")
    check(m, x)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        y = F.relu(self.a(x))
        y = F.relu(self.b(y) + x)  # the add absorbed into the convolution's store
        z = y - 0.5 * x
        return self.head(z.flatten(1)), y


def test_residual_epilogue_and_outputs_in_place():
    torch.manual_seed(0)
    m = Residual().eval()
    gm, args = aten_graph(m, torch.randn(3, 4, 6, 6))
    src = generate(gm, args).source
    assert "+ add" in src.replace("add_", "add")  # the residual add is a convolution's epilogue
    check(m, torch.randn(3, 4, 6, 6))


@settings(deadline=None)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,)))
def test_random_cnns_match_eager_or_decline(case):
    """Random CNNs: the generated C gives eager's outputs, or declines with a reason naming a node."""
    model = case.model.eval()
    gm, args = aten_graph(model, case.inputs[0])
    try:
        got = run_generated(gm, args)
    except Declined as e:
        assert str(e)
        return
    with torch.no_grad():
        want = model(*case.inputs)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_declines_name_the_node():
    class Up(nn.Module):
        def forward(self, x):
            return torch.cat([x, x + 1], 1)

    gm, args = aten_graph(Up(), torch.randn(1, 2, 4, 4))
    with pytest.raises(Declined, match="cat"):
        generate(gm, args)
    gm, args = aten_graph(nn.Conv2d(2, 2, 3).double(), torch.randn(1, 2, 5, 5, dtype=torch.float64))
    with pytest.raises(Declined, match="float32"):
        generate(gm, args)


def test_large_graphs_declined():
    """Above 60 MFLOP an image (a 224x224 first layer: 170) library kernels win: declined."""
    x = torch.randn(2, 3, 224, 224)
    gm, args = aten_graph(nn.Conv2d(3, 64, 3).eval(), x)
    with pytest.raises(Declined, match="MFLOP an image"):
        cpu_c.CRunner(gm, [i for i, a in enumerate(args) if a.data_ptr() != x.data_ptr()], watch=False)(*args)


def test_compile_error_carries_log_and_source():
    with pytest.raises(CompileError) as info:
        build("void fxopt_run(void** A, char* W, int P) { this is not C; }\n", ENTRY)
    assert "this is not C" in str(info.value) and info.value.log


def test_watched_weights_lay_out_again():
    """An in-place change or a replaced weight: the channel-layout weights are laid out again."""
    def f(x, w, b):
        return (torch.relu(F.conv2d(x, w, b)),)

    x, w, b = torch.randn(1, 6, 14, 14), torch.randn(16, 6, 5, 5), torch.randn(16)
    gm = torch.fx.symbolic_trace(lambda x, w, b: (torch.ops.aten.relu.default(
        torch.ops.aten.convolution.default(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)),))
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x, w, b)
    way = cpu_c.CRunner(gm, [1, 2], watch=True)
    assert "along channels" in generate(gm, [x, w, b]).source
    check_watched_bound_call(way, f, x, w, b)


def test_through_the_cpu_executor():
    """fxopt explain and torch.compile: the runner times the generated C with its other ways (the
    report names it), checks it, and the outputs are fresh and follow the inputs."""
    torch.manual_seed(0)
    m, x = SeedCNN().eval(), torch.randn(1, 3, 32, 32)
    r = fxopt.explain(m, x, options={"executor": "cpu", "autotune_cache": False})
    (d,) = r.graphs[0].executor_details["cpu_runner"].decisions()
    assert "generated_c_ms" in d, d
    assert "generated C" in str(r)
    compiled = torch.compile(m, backend="fxopt", options={"executor": "cpu", "autotune_cache": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    check_fresh_outputs_and_reread_inputs(compiled, m, x)


def test_option_off():
    r = fxopt.explain(SeedCNN().eval(), torch.randn(1, 3, 32, 32),
                      options={"executor": "cpu", "autotune_cache": False, "cpu_generated_c": False})
    (d,) = r.graphs[0].executor_details["cpu_runner"].decisions()
    assert "generated_c_ms" not in d


@pytest.mark.parametrize("model", [SeedCNN, lambda: Residual()], ids=["seedcnn", "residual"])
def test_bfloat16_models_widen_and_round(model):
    """A bfloat16 model: its inputs and weights widened to float32 where read, the outputs rounded to
    nearest even: within bfloat16's tolerance of float32 eager, and closer to it than eager bf16."""
    from fxopt.tolerances import tolerance

    torch.manual_seed(0)
    m = model().eval()
    x = torch.randn(3, 3, 32, 32) if isinstance(m, SeedCNN) else torch.randn(3, 4, 6, 6)
    with torch.no_grad():
        want = m(x)
    mb, xb = m.to(torch.bfloat16), x.to(torch.bfloat16)
    gm, args = aten_graph(mb, xb)
    got = run_generated(gm, args)
    with torch.no_grad():
        eager = mb(xb)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    eager = list(eager) if isinstance(eager, (list, tuple)) else [eager]
    for g, w, e in zip(got, want, eager):
        assert g.dtype == torch.bfloat16
        err = ((g.float() - w).abs().max() / w.abs().max()).item()
        assert err <= tolerance(torch.bfloat16)[0]
        assert err <= ((e.float() - w).abs().max() / w.abs().max()).item() * 1.5 + 4e-3


def test_bfloat16_rounding_matches_torch():
    """to_bf16 rounds as torch does: nearest even, NaN quiet, infinities and overflow kept."""
    vals = torch.tensor([1.0, 1.00390625, 1.01171875, -2.5e-39, 3.4e38, float("inf"), float("-inf"),
                         float("nan"), 65504.0, -0.0] + torch.randn(200).tolist())

    class Id(nn.Module):
        def forward(self, x):
            return (x * 1.0).to(torch.bfloat16)

    gm, args = aten_graph(Id(), vals)
    (got,) = run_generated(gm, args)
    want = vals.to(torch.bfloat16)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)  # a NaN's payload may differ (torch's vector path keeps it)
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.parametrize("batch", [2, 7, 16])
@pytest.mark.parametrize("threads", [1, 2])
def test_batches_run_in_tiles_over_threads(batch, threads):
    """A batch-independent graph runs a tile of images at a time (8, 4, 2 or 1 dividing the batch),
    the tiles over the threads, each thread's weights laid out in its own workspace: eager's outputs."""
    from fxopt.backends import c_tiles

    torch.manual_seed(0)
    m = SeedCNN().eval()
    x = torch.randn(batch, 3, 32, 32)
    gm, args = aten_graph(m, x)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runner = cpu_c.CRunner(gm, [i for i, a in enumerate(args) if a.data_ptr() != x.data_ptr()], watch=False)
        got = runner(*args)
        again = runner(*args)
    finally:
        torch.set_num_threads(before)
    assert list(runner.why_not_tiled.values()) == [None]
    assert c_tiles.DRIVER in next(iter(runner.sources.values()))
    with torch.no_grad():
        torch.testing.assert_close(got[0], m(x), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(again[0], got[0], rtol=0, atol=0)


class MixesSamples(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.conv, self.how = nn.Conv2d(3, 4, 3), how

    def forward(self, x):
        y = torch.relu(self.conv(x))
        if self.how == "mean":  # over the batch
            return y * y.mean((0, 1, 2, 3), keepdim=True)
        if self.how == "view":  # the batch moved into another dimension, by a size written in the graph
            return y.flatten().view(2, -1)
        return y.flatten(1).t()  # the batch transposed


@pytest.mark.parametrize("how,why", [("mean", "reads the batch"), ("view", "does not run at"),
                                     ("transpose", "t: a value that neither carries the batch")])
def test_graphs_that_mix_samples_run_whole(how, why):
    """A graph that mixes the batch's samples is not tiled (why is kept) and still gives eager's outputs."""
    torch.manual_seed(0)
    m, x = MixesSamples(how).eval(), torch.randn(4, 3, 8, 8)
    gm, args = aten_graph(m, x)
    runner = cpu_c.CRunner(gm, [i for i, a in enumerate(args) if a.data_ptr() != x.data_ptr()], watch=False)
    got = runner(*args)
    with torch.no_grad():
        torch.testing.assert_close(got[0], m(x), rtol=1e-4, atol=1e-5)
    (reason,) = runner.why_not_tiled.values()
    assert why in reason


@settings(deadline=None, max_examples=15)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), max_layers=4))
def test_random_optimized_graphs_match_eager_or_decline(case):
    """fxopt's optimized graph (fused convolutions and linear layers, the cpu pipeline's layouts: what a
    package holds): the generated C gives eager's outputs, or declines with a reason."""
    from fxopt.testing.fusion import capture

    model = case.model.eval()
    options = {"executor": "cpu", "cpu_onnxruntime": False, "cpu_generated_c": False, "autotune_cache": False}
    for g, args in capture(model, list(case.inputs), options):
        try:
            got = run_generated(g.after, args)
        except Declined as e:
            assert str(e)
            continue
        with torch.no_grad():
            want = g.before(*args)
        want = list(want) if isinstance(want, (list, tuple)) else [want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _feed(tc, n, all_us, one_us) -> list:
    """``n`` calls of ThreadCount ``tc`` taking ``all_us`` / ``one_us`` (numbers, or functions of the
    call's index); which count each ran (True: all threads)."""
    seq = []
    for _ in range(n):
        every = tc.pick()
        us = all_us if every else one_us
        tc.took(every, (us(tc.calls) if callable(us) else us) * 1e-6)
        seq.append(every)
    return seq


def _probe_starts(seq, best: bool) -> list:
    return [i for i, e in enumerate(seq) if e != best and (i == 0 or seq[i - 1] == best)]


def test_thread_count_follows_the_faster_and_probes_the_other():
    """ThreadCount: all threads' first WINDOW calls, then one thread's, then the count whose recent
    calls were faster, the other timed again for PROBE calls every EVERY calls while the two are
    close; each probe that finds it far slower doubles the interval, up to RARE."""
    tc = cpu_c.ThreadCount()
    W, E, R, P = tc.WINDOW, tc.EVERY, tc.RARE, tc.PROBE
    assert _feed(tc, 2 * W, 50, 40) == [True] * W + [False] * W
    seq = _feed(tc, 8 * E, 50, 40)  # one thread faster, by less than FAR: all threads in the probes only
    starts = _probe_starts(seq, False)
    assert len(starts) >= 7 and all(b - a == E for a, b in zip(starts[1:], starts[2:]))
    assert all(seq[i:i + P] == [True] * P for i in starts) and seq.count(True) == P * len(starts)
    tc = cpu_c.ThreadCount()
    seq = _feed(tc, 2 * W + 6 * R, 30, 80)  # all threads far faster: the probes of one get rarer
    starts = _probe_starts(seq, True)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] <= E + 8 and all(b >= a for a, b in zip(gaps, gaps[1:]))
    assert R - 8 <= gaps[-1] <= R + 8 and seq.count(False) <= W + P * (len(gaps) + 1)


def test_thread_count_recovers_from_a_spike():
    """A burst of slow calls of the faster count (a neighbour's) that lasts to the next decision sends
    the calls to the other; the probe that follows within EVERY calls (not RARE) brings them back.
    One that ends before the decision changes nothing."""
    tc = cpu_c.ThreadCount()
    _feed(tc, 2 * tc.WINDOW + 4 * tc.RARE, 30, 80)  # settled: one thread probed rarely
    after = tc.calls + 8 - tc.calls % 8 + 1  # the call after the next decision
    _feed(tc, 24, lambda c: 300 if after <= c < after + 3 else 30, 80)  # three slow calls, then fast ones
    assert tc.best and tc.every > tc.EVERY  # still all threads, still probing one rarely
    spike = range(tc.calls + 1, tc.calls + 11)
    seq = _feed(tc, 3 * tc.EVERY, lambda c: 300 if c in spike else 30, 80)
    away = seq.index(False)
    assert away <= 10  # switched away at the decision during the burst
    back = next(i for i in range(away, len(seq)) if seq[i:i + 8] == [True] * 8)  # its probe, then the decision
    rest = seq[back:]
    runs = _probe_starts(rest, True)
    assert back <= away + tc.SOON + 16 and all(rest[i:i + tc.PROBE + 1] == [False] * tc.PROBE + [True] for i in runs)
    assert rest.count(False) == tc.PROBE * len(runs) <= 3 * tc.PROBE  # probes, then rarer ones


def test_thread_count_per_call_gives_the_same_outputs():
    """A signature's calls on torch's threads switch between all threads and one (ThreadCount), with
    the same outputs bit for bit; a count asked for (threads=1) is not timed."""
    torch.manual_seed(0)
    m = SeedCNN().eval()
    x = torch.randn(1, 3, 32, 32)
    gm, args = aten_graph(m, x)
    params = [i for i, a in enumerate(args) if a.data_ptr() != x.data_ptr()]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner = cpu_c.CRunner(gm, params, watch=False)
        outs = [runner(*args)[0] for _ in range(40)]
        one = cpu_c.CRunner(gm, params, watch=False, threads=1)
        ref = one(*args)[0]
        one(*args)
    finally:
        torch.set_num_threads(before)
    pace = next(iter(runner.entries.values())).pace
    assert min(pace.ran.values()) >= pace.WINDOW and pace.ran[True] + pace.ran[False] == 39
    assert next(iter(one.entries.values())).pace.calls == 0
    for o in outs:
        torch.testing.assert_close(o, ref, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ref, m(x), rtol=1e-4, atol=1e-5)


class ZeroD(nn.Module):
    def forward(self, x):
        return torch.relu(x).mean((0, 1, 2, 3)), x * 2


def test_zero_dimensional_output():
    """A 0-d output (a mean over every dimension) comes back 0-d, with eager's value."""
    x = torch.randn(1, 3, 4, 5)
    gm, args = aten_graph(ZeroD(), x)
    got = run_generated(gm, args)
    want = ZeroD()(x)
    assert got[0].shape == torch.Size([]) and got[1].shape == x.shape
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1])


def test_optimized_graph_with_folded_constants_declines_in_tiles():
    """An optimized graph whose nodes' meta hold FakeTensors of a fake mode that is gone (a BatchNorm
    without affine folded into constants, as a package holds it), at a batch run in tiles: its copy
    for a tile copies no FakeTensor (a deep copy raised there), and the generator declines the
    constants' module with its name, which the runner records (not an error)."""
    from fxopt.testing.fusion import capture

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(2, 2, 1, bias=False), nn.BatchNorm2d(2, affine=False), nn.GELU()).eval()
    x = torch.randn(2, 2, 6, 6)
    options = {"executor": "cpu", "cpu_onnxruntime": False, "cpu_generated_c": False, "autotune_cache": False}
    ((g, args),) = list(capture(m, [x], options))
    with pytest.raises(Declined, match="fxopt_constants"):
        cpu_c.CRunner(g.after, [], watch=False)(*args)
