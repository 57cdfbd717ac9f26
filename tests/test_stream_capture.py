"""Branches on several CUDA streams as a measured alternative of the CUDA-graph runner
(``backends/cuda/runtime/stream_capture.py``).

On the CPU: the choice (a simulated runner, fake timings, the recording stream API of
``test_streams``), the cached decisions, the report's lines, and the memory rule (every side stream
joined into stream 0 before the return, forks included; reads across streams marked). On a GPU
(``-m gpu``): random branchy modules against eager with the multi-stream capture kept, the plan run
on real streams with and without a CUDA graph, and a real measurement.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxopt.backends.cuda.runtime import cudagraph_measure
from fxopt.backends.cuda.runtime import stream_capture
from fxopt.backends.cuda.runtime.cudagraph_measure import STREAMS, STREAMS_MS
from fxopt.backends.cuda.runtime.stream_capture import stream_alternative
from fxopt.backends.cuda.runtime.streams import plan_streams, run_plan
from test_cudagraphs_cpu import _simulated_runner
from test_streams import (Builder, RecordingStreams, Refolded, branches_then_constants, check_run, random_dags,
                          real_args)

aten = torch.ops.aten
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def branchy_graph() -> fx.GraphModule:
    """Three convolutions of one input, concatenated (a tuple output, as the runner's graphs have)."""
    b = Builder()
    x = b.input("x", 1, 16, 8, 8)
    w1, w2, w3 = b.input("w1", 16, 16, 3, 3), b.input("w2", 16, 16, 1, 1), b.input("w3", 8, 16, 3, 3)
    a = b.op(aten.relu.default, b.conv(x, w1, padding=1), name="a")
    c = b.op(aten.relu.default, b.conv(x, w2), name="c")
    d = b.conv(x, w3, padding=1, name="d")
    b.g.output((b.op(aten.cat.default, [a, c, d], 1, name="cat"),))
    return fx.GraphModule(torch.nn.Module(), b.g)


def _alternative(gm, n=4, make_api=None):
    return stream_alternative(gm, n, make_api=make_api or (lambda n, device: RecordingStreams()))


def _timings(multi_ms, log=None):
    def medians(fns, *a):
        if log is not None:
            log.append(sorted(fns))
        return {k: {"graph_ms": 1.0, "plain_ms": 2.0, STREAMS_MS: multi_ms}.get(k, 5.0) for k in fns}
    return medians


@pytest.fixture
def tiny_branches(monkeypatch):
    """Branches of any size are worth a stream (the test graphs are small)."""
    monkeypatch.setattr(stream_capture, "CAPTURE_MIN_US", 0.0)


def test_choose_keeps_one_stream_unless_the_multi_stream_capture_clearly_wins():
    from fxopt.backends.cuda.runtime.cudagraphs import choose

    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, STREAMS_MS: 0.98}, 0.03) == "optimized graph"
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, STREAMS_MS: 0.9}, 0.03) == STREAMS
    # compared with the best single-stream way (here the capture without early launches)
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "graph_no_pdl_ms": 0.8, STREAMS_MS: 0.79}, 0.03) != STREAMS
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "graph_no_pdl_ms": 0.8, STREAMS_MS: 0.7}, 0.03) == STREAMS
    # the baseline then has to beat it by the margin too
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, STREAMS_MS: 0.9, "baseline_graph_ms": 0.88}, 0.03) == STREAMS
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, STREAMS_MS: 0.9, "baseline_graph_ms": 0.8},
                  0.03) == "baseline graph"
    assert STREAMS in cudagraph_measure.RUNS  # a cached decision for it is honoured


def test_no_alternative_without_a_branch_or_with_one_stream(tiny_branches):
    assert _alternative(branchy_graph(), n=1) is None
    b = Builder()
    x, w = b.input("x", 1, 4, 6, 6), b.input("w", 4, 4, 3, 3)
    chain = b.done(b.op(aten.relu.default, b.conv(b.op(aten.relu.default, b.conv(x, w, padding=1)), w, padding=1)))
    assert _alternative(chain) is None


@pytest.mark.parametrize("multi_ms", [0.9, 0.99])
def test_runner_keeps_the_multi_stream_capture_only_where_it_wins(monkeypatch, tiny_branches, multi_ms):
    measured = []
    monkeypatch.setattr(cudagraph_measure, "_alternating_medians", _timings(multi_ms, measured))
    gm = branchy_graph()
    args = real_args(gm)
    alt = _alternative(gm)
    assert alt.used == 3 and alt.lines[0].startswith("streams: 3 used, 2 branches")
    runner = _simulated_runner(gm, [1, 2, 3], real_decide=True, streams=alt)
    want = gm(*args)[0]
    out = runner(*args)
    torch.testing.assert_close(out[0], want)
    assert measured == [["graph_ms", "plain_ms", STREAMS_MS]] and runner.captures == 2  # one stream, three
    win = multi_ms == 0.9
    d = runner.decisions()[0]
    assert d["runs"] == (STREAMS if win else "optimized graph") and d[STREAMS_MS] == multi_ms
    assert d["streams"] == {"used": 3, "single_ms": 1.0, "multi_ms": multi_ms, "kept": "multi" if win else "single"}
    entry = next(iter(runner.graphs.values()))
    assert (entry.fn is alt.fn) is win and len(entry.instances) == 1
    kept = "kept 3 streams" if win else "kept one stream"
    assert alt.lines[-1] == (f"streams: inputs (1, 16, 8, 8) float32: one stream 1.000 ms, 3 streams "
                             f"{multi_ms:.3f} ms ({(1 - multi_ms) * 100:+.1f} %): {kept}")
    log = alt.multi.api.log
    before = len(log)
    del out
    torch.testing.assert_close(runner(*args)[0], want)  # a replay: of the multi-stream capture where kept
    assert (len(log) > before) is win
    held = runner(*args)  # outputs held: a second capture serves, of the kept callable
    before = len(log)
    torch.testing.assert_close(runner(*args)[0], want)
    assert len(entry.instances) == 2 and (len(log) > before) is win
    assert len(alt.lines) == 3 + 1 and held  # one line per signature, not per call


def test_decisions_are_cached_by_plan_and_captured_directly(monkeypatch, tiny_branches):
    from fxopt.autotune import AutotuneCache

    measured = []
    monkeypatch.setattr(cudagraph_measure, "_alternating_medians", _timings(0.5, measured))
    cache, gm = AutotuneCache(None), branchy_graph()
    args = real_args(gm)

    def runner(streams):
        return _simulated_runner(gm, [1, 2, 3], real_decide=True, streams=streams,
                                 decisions_cache=(cache, "dev", "graphs-hash"))

    first = runner(_alternative(gm))
    first(*args)
    assert len(measured) == 1 and first.decisions()[0]["runs"] == STREAMS
    alt = _alternative(gm)
    again = runner(alt)  # same graphs, same plan: not measured, the multi-stream way captured at once
    torch.testing.assert_close(again(*args)[0], gm(*args)[0])
    d = again.decisions()[0]
    assert len(measured) == 1 and d["cached"] is True and d["runs"] == STREAMS and again.captures == 2
    assert d["streams"]["kept"] == "multi" and alt.lines[-1].endswith("(cached decision)")
    assert next(iter(again.graphs.values())).fn is alt.fn
    single = runner(None)  # without the alternative the decision is another one: measured
    single(*args)
    assert len(measured) == 2 and single.decisions()[0]["runs"] == "optimized graph"
    assert "streams" not in single.decisions()[0]
    assert stream_alternative(gm, 2).key != stream_alternative(gm, 4).key  # another plan, another key


def test_not_measured_or_a_refused_capture_keeps_one_stream(monkeypatch, tiny_branches):
    gm = branchy_graph()
    args = real_args(gm)
    monkeypatch.setattr(cudagraph_measure, "_free_bytes", lambda: -1.0)  # nothing would fit
    alt = _alternative(gm)
    r = _simulated_runner(gm, [1, 2, 3], real_decide=True, streams=alt)
    torch.testing.assert_close(r(*args)[0], gm(*args)[0])
    d = r.decisions()[0]
    assert d["runs"] == "optimized graph" and r.captures == 1
    assert d["streams"] == {"used": 3, "single_ms": None, "multi_ms": None, "kept": "single"}
    assert "not measured (the plain run and the other captures would need" in alt.lines[-1]
    monkeypatch.undo()
    monkeypatch.setattr(stream_capture, "CAPTURE_MIN_US", 0.0)
    measured = []
    monkeypatch.setattr(cudagraph_measure, "_alternating_medians", _timings(0.5, measured))

    def refuse(n, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    alt = _alternative(gm, make_api=refuse)
    r = _simulated_runner(gm, [1, 2, 3], real_decide=True, streams=alt)
    torch.testing.assert_close(r(*args)[0], gm(*args)[0])
    d = r.decisions()[0]
    assert measured == [["graph_ms", "plain_ms"]] and d["runs"] == "optimized graph"  # the others still timed
    assert d["streams"]["failed"] == "RuntimeError: operation not permitted when stream is capturing"
    assert d["streams"]["kept"] == "single" and "not measured (RuntimeError: operation" in alt.lines[-1]


def test_report_lists_the_multi_stream_time():
    from fxopt.report import _cuda_graph_lines

    class Runner:
        def decisions(self):
            return [{"runs": STREAMS, "graph_ms": 1.0, STREAMS_MS: 0.8, "plain_ms": 2.0}]

    line = _cuda_graph_lines(0, Runner())[0]
    assert line.startswith(f"graph 0: CUDA graph runs the {STREAMS}: optimized replay 1.000 ms, "
                           "multi-stream replay 0.800 ms")


def test_the_lowered_graph_runs_on_the_plan(tiny_branches):
    """What a capture runs: the cuda executor's lowered graph (fused regions, the folded constants)
    through ``run_plan`` on the plan of its alternative, with gm's values (CPU: reference kernels)."""
    import fxopt

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 16, 1)
            self.c = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.BatchNorm2d(8))

        def forward(self, x):
            return torch.cat([torch.relu(self.a(x)), torch.sigmoid(self.b(x)) * x, self.c(x)], 1)

    report = fxopt.explain(Branches().eval(), torch.randn(1, 16, 8, 8), options={"executor": "cuda", "streams": 4})
    gm = report.graphs[0].lowered.fn
    gm = getattr(gm, "__wrapped__", gm)  # cuDNN's choosing around it
    lines = list(report.graphs[0].executor_details["streams"])
    alt = stream_alternative(gm, 4, lines=lines, make_api=lambda n, device: RecordingStreams())
    assert alt.used == 3 and lines[0].startswith("streams: 3 used, 2 branches")  # replaced by the captured plan
    args = [torch.rand(n.meta["val"].shape) + 0.5 for n in gm.graph.nodes if n.op == "placeholder"]
    check_joined(check_run(gm, alt.plan, args).log)


# ------------------------------------------------------------------ the memory rule, on the CPU
def check_joined(log: list) -> None:
    """Replays the stream API's log with vector clocks (an event carries what its stream had done;
    a wait merges it): when ``run_plan`` returns, stream 0 knows every action of every side stream,
    its waits included (a stream forked into a capture and never joined fails the capture; its
    tensors' memory would be the caller's again while it still reads them)."""
    clock, events = {}, {}
    for entry in log:
        if entry[0] in ("begin", "record_stream"):
            continue
        s = entry[1]
        c = clock.setdefault(s, {})
        if entry[0] == "record":
            events[entry[2]] = dict(c)
            continue
        if entry[0] == "wait":
            for t, v in events[entry[2]].items():
                c[t] = max(c.get(t, 0), v)
        c[s] = c.get(s, 0) + 1  # a wait or a node of stream s
    main = clock.get(0, {})
    for s, c in clock.items():
        assert s == 0 or main.get(s, 0) >= c[s], f"stream {s} not joined into stream 0: {log}"


def test_a_side_stream_forked_after_its_last_node_is_joined():
    """The folded constants after a side stream's last node: every side stream waits for them (a
    fork) and has nothing after; it is joined by an event of its own before the return."""
    root = torch.nn.Module()
    root.fxopt_constants = Refolded()
    b = Builder()
    x, main, early, consts = branches_then_constants(b, 1, 16, 8)
    k2 = b.op(operator.getitem, consts, 1)
    tail = b.op(aten.add.Tensor, main, early, name="tail")
    late = b.op(aten.relu.default, b.conv(x, k2, name="late_conv"), name="late")
    b.g.output(b.op(aten.cat.default, [tail, late], 1))
    gm = fx.GraphModule(root, b.g)
    plan = plan_streams(gm, 4, min_us=0.0)
    assert plan.assign["early"] != 0 and plan.assign["early"] != plan.assign["late_conv"] != 0
    api = check_run(gm, plan, real_args(gm))
    t = plan.assign["early"]  # joined by "tail" before the constants, forked again after them
    assert api.log.index(("wait", t, consts.name)) < api.log.index(("record", t, f"join {t}")) \
        < api.log.index(("wait", 0, f"join {t}"))
    assert not any(e[2].startswith("join") for e in api.log if e[0] == "record" and e[1] == plan.assign["late"])
    check_joined(api.log)


def test_a_view_read_on_another_stream_marks_its_base():
    """A view made on a side stream of a tensor made on stream 0: the view node reads the base on
    its stream, so the base is marked for that stream (its memory is the base's block)."""
    b = Builder()
    x, w = b.input("x", 1, 8, 6, 6), b.input("w", 8, 8, 3, 3)
    base = b.op(aten.relu.default, b.conv(x, w, padding=1), name="base")
    on0 = b.op(aten.view.default, b.conv(base, w, padding=1, name="on0"), [1, 8, 36])
    view = b.op(aten.view.default, base, [1, 8, 36], name="view")
    side = b.op(aten.sigmoid.default, view, name="side")
    gm = b.done(b.op(aten.mul.Tensor, on0, side, name="out"))
    plan = plan_streams(gm, 2, min_us=0.0)
    assert plan.assign["side"] == plan.assign["view"] == 1 and plan.assign["base"] == 0
    assert ("base", 1) in plan.cross_reads["view"]
    api = check_run(gm, plan, real_args(gm))
    assert ("record_stream", 1, (1, 8, 6, 6)) in api.log
    check_joined(api.log)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gm=random_dags(), n=st.integers(2, 4))
def test_random_dags_join_every_side_stream(gm, n):
    plan = plan_streams(gm, n, min_us=0.0)
    api = RecordingStreams()
    run_plan(gm, plan, api, real_args(gm))
    check_joined(api.log)


# ------------------------------------------------------------------ on a GPU
class Branchy(nn.Module):
    """A random DAG over one input (``spec``: (kind, operands) in order, operands any earlier
    values): convolution branches (fan-out: several read one value; nested: a branch of a branch),
    residual adds and gates across branches (fan-in), concatenations of branches brought back by a
    1x1 convolution, pools; the values nothing reads are concatenated into the output."""

    def __init__(self, c: int, spec: list, bn: bool):
        super().__init__()
        self.spec = spec
        self.mods = nn.ModuleList()
        for kind, ins in spec:
            if kind == "conv":
                layers = [nn.Conv2d(c, c, 3, padding=1)] + ([nn.BatchNorm2d(c)] if bn else []) + [nn.ReLU()]
                self.mods.append(nn.Sequential(*layers))
            elif kind == "cat":
                self.mods.append(nn.Conv2d(c * len(ins), c, 1))
            else:
                self.mods.append(nn.Identity())

    def forward(self, x):
        vals, read = [x], set()
        for (kind, ins), mod in zip(self.spec, self.mods):
            ops = [vals[i] for i in ins]
            read.update(ins)
            if kind == "conv":
                v = mod(ops[0])
            elif kind == "add":
                v = ops[0] + ops[1]
            elif kind == "gate":
                v = ops[0] * torch.sigmoid(ops[1])
            elif kind == "cat":
                v = mod(torch.cat(ops, 1))
            else:
                v = F.max_pool2d(ops[0], 3, 1, 1)
            vals.append(v)
        return torch.cat([v for i, v in enumerate(vals) if i not in read], 1)


@st.composite
def branchy_cases(draw):
    c = draw(st.sampled_from([16, 32]))
    spec = [("conv", [0]), ("conv", [0])]  # at least one fork
    for _ in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["conv", "conv", "add", "gate", "cat", "pool"]))
        k = {"add": 2, "gate": 2, "cat": draw(st.integers(2, 3))}.get(kind, 1)
        spec.append((kind, [draw(st.integers(0, len(spec))) for _ in range(k)]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    model = Branchy(c, spec, draw(st.booleans())).eval().cuda().to(dtype)
    x = torch.randn(draw(st.integers(1, 2)), c, draw(st.sampled_from([8, 14])), 14, device="cuda", dtype=dtype)
    return model, x


def _multi_wins(fns, *a):
    """Each alternative replayed once (a real replay), then times that make the multi-stream one win."""
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    return {k: {"graph_ms": 1.0, STREAMS_MS: 0.5}.get(k, 2.0) for k in fns}


def _close(got, want):
    from fxopt.tolerances import relative_error

    assert relative_error(got, want) <= (1e-3 if want.dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@gpu
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(case=branchy_cases(), n=st.integers(2, 4))
def test_random_branches_match_eager_with_the_multi_stream_capture(monkeypatch, case, n):
    """torch.compile with option streams, the multi-stream capture kept (fake times): eager's values
    at the first call, at replays with new inputs and while earlier outputs are held."""
    import fxopt

    monkeypatch.setattr(stream_capture, "CAPTURE_MIN_US", 0.0)
    monkeypatch.setattr(cudagraph_measure, "_alternating_medians", _multi_wins)
    model, x = case
    graphs = []
    compiled = fxopt.testing.compile_with_fxopt(model, {"streams": n, "autotune_cache": False}, graphs)
    with torch.no_grad():
        first = compiled(x)
        _close(first, model(x))
        for _ in range(3):  # replays with new values in the same input; `first` held meanwhile
            x.copy_(torch.randn_like(x))
            _close(compiled(x), model(x))
        _close(compiled(x.clone()), model(x))  # the input elsewhere: copied into a capture's buffer
    runner = graphs[0].lowered.cudagraph_runner
    lines = graphs[0].executor_details["streams"]
    if runner.streams is None:  # the plan kept every kernel on stream 0
        assert "every kernel on stream 0" in lines[0]
        return
    d = runner.decisions()[0]
    assert d["runs"] == STREAMS and d["streams"]["kept"] == "multi" and d["streams"]["used"] >= 2
    assert any(line.endswith(f"kept {d['streams']['used']} streams") for line in lines)


@pytest.mark.gpu
@gpu
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=branchy_cases(), n=st.integers(2, 4))
def test_random_branches_on_real_streams_with_and_without_a_cuda_graph(case, n):
    """The ATen graph of a branchy module run by ``run_plan`` on CUDA streams: eager's values
    uncaptured, and captured in a CUDA graph (side streams forked from the capturing stream and
    joined back) replayed on new inputs."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxopt.backends.cuda.runtime.stream_capture import MultiStream

    model, x = case
    with torch.no_grad():
        gm = make_fx(lambda t: model(t))(x)
        plan = plan_streams(gm, n, min_us=0.0)
        assert plan.branches
        multi = MultiStream(gm, plan)
        _close(multi(x), model(x))
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            multi(static)  # warm-up off the capturing stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = multi(static)
        for _ in range(3):
            static.copy_(torch.randn_like(static))
            graph.replay()
            _close(out, model(static))


class Inception(nn.Module):
    def __init__(self, c=192):
        super().__init__()
        self.b1 = nn.Conv2d(c, 64, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c, 96, 1), nn.ReLU(), nn.Conv2d(96, 128, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(c, 16, 1), nn.ReLU(), nn.Conv2d(16, 32, 5, padding=2))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, 32, 1))

    def forward(self, x):
        return F.relu(torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1))


def inception_blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Inception(), nn.Conv2d(256, 192, 1), Inception()).eval()


@pytest.mark.gpu
@gpu
def test_float32_inception_blocks_on_streams(monkeypatch):
    """The multi-stream capture that ``scripts/sanitize.sh --streams`` runs under racecheck: float32
    with TF32 off and fxopt's direct convolutions, so that no tensor-core library kernel runs (the
    tool fails inside cuDNN's); the plan is captured and measured, and the values are eager's on
    the CPU in float32."""
    import fxopt

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = inception_blocks()
    x = torch.randn(1, 192, 28, 28)
    with torch.no_grad():
        want = model(x)
        graphs = []
        compiled = fxopt.testing.compile_with_fxopt(
            model.cuda(), {"streams": 4, "conv_algorithm": "direct", "autotune_cache": False}, graphs)
        for _ in range(3):
            got = compiled(x.cuda())
    s = graphs[0].executor_details["cudagraph_runner"].decisions()[0]["streams"]
    assert s["used"] >= 2 and s["multi_ms"] is not None, s
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@gpu
def test_inception_block_measured_and_explained():
    """A real measurement (batch 1, fp16, Inception-style blocks): eager's values, both times in
    ``decisions()``, the kept one the one ``choose`` picks, and ``fxopt explain`` printing the plan
    and the decision; without CUDA graphs the plan is listed as not run."""
    import fxopt
    from fxopt.backends.cuda.runtime.cudagraphs import choose

    model = inception_blocks().cuda().half()
    x = torch.randn(1, 192, 28, 28, device="cuda", dtype=torch.half)
    opts = {"streams": 4, "autotune_cache": False}
    report = fxopt.explain(model, x, options=opts)
    runner = report.graphs[0].lowered.cudagraph_runner
    assert runner.streams is not None
    d = runner.decisions()[0]
    s = d["streams"]
    assert s["multi_ms"] is not None and s["single_ms"] is not None, d
    assert s["used"] >= 2 and s["single_ms"] > 0 and s["multi_ms"] > 0
    assert d["runs"] == choose(d, runner.margin) and (s["kept"] == "multi") is (d["runs"] == STREAMS)
    text = report.fusion_table()
    assert "streams: inputs (1, 192, 28, 28) float16: one stream" in text and "multi-stream replay" in text
    graphs = []
    compiled = fxopt.testing.compile_with_fxopt(model, opts, graphs)
    with torch.no_grad():
        _close(compiled(x), model(x))
    off = fxopt.explain(model, x, options={**opts, "cudagraphs": False})
    assert off.graphs[0].executor_details["streams"][-1].startswith("streams: not run (CUDA graphs off")
