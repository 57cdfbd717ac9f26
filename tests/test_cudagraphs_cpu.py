"""The CPU-testable parts of the CUDA-graph runner: when it is refused, and the per-call weight
watch that decides whether folded constants are refreshed and whether a new graph is needed."""
import torch

import fxopt
from fxopt.backends.cuda.runtime.cudagraphs import unsafe_reason
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


def test_cudagraphs_refused_on_cpu_and_in_training_with_reasons():
    r = fxopt.explain(SmallResNet().eval(), torch.randn(1, 3, 32, 32))
    gm = r.graphs[0].after
    assert unsafe_reason(gm, "inference", "cpu") == "inputs are not on CUDA"
    assert unsafe_reason(gm, "forward", "cuda") == "training graph"
    # claimed to be CUDA while a value lives on the CPU: refused, naming the node
    assert unsafe_reason(gm, "inference", "cuda") == "arg0_1 produces a CPU tensor"


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


# ---------------------------------------------------------------------------- the runner's call path
class _SimulatedGraph:
    """Stands in for a captured CUDA graph on the CPU: a replay recomputes the outputs in place
    from the tensors the capture read (the caller's inputs for a direct capture)."""

    def __init__(self, fn, args, outputs):
        self.fn, self.args, self.outputs, self.replays = fn, list(args), outputs, 0

    def replay(self):
        self.replays += 1
        for out, new in zip(self.outputs, self.fn(*self.args)):
            out.copy_(new)


def _simulated_runner(fn, static, real_decide=False, **kw):
    """A runner whose captures are simulated; its replay-vs-plain decision is stubbed (the graph
    wins) unless ``real_decide`` (then the test stubs the timing)."""
    from fxopt.backends.cuda.runtime.cudagraphs import CudaGraphRunner, _Instance

    class Simulated(CudaGraphRunner):
        def _capture(self, args, fn, lend=True, direct=False):
            call_args, static_inputs = list(args), {}
            for i in self.dynamic:
                if not direct:
                    static_inputs[i] = call_args[i] = args[i].clone()
            outputs = tuple(o.clone() for o in fn(*call_args))
            ptrs = {i: args[i].data_ptr() for i in self.dynamic} if direct else None
            inst = _Instance(_SimulatedGraph(fn, call_args, outputs), static_inputs, ptrs, outputs, args, lend)
            self._lent_ptrs.update(inst.out_ptrs)
            self.captures += 1
            return inst

    def graph_wins(self, entry, args):
        entry.timings = {"graph_ms": 0.0, "plain_ms": 1.0}

    if not real_decide:
        Simulated._decide = graph_wins
    runner = Simulated(fn, static, **kw)
    runner.captures = 0
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
    assert runner._fast is None and runner.captures == 2
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
    from fxopt.backends.cuda.runtime import cudagraphs

    measured = []

    def fake_medians(fns, rounds=4, runs=3):
        measured.append(sorted(fns))
        return {"graph_ms": 1.0, "plain_ms": 2.0, "baseline_graph_ms": times["baseline"]}

    monkeypatch.setattr(cudagraphs, "_alternating_medians", fake_medians)
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
