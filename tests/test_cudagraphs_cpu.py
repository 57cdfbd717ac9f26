"""The CPU-testable parts of the CUDA-graph runner: when it is refused, and the per-call weight
watch that decides whether folded constants are refreshed and whether a new graph is needed."""
import pytest
import torch

import fxopt
from fxopt.backends.cuda.runtime.cudagraphs import _flat, unsafe_reason
from fxopt.weights import WeightWatch
from fxopt.testing import SmallResNet


def test_weight_watch_sees_in_place_changes_and_replacements():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(4)]
    args = (torch.randn(2), *params, 7)  # activations, parameters, a non-tensor argument
    w = WeightWatch([1, 2, 3, 4])
    assert w.check(args) == (True, True)  # first call: everything is new
    assert w.check(args) == (False, False)
    with torch.no_grad():
        params[2].mul_(2)  # optimizer step / load_state_dict: version counter moves
    assert w.check(args) == (False, True)
    assert w.check(args) == (False, False)
    params[0].data = torch.randn(3)  # new storage under the same Parameter object
    assert w.check(args) == (True, True)
    args = (args[0], torch.nn.Parameter(torch.randn(3)), *args[2:])  # parameter object replaced
    assert w.check(args) == (True, True)
    assert w.check(list(args)) == (False, False)  # a list works like a tuple


def test_weight_watch_with_one_or_no_static_input():
    t = torch.randn(2)
    one, none = WeightWatch([0]), WeightWatch([])
    assert one.check((t,)) == (True, True) and one.check((t,)) == (False, False)
    assert none.check((t,)) == (True, True) and none.check((t,)) == (False, False)


def test_cudagraphs_refused_on_cpu_with_reasons():
    r = fxopt.explain(SmallResNet().eval(), torch.randn(1, 3, 32, 32))
    gm = r.graphs[0].after
    assert unsafe_reason(gm, "inference", "cpu") == "inputs are not on CUDA"
    assert unsafe_reason(gm, "forward", "cpu") == "inputs are not on CUDA"
    # claimed to be CUDA while a value lives on the CPU: refused, naming the node
    assert unsafe_reason(gm, "inference", "cuda") == "arg0_1 produces a CPU tensor"
    assert unsafe_reason(gm, "backward", "cuda") == "arg0_1 produces a CPU tensor"


def test_choose_keeps_the_optimized_graph_unless_the_baseline_clearly_wins():
    from fxopt.backends.cuda.runtime.cudagraphs import choose

    assert choose({"graph_ms": 1.0, "plain_ms": 2.0}, 0.03) == "optimized graph"
    assert choose({"graph_ms": 2.0, "plain_ms": 1.0}, 0.03) == "optimized plain"
    # a tie or a win inside the margin keeps the optimized graph
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "baseline_graph_ms": 1.0}, 0.03) == "optimized graph"
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "baseline_graph_ms": 0.98}, 0.03) == "optimized graph"
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "baseline_graph_ms": 0.96}, 0.03) == "baseline graph"
    # compared with the faster of the two optimized ways
    assert choose({"graph_ms": 2.0, "plain_ms": 1.0, "baseline_graph_ms": 1.5}, 0.03) == "optimized plain"
    assert choose({"graph_ms": 2.0, "plain_ms": 1.0, "baseline_graph_ms": 0.5}, 0.03) == "baseline graph"
    # the capture without programmatic dependent launch: like the baseline, only past the margin,
    # and the baseline then has to beat it
    no_pdl = "optimized graph, no early launch"
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "graph_no_pdl_ms": 0.98}, 0.03) == "optimized graph"
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "graph_no_pdl_ms": 0.9}, 0.03) == no_pdl
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "graph_no_pdl_ms": 0.9, "baseline_graph_ms": 0.88}, 0.03) == no_pdl
    assert choose({"graph_ms": 1.0, "plain_ms": 2.0, "graph_no_pdl_ms": 0.9, "baseline_graph_ms": 0.8},
                  0.03) == "baseline graph"


def test_baseline_check_is_an_option():
    assert fxopt.Options.from_any(None).baseline_check is True
    assert fxopt.Options.from_any({"baseline_check": False}).baseline_check is False


def test_lent_outputs_are_busy_while_the_caller_holds_them_or_a_view():
    from fxopt.backends.cuda.runtime.cudagraphs import _Instance, _lend

    x = torch.randn(4, 8)
    outs = (torch.randn(4, 10), torch.randn(4))
    inst = _Instance(None, {0: torch.empty(4, 8)}, None, outs, [x])
    assert inst.lendable and inst.free()
    y = _lend(inst.outputs)
    assert y[0].data_ptr() == outs[0].data_ptr() and y[0] is not outs[0]
    assert not inst.free()
    first_row = y[0][0]  # a view of a lent output keeps it busy
    del y
    assert not inst.free()
    del first_row
    assert inst.free()
    from fxopt.backends.cuda.runtime.cudagraphs import _copy_out
    copied = _copy_out([outs[0], (outs[1], None)])  # nested outputs keep their structure
    assert isinstance(copied, list) and copied[1][1] is None
    assert copied[0].data_ptr() != outs[0].data_ptr() and torch.equal(copied[1][0], outs[1])


def test_outputs_that_view_each_other_stay_views_of_each_other():
    """An output and a view of it (``return h, h.transpose(2, 3)``) share memory in eager; the
    copies handed out share one copy of it, so writing one shows in the other, as in eager."""
    from fxopt.backends.cuda.runtime.cudagraphs import _Instance

    x = torch.randn(2, 3)
    h, other = torch.randn(1, 2, 3, 4), torch.randn(5)
    for outputs in ((h, h.transpose(2, 3), other), [(h,), [h[0, 1]], other]):
        inst = _Instance(None, {}, None, outputs, [x])
        got = inst.hand_out()
        flat = [got[0], got[1], got[2]] if isinstance(got, tuple) else [got[0][0], got[1][0], got[2]]
        a, b, c = flat
        assert a.untyped_storage().data_ptr() != h.untyped_storage().data_ptr()  # a copy, not the buffer
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # one copy for both
        assert c.untyped_storage().data_ptr() == other.untyped_storage().data_ptr()  # alone: lent as it is
        assert torch.equal(a, h) and torch.equal(c, other)
        assert b.stride() == (h.transpose(2, 3) if isinstance(got, tuple) else h[0, 1]).stride()
        a.add_(1.0)
        assert torch.equal(b, (a.transpose(2, 3) if isinstance(got, tuple) else a[0, 1]))


def test_outputs_sharing_memory_are_never_lent():
    from fxopt.backends.cuda.runtime.cudagraphs import _Instance

    x, base = torch.randn(4, 8), torch.randn(8)
    assert not _Instance(None, {}, None, (base[:4], base[4:]), [x]).lendable  # two views of one buffer
    assert not _Instance(None, {}, None, (x[0],), [x]).lendable               # a view of an argument
    assert not _Instance(None, {}, None, (torch.randn(3),), [x], lend=False).lendable


def test_direct_captures_serve_only_calls_with_inputs_where_they_read_them():
    from fxopt.backends.cuda.runtime.cudagraphs import _Instance

    x, other = torch.randn(4, 8), torch.randn(4, 8)
    w = torch.randn(8)
    direct = _Instance(None, {}, {0: x.data_ptr()}, (torch.randn(4),), [x, w])
    assert direct.serves([x, w]) and not direct.serves([other, w])
    assert direct.serves([x.view(4, 8), w])  # any tensor at that address (the key fixes its layout)
    buffered = _Instance(None, {0: torch.empty(4, 8)}, None, (torch.randn(4),), [x, w])
    assert buffered.serves([other, w])


def test_cudagraphs_refused_where_the_graph_writes_an_input():
    # AOTAutograd normally returns an input mutation as an extra output (its runtime wrapper
    # copies it back); a graph that keeps the copy_ itself must not be replayed from buffers
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    g.call_function(torch.ops.aten.copy_.default, (x, y))
    g.output((y,))
    reason = unsafe_reason(torch.fx.GraphModule(torch.nn.Module(), g), "inference", "cuda")
    assert reason == "input x is written in place", reason



def test_cudagraphs_allowed_where_the_graph_writes_only_parameters_and_buffers():
    # a training forward that updates BatchNorm's running statistics (copy_ kept in the graph):
    # the buffers are read in place by every replay, so the replay writes them where they live
    g = torch.fx.Graph()
    x, rm = g.placeholder("x"), g.placeholder("running_mean")
    y = g.call_function(torch.ops.aten.mean.dim, (x, [0]))
    g.call_function(torch.ops.aten.copy_.default, (rm, y))
    g.output((y,))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert unsafe_reason(gm, "forward", "cuda", static={"running_mean"}) is None
    assert unsafe_reason(gm, "forward", "cuda") == "input running_mean is written in place"


def test_runs_that_are_not_the_calls_own_leave_written_inputs_as_they_were(monkeypatch):
    """Warm-ups before a capture and the timing runs write a buffer the graph updates in place;
    each call must change it exactly once, as an uncaptured run would."""
    from fxopt.backends.cuda.runtime import cudagraph_measure, cudagraphs

    def timing_runs(fns):  # each candidate runs (and writes the buffer) a few times
        for fn in fns.values():
            for _ in range(3):
                fn()
        return {"graph_ms": 1.0, "plain_ms": 2.0}

    monkeypatch.setattr(cudagraph_measure, "_alternating_medians", timing_runs)

    def step(buf, x):
        buf.mul_(0.5).add_(x.sum())
        return (x * 2,)

    buf, x = torch.zeros(3), torch.ones(2)
    runner = _simulated_runner(step, [0], real_decide=True, written=[0])
    expected = torch.zeros(3)
    for _ in range(3):
        torch.testing.assert_close(runner(buf, x)[0], x * 2)
        expected = expected * 0.5 + 2
        torch.testing.assert_close(buf, expected)
    with pytest.raises(ValueError, match="written in place but not static"):
        _simulated_runner(step, [], written=[0])

# ---------------------------------------------------------------------------- the runner's call path
class _SimulatedGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay recomputes the outputs in place
    from the tensors the capture read. Inputs read in place come from the runner's current call
    (``runner.current_args``), at the address the capture saw them; the simulation keeps no
    reference to them, as a CUDA graph keeps none."""

    def __init__(self, fn, args, outputs, runner=None):
        self.fn, self.outputs, self.replays, self.runner = fn, outputs, 0, runner
        caller = runner.current_args if runner is not None else ()
        self.in_place = {i: a.data_ptr() for i, a in enumerate(args)  # the caller's own tensor
                         if i in runner.dynamic and isinstance(a, torch.Tensor) and a is caller[i]} if caller else {}
        self.args = [None if i in self.in_place else a for i, a in enumerate(args)]

    def replay(self):
        self.replays += 1
        owner = getattr(self, "owner", None)  # the capture this graph belongs to
        for sharer in owner.live_sharers() if owner is not None else ():
            # a capture made in this one's pool reuses its temporaries' memory: the replay
            # overwrites that capture's lent outputs (garbage here, where a real replay writes
            # temporaries), which nobody may hold by then
            for t, way in zip(_flat(sharer.outputs), sharer.ways):
                if way == "lend":
                    t.fill_(float("nan"))
        args = list(self.args)
        for i, ptr in self.in_place.items():
            args[i] = self.runner.current_args[i]
            assert args[i].data_ptr() == ptr, "a capture replayed with an input elsewhere"
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for out, new in zip(self.outputs, self.fn(*args)):
            # an output that is an input (or a view of one) is already what it should be
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs:
                out.copy_(new)


class _SimulatedRunner:
    """A CUDA-graph runner (mixed in before ``CudaGraphRunner``) whose captures are simulated."""

    captures = 0
    current_args = None

    def __call__(self, *args):
        self.current_args = args
        try:
            return super().__call__(*args)
        finally:
            self.current_args = None

    def _capture(self, *args, **kw):
        inst = super()._capture(*args, **kw)
        inst.graph.owner = inst
        return inst

    def _record(self, fn, call_args, pool=None):
        from fxopt.backends.cuda.runtime.cudagraph_measure import _side_runs

        type(self).captures += 1
        with _side_runs(self.writes(call_args)):  # a capture draws no random numbers, writes nothing
            outputs = fn(*call_args)
        return _SimulatedGraph(fn, call_args, outputs, self), outputs, pool if pool is not None else object()


def _simulated_runner(fn, static, real_decide=False, **kw):
    """A runner whose captures are simulated; its replay-vs-plain decision is stubbed (the graph
    wins) unless ``real_decide`` (then the test stubs the timing)."""
    from fxopt.backends.cuda.runtime.cudagraphs import CudaGraphRunner

    class Simulated(_SimulatedRunner, CudaGraphRunner):
        pass

    def graph_wins(self, entry, args):
        entry.timings = {"graph_ms": 0.0, "plain_ms": 1.0}

    if not real_decide:
        Simulated._decide = graph_wins
    runner = Simulated(fn, static, **kw)
    Simulated.captures = 0
    return runner


def _matmul_runner():
    """(runner of x @ w.T with w a parameter feeding folded constants, w, x, refresh calls)"""
    refreshed = []
    runner = _simulated_runner(lambda w, x: (x @ w.T,), [0], refresh=refreshed.append, versioned=[0])
    return runner, torch.randn(5, 3), torch.randn(2, 3), refreshed


def test_repeated_calls_take_the_fast_path_and_see_new_input_values():
    runner, w, x, refreshed = _matmul_runner()
    first = runner(w, x)
    torch.testing.assert_close(first[0], x @ w.T)
    assert runner._fast is not None and runner.captures == 1 and len(refreshed) == 1
    del first  # released: the next call may hand out the same buffers
    inst = runner._fast[0]
    x.copy_(torch.randn(2, 3))  # new values at the same address: a direct capture reads them
    second = runner(w, x)
    torch.testing.assert_close(second[0], x @ w.T)
    assert inst.graph.replays == 2 and runner._fast[0] is inst and runner.captures == 1
    assert len(refreshed) == 1  # nothing changed: no refresh


def test_fast_path_declines_held_outputs_moved_inputs_and_changed_weights():
    runner, w, x, refreshed = _matmul_runner()
    held = runner(w, x)
    snapshot = held[0].clone()
    again = runner(w, x)  # `held` is still referenced: a second (buffered) capture serves
    assert runner.captures == 2 and again[0].data_ptr() != held[0].data_ptr()
    assert torch.equal(held[0], snapshot)
    del held, again
    other = torch.randn(2, 3)  # inputs elsewhere: the full path finds the buffered capture
    out = runner(w, other)
    torch.testing.assert_close(out[0], other @ w.T)
    # the buffered capture serves it, and is what the next call tries first (any input address)
    assert runner._fast[0].input_ptrs is None and runner.captures == 2
    del out
    with torch.no_grad():
        w.mul_(2)  # in place: the folded constants must be refreshed before the replay
    out = runner(w, x)
    torch.testing.assert_close(out[0], x @ w.T)
    assert len(refreshed) == 2
    del out
    w2 = torch.randn(5, 3)  # a replaced parameter: a new signature, captured anew
    out = runner(w2, x)
    torch.testing.assert_close(out[0], x @ w2.T)
    assert runner.captures == 3


def test_only_parameters_feeding_folded_constants_are_watched_for_versions():
    from fxopt.backends.cuda.runtime.cudagraphs import CudaGraphRunner

    fn = lambda *a: a  # noqa: E731
    assert CudaGraphRunner(fn, [0, 1, 2]).watch.version_indices == []  # no refresh: reads in place
    r = CudaGraphRunner(fn, [0, 1, 2], refresh=lambda a: None, versioned=[1])
    assert r.watch.indices == [0, 1, 2] and r.watch.version_indices == [1]
    assert CudaGraphRunner(fn, [0, 1], refresh=lambda a: None).watch.version_indices == [0, 1]


def test_replay_decisions_are_cached_and_a_losing_baseline_is_not_captured_again(monkeypatch):
    from fxopt.autotune import AutotuneCache
    from fxopt.backends.cuda.runtime import cudagraph_measure, cudagraphs

    measured = []

    def fake_medians(fns, rounds=4, runs=3):
        measured.append(sorted(fns))
        return {"graph_ms": 1.0, "plain_ms": 2.0, "baseline_graph_ms": times["baseline"]}

    monkeypatch.setattr(cudagraph_measure, "_alternating_medians", fake_medians)
    cache, w, x = AutotuneCache(None), torch.randn(5, 3), torch.randn(2, 3)

    def runner():
        return _simulated_runner(lambda w, x: (x @ w.T,), [0], real_decide=True, baseline=lambda w, x: (x @ w.T,),
                                 decisions_cache=(cache, "dev", "graphs-hash"))

    times = {"baseline": 5.0}  # the optimized graph wins
    first = runner()
    torch.testing.assert_close(first(w, x)[0], x @ w.T)
    assert first.captures == 2 and measured == [["baseline_graph_ms", "graph_ms", "plain_ms"]]
    second = runner()  # same graphs, same signature: no measurement, no baseline capture
    torch.testing.assert_close(second(w, x)[0], x @ w.T)
    assert second.captures == 1 and len(measured) == 1
    assert second.decisions()[0]["cached"] is True and second.decisions()[0]["runs"] == "optimized graph"
    other = second(w, torch.randn(4, 3))  # a new signature is measured
    assert len(measured) == 2 and other[0].shape == (4, 5)


def _launching(early):
    """x @ w.T, recording (in ``early``) whether each run's kernel launch was allowed to go early
    (programmatic dependent launch), counted as fxopt's launcher counts it."""
    from fxopt.backends.cuda import compiler

    def fn(w, x):
        early.append(not compiler._NO_PDL.active)
        if not compiler._NO_PDL.active:
            compiler._NO_PDL.launches += 1
        return (x @ w.T,)
    return fn


@pytest.mark.parametrize("faster", [True, False])
def test_a_graph_is_captured_without_early_launches_too_and_replays_so_where_faster(monkeypatch, faster):
    from fxopt.autotune import AutotuneCache
    from fxopt.backends.cuda.runtime import cudagraph_measure, cudagraphs

    measured = []
    no_pdl_ms = 0.8 if faster else 0.99
    monkeypatch.setattr(cudagraph_measure, "_alternating_medians",
                        lambda fns, *a: measured.append(sorted(fns)) or {"graph_ms": 1.0, "plain_ms": 2.0,
                                                                         "graph_no_pdl_ms": no_pdl_ms})
    early, cache = [], AutotuneCache(None)
    w, x = torch.randn(5, 3), torch.randn(2, 3)
    r = _simulated_runner(_launching(early), [0], real_decide=True, decisions_cache=(cache, "dev", "h"), max_instances=2)
    held = r(w, x)
    torch.testing.assert_close(held[0], x @ w.T)
    assert measured == [["graph_ms", "graph_no_pdl_ms", "plain_ms"]] and r.captures == 2
    d = r.decisions()[0]
    assert d["runs"] == ("optimized graph, no early launch" if faster else "optimized graph")
    entry = next(iter(r.graphs.values()))
    assert entry.pdl is (not faster) and len(entry.instances) == 1
    # while the first output is held, a second capture serves: made the way the decision says
    # (the simulated capture runs the function once, then the simulated replay once more)
    early.clear()
    torch.testing.assert_close(r(w, x)[0], x @ w.T)
    assert len(entry.instances) == 2 and early[0] is (not faster)
    # a cached decision: no measuring, the chosen way captured directly
    measured.clear()
    early.clear()
    again = _simulated_runner(_launching(early), [0], real_decide=True, decisions_cache=(cache, "dev", "h"))
    torch.testing.assert_close(again(w, x)[0], x @ w.T)
    assert measured == [] and again.decisions()[0]["runs"] == d["runs"]
    assert next(iter(again.graphs.values())).pdl is (not faster) and (False in early) is faster


def test_graphs_without_early_launches_or_in_training_are_not_captured_twice(monkeypatch):
    from fxopt.backends.cuda.runtime import cudagraph_measure, cudagraphs

    measured = []
    monkeypatch.setattr(cudagraph_measure, "_alternating_medians",
                        lambda fns, *a: measured.append(sorted(fns)) or {"graph_ms": 1.0, "plain_ms": 2.0})
    w, x = torch.randn(5, 3), torch.randn(2, 3)
    r = _simulated_runner(lambda w, x: (x @ w.T,), [0], real_decide=True)  # no kernel of fxopt's
    torch.testing.assert_close(r(w, x)[0], x @ w.T)
    assert measured == [["graph_ms", "plain_ms"]] and r.captures == 1


def test_measuring_declines_what_would_not_fit_in_memory_and_survives_running_out(monkeypatch):
    """The plain run and the baseline's capture each need about what the optimized capture took:
    with less free than that, or when one runs out of memory all the same (or fails with another
    error, as an allocation failing inside a capture may), the optimized graph is replayed
    unmeasured, the reason recorded and nothing cached."""
    from fxopt.autotune import AutotuneCache
    from fxopt.backends.cuda.runtime import cudagraph_measure, cudagraphs

    reserved = iter(range(0, 10**6, 100))  # every capture adds 100 bytes to what is reserved
    monkeypatch.setattr(cudagraphs, "_reserved_bytes", lambda: next(reserved))
    monkeypatch.setattr(cudagraph_measure, "_free_bytes", lambda: 150)  # not 2 x 100
    measured = []
    monkeypatch.setattr(cudagraph_measure, "_alternating_medians", lambda fns, *a: measured.append(fns) or {})
    cache, w, x = AutotuneCache(None), torch.randn(5, 3), torch.randn(2, 3)
    r = _simulated_runner(lambda w, x: (x @ w.T,), [0], real_decide=True, baseline=lambda w, x: (x @ w.T,),
                          decisions_cache=(cache, "dev", "h"))
    torch.testing.assert_close(r(w, x)[0], x @ w.T)
    d = r.decisions()[0]
    assert d["runs"] == "optimized graph" and "MiB free" in d["not_measured"]
    assert r.captures == 1 and measured == [] and cache.get("dev", r._decision_key([w, x])) is None

    def baseline(w, x):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cudagraph_measure, "_free_bytes", lambda: float("inf"))
    r = _simulated_runner(lambda w, x: (x @ w.T,), [0], real_decide=True, baseline=baseline,
                          decisions_cache=(cache, "dev", "h"))
    torch.testing.assert_close(r(w, x)[0], x @ w.T)
    torch.testing.assert_close(r(w, x)[0], x @ w.T)  # and replays after
    d = r.decisions()[0]
    assert d["runs"] == "optimized graph" and d["not_measured"].startswith("out of memory") and measured == []
    assert cache.get("dev", r._decision_key([w, x])) is None

    def failing_capture(w, x):  # an allocation failing inside a capture, raised as another error
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore")

    r = _simulated_runner(lambda w, x: (x @ w.T,), [0], real_decide=True, baseline=failing_capture,
                          decisions_cache=(cache, "dev", "h2"))
    torch.testing.assert_close(r(w, x)[0], x @ w.T)
    torch.testing.assert_close(r(w, x)[0], x @ w.T)
    d = r.decisions()[0]
    assert d["runs"] == "optimized graph" and measured == []
    assert d["not_measured"] == ("measuring failed (RuntimeError: CUDA error: operation failed due to a previous "
                                 "error during capture)")
    assert cache.get("dev", r._decision_key([w, x])) is None


def test_a_cached_baseline_decision_captures_and_replays_the_baseline():
    from fxopt.autotune import AutotuneCache

    cache = AutotuneCache(None)
    w, x = torch.randn(5, 3), torch.randn(2, 3)
    r = _simulated_runner(lambda w, x: (x @ w.T,), [0], real_decide=True, baseline=lambda w, x: (x @ w.T + 0,),
                          decisions_cache=(cache, "dev", "h"))
    r.dynamic = [1]  # (set by the first call otherwise) to compute the key the call will use
    cache.put("dev", r._decision_key([w, x]), {"runs": "baseline graph", "timings": {"graph_ms": 2.0}})
    torch.testing.assert_close(r(w, x)[0], x @ w.T)
    assert r.captures == 2 and r.decisions()[0]["runs"] == "baseline graph"
    assert r.graphs[next(iter(r.graphs))].fn is r.baseline


def test_a_signature_whose_capture_fails_runs_uncaptured(monkeypatch):
    """A capture that fails (GPU fuzz seeds 51, 62, 63: "operation failed due to a previous error
    during capture") leaves that signature running as the plain call, with one warning; another
    signature is still captured, and the failed one is not tried again."""
    runner, w, x, _ = _matmul_runner()
    record = type(runner)._record
    fail = {"shapes": {(2, 3)}}

    def record_or_fail(self, fn, call_args, pool=None):
        if tuple(call_args[1].shape) in fail["shapes"]:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        return record(self, fn, call_args, pool)
    monkeypatch.setattr(type(runner), "_record", record_or_fail)
    with pytest.warns(UserWarning, match="capturing a CUDA graph failed"):
        out = runner(w, x)
    torch.testing.assert_close(out[0], x @ w.T)
    assert len(runner.refused) == 1 and "previous error during capture" in next(iter(runner.refused.values()))
    again = runner(w, x)  # not captured again: the plain call
    torch.testing.assert_close(again[0], x @ w.T)
    assert runner.uncaptured_calls == 2 and runner.captures == 0 and not runner.graphs
    y = torch.randn(4, 3)
    torch.testing.assert_close(runner(w, y)[0], y @ w.T)  # another signature: captured
    assert runner.captures == 1 and len(runner.graphs) == 1


def test_a_size_among_the_arguments_keeps_the_fast_path():
    """A dynamic-shape graph's specialization is called with its sizes as ints beside the tensors: the
    fast path compares them by value (another value: the full path, a capture of its own)."""
    runner = _simulated_runner(lambda w, x, n: (x @ w.T * n,), [0])
    w, x = torch.randn(5, 3), torch.randn(2, 3)
    first = runner(w, x, 2)
    torch.testing.assert_close(first[0], x @ w.T * 2)
    assert runner._fast is not None and runner.captures == 1
    del first
    inst = runner._fast[0]
    out = runner(w, x, 2)
    assert inst.graph.replays == 2 and runner._fast[0] is inst and runner.captures == 1
    del out
    out = runner(w, x, 3)  # another value: not the fast path's capture
    torch.testing.assert_close(out[0], x @ w.T * 3)
    assert runner.captures == 2 and inst.graph.replays == 2


@pytest.mark.parametrize("fixed", [False, True])
def test_option_fixed_weights_folds_once_and_watches_nothing(fixed):
    """fixed_weights=True: the weights are taken as fixed (Inductor's freezing contract): folded
    constants are made once, whatever happens to the parameters later; by default an in-place
    change is seen and they are refolded."""
    from fxopt.names import FOLDED_CONSTANTS_MODULE

    torch.manual_seed(0)
    model = SmallResNet().eval()
    x = torch.randn(2, 3, 32, 32)
    graphs: list = []
    compiled = fxopt.testing.compile_with_fxopt(model, {"fixed_weights": fixed, "cpu_onnxruntime": False,
                                                                  "cpu_generated_c": False}, graphs)
    with torch.no_grad():
        before = compiled(x)
        torch.testing.assert_close(before, model(x), rtol=1e-4, atol=1e-5)
        for p in model.parameters():
            p.mul_(1.5)  # in place, as an optimizer step or load_state_dict does
        after, eager = compiled(x), model(x)
    folded = [m for g in graphs for name, m in g.after.named_modules() if name == FOLDED_CONSTANTS_MODULE]
    assert folded and all(m.fixed is fixed for m in folded)
    assert sum(m.evaluations for m in folded) == (1 if fixed else 2) * len(folded)
    if not fixed:
        torch.testing.assert_close(after, eager, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(after, before)


def test_a_runner_whose_inputs_move_captures_once_with_its_inputs_copied_in():
    """A size of a symbolic graph (``inputs_move``): every call brings new tensors, so the first
    capture copies them in and serves them all; without it the first capture reads them in place
    and a second (buffered) one serves the next tensors."""
    w = torch.randn(5, 3)
    for moves, captures in ((True, 1), (False, 2)):
        r = _simulated_runner(lambda w, x: (x @ w.T,), [0], inputs_move=moves)
        for _ in range(3):
            x = torch.randn(2, 3)
            torch.testing.assert_close(r(w, x)[0], x @ w.T)
        assert r.captures == captures, moves
        first = r.graphs[next(iter(r.graphs))].instances[0]
        assert (first.input_ptrs is None) == moves and (1 in first.static_inputs) == moves


def test_a_deferred_baseline_is_made_only_where_a_signature_measures_it(monkeypatch):
    """The unoptimized graph of one size (``DeferredGraph``) is made at the baseline's first run: a
    signature whose decision is cached (its bucket decided) never makes it; one that measures makes it once."""
    from fxopt.autotune import AutotuneCache
    from fxopt.backends.cuda.runtime import cudagraph_measure
    from fxopt.backends.lowering import DeferredBaseline, DeferredGraph, read_params

    monkeypatch.setattr(cudagraph_measure, "_alternating_medians",
                        lambda fns, rounds=4, runs=3: {"graph_ms": 1.0, "plain_ms": 2.0, "baseline_graph_ms": 5.0})
    like = torch.fx.symbolic_trace(lambda w, x: (x @ w.T,))
    made = []

    def baseline():
        src = DeferredGraph(lambda: made.append("graph") or like, like=like, ident="unoptimized at s0=2")
        return DeferredBaseline(lambda gm: made.append("runnable") or gm, src)

    base = baseline()
    assert base.code == "unoptimized at s0=2" and read_params(base, {"w"}) == [0] and not made
    cache, w, x = AutotuneCache(None), torch.randn(5, 3), torch.randn(2, 3)
    for expect in (["graph", "runnable"], []):  # measured (made once), then the decision cached
        made.clear()
        r = _simulated_runner(lambda w, x: (x @ w.T,), [0], real_decide=True, baseline=baseline(),
                              decisions_cache=(cache, "dev", "h"))
        torch.testing.assert_close(r(w, x)[0], x @ w.T)
        torch.testing.assert_close(r(w, x)[0], x @ w.T)
        assert made == expect and r.decisions()[0]["runs"] == "optimized graph"
