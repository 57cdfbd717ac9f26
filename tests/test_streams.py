"""The stream plan of independent branches (``backends/cuda/runtime/streams.py``) on hand-built and
random graphs, and its interpreter with a stream API that records its calls (CPU)."""
from __future__ import annotations

import contextlib
import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxopt.backends.cuda.runtime.streams import StreamPlan, dependencies, host_nodes, plan_streams, run_plan
from fxopt.config import Options

aten = torch.ops.aten


def branches_then_constants(b, n: int, c: int, hw: int) -> tuple:
    """Input ``x`` [n, c, hw, hw]; ``main`` (3x3 conv + ReLU) and ``early`` (1x1 conv) beside it;
    then the folded constants (``fxopt_constants`` of two weights, refolded): (x, main, early, consts)."""
    x = b.input("x", n, c, hw, hw)
    w0, w3, w1, w2 = (b.input(f"w{i}", c, c, k, k) for i, k in ((0, 3), (3, 1), (1, 3), (2, 1)))
    main = b.op(aten.relu.default, b.conv(x, w0, padding=1), name="main")
    early = b.conv(x, w3, name="early")
    consts = b.g.call_module("fxopt_constants", (w1, w2))
    consts.meta["val"] = (w1.meta["val"] * 2.0, w2.meta["val"] * 0.5)
    return x, main, early, consts


class Builder:
    """An FX graph of ATen ops whose nodes carry ``meta["val"]`` (meta tensors: shapes only)."""

    def __init__(self):
        self.g = fx.Graph()

    def input(self, name, *shape):
        n = self.g.placeholder(name)
        n.meta["val"] = torch.empty(shape, device="meta")
        return n

    def op(self, target, *args, name=None):
        n = self.g.call_function(target, args)
        if name:
            n.name = name
        vals = fx.map_arg(args, lambda a: a.meta["val"])
        n.meta["val"] = target(*vals)
        return n

    def conv(self, x, w, stride=1, padding=0, name=None):
        return self.op(aten.conv2d.default, x, w, None, [stride, stride], [padding, padding], name=name)

    def done(self, *outs) -> fx.GraphModule:
        self.g.output(outs[0] if len(outs) == 1 else tuple(outs))
        return fx.GraphModule(torch.nn.Module(), self.g)


def real_args(gm):
    torch.manual_seed(0)
    return [torch.randn(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]


class RecordingStreams:
    """The stream API of ``run_plan`` on the CPU: records each call in order."""

    def __init__(self):
        self.log, self.recorded = [], set()

    def begin(self):
        self.log.append(("begin",))

    def use(self, i):
        self.log.append(("use", i))
        return contextlib.nullcontext()

    def record(self, i, name):
        self.log.append(("record", i, name))
        self.recorded.add(name)
        return name

    def wait(self, i, event):
        assert event in self.recorded, f"waits for {event} before it is recorded"
        self.log.append(("wait", i, event))

    def record_stream(self, tensor, i):
        assert isinstance(tensor, torch.Tensor)
        self.log.append(("record_stream", i, tuple(tensor.shape)))


def happens_before(gm, plan: StreamPlan) -> dict:
    """node name -> the set of names known complete when it starts (program order per stream, the
    plan's waits, the side streams' forks from stream 0 (before the first node off it, again after
    the folded constants), stream 0's joins at the output), computed independently of the planner."""
    known, state, forked = {}, {}, False
    side = set(plan.assign.values()) - {0}
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        s = 0 if n.op == "output" else plan.assign[n.name]
        if s and not forked:
            forked = True
            for t in side:
                state[t] = set(state.get(0, ()))
        k = set(state.get(s, ()))
        for w in plan.joins if n.op == "output" else plan.waits.get(n.name, []):
            assert w in plan.records, f"{n.name} waits for {w}, after which no event is recorded"
            assert plan.assign[w] != s
            k |= known[w] | {w}
        known[n.name] = k
        state[s] = k | {n.name}
        if forked and n.op == "call_module":
            for t in side:
                state[t] |= state[0]
    return known


def check_sound(gm, plan: StreamPlan):
    known = happens_before(gm, plan)
    compute = {n.name for n in dependencies(gm)}  # all but views of the inputs (no GPU work)
    for v, us in dependencies(gm).items():
        for u in us:
            assert u.name in known[v.name], f"{v.name} may start before {u.name} ({plan.assign})"
    out = known[next(n for n in gm.graph.nodes if n.op == "output").name]
    assert compute <= out, f"not joined before the output: {compute - out}"
    # the memory rule: every read of a tensor made on another stream is listed
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        t = plan.assign.get(n.name, 0)
        want = {(a.name, t) for a in n.all_input_nodes if a.name in compute and plan.assign[a.name] != t}
        assert set(plan.cross_reads.get(n.name, [])) == want


def check_run(gm, plan: StreamPlan, args):
    api = RecordingStreams()
    got = run_plan(gm, plan, api, [a.clone() for a in args])
    want = gm(*[a.clone() for a in args])
    for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        torch.testing.assert_close(g, w)
    uses = [e[1] for e in api.log if e[0] == "use"]
    if plan.branches:  # every node (and the output) entered on its stream, in order
        assert uses == [plan.assign.get(n.name, 0) for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr")]
    marked = [e[1] for e in api.log if e[0] == "record_stream"]
    assert len(marked) == sum(len(v) for v in plan.cross_reads.values())  # one tensor per producer here
    assert marked == [t for n in gm.graph.nodes for _, t in plan.cross_reads.get(n.name, [])]
    joins = [e[2] for e in api.log if e[0] == "wait" and e[1] == 0 and e[2] in plan.joins]
    assert set(plan.joins) <= set(joins)
    if plan.branches:  # side streams fork from stream 0 before the first node off it
        first_side = next(i for i, e in enumerate(api.log) if e[0] == "use" and e[1])
        assert api.log.index(("record", 0, "start")) < first_side
        assert {("wait", t, "start") for t in set(plan.assign.values()) - {0}} <= set(api.log)
    return api


def chain_graph():
    b = Builder()
    x = b.input("x", 8, 64, 56, 56)
    w1, w2 = b.input("w1", 64, 64, 3, 3), b.input("w2", 64, 64, 3, 3)
    y = b.op(aten.relu.default, b.conv(x, w1, padding=1))
    return b.done(b.op(aten.relu.default, b.conv(y, w2, padding=1)))


def test_chain_stays_on_stream_0():
    gm = chain_graph()
    plan = plan_streams(gm, 4)
    assert set(plan.assign.values()) == {0} and not plan.waits and not plan.records and not plan.joins
    assert not plan.cross_reads and "every kernel on stream 0" in plan.describe()[0]


def inception_graph(batch=32):
    b = Builder()
    x = b.input("x", batch, 192, 28, 28)
    ws = {k: b.input(k, *s) for k, s in dict(w1=(64, 192, 1, 1), w2a=(96, 192, 1, 1), w2b=(128, 96, 3, 3),
                                            w3a=(16, 192, 1, 1), w3b=(32, 16, 5, 5), w4=(32, 192, 1, 1)).items()}
    b1 = b.op(aten.relu.default, b.conv(x, ws["w1"]), name="b1")
    b2 = b.op(aten.relu.default, b.conv(b.op(aten.relu.default, b.conv(x, ws["w2a"])), ws["w2b"], padding=1), name="b2")
    b3 = b.op(aten.relu.default, b.conv(b.conv(x, ws["w3a"]), ws["w3b"], padding=2), name="b3")
    pool = b.op(aten.max_pool2d.default, x, [3, 3], [1, 1], [1, 1])
    b4 = b.op(aten.relu.default, b.conv(pool, ws["w4"]), name="b4")
    return b.done(b.op(aten.cat.default, [b1, b2, b3, b4], 1, name="cat"))


def test_inception_branches_on_distinct_streams():
    gm = inception_graph()
    plan = plan_streams(gm, 4)
    tails = ["b1", "b2", "b3", "b4"]
    assert sorted(plan.assign[t] for t in tails) == [0, 1, 2, 3]
    assert plan.assign["cat"] == 0
    assert sorted(plan.waits["cat"]) == sorted(t for t in tails if plan.assign[t] != 0)
    assert len(plan.branches) == 3 and not plan.joins  # the cat joined them
    check_sound(gm, plan)
    assert any("stream 1" in line and "joined by cat" in line for line in plan.describe())
    two = plan_streams(gm, 2)  # one side stream: the three other branches share it, in order
    assert sorted(two.assign[t] for t in tails) == [0, 1, 1, 1]
    check_sound(gm, two)
    small = inception_graph(batch=1)
    check_run(small, plan_streams(small, 4, min_us=0.0), real_args(small))


def residual_graph(batch=8):
    b = Builder()
    x = b.input("x", batch, 64, 56, 56)
    w1, w2, ws = b.input("w1", 128, 64, 3, 3), b.input("w2", 128, 128, 3, 3), b.input("ws", 128, 64, 1, 1)
    y = b.op(aten.relu.default, b.conv(x, w1, stride=2, padding=1))
    y = b.conv(y, w2, padding=1, name="main")
    sc = b.conv(x, ws, stride=2, name="shortcut")
    return b.done(b.op(aten.relu.default, b.op(aten.add.Tensor, y, sc, name="add")))


def test_residual_shortcut_on_a_side_stream():
    gm = residual_graph()
    plan = plan_streams(gm, 4)
    assert plan.assign["shortcut"] == 1 and plan.assign["main"] == 0 and plan.assign["add"] == 0
    assert plan.waits == {"add": ["shortcut"]} and plan.records == {"shortcut"}
    assert plan.cross_reads == {"add": [("shortcut", 0)]}
    check_sound(gm, plan)
    small = residual_graph(batch=1)
    api = check_run(small, plan_streams(small, 4, min_us=0.0), real_args(small))
    i_rec, i_wait = api.log.index(("record", 1, "shortcut")), api.log.index(("wait", 0, "shortcut"))
    assert i_rec < i_wait < api.log.index(("record_stream", 0, (1, 128, 28, 28)))


def test_nested_forks():
    b = Builder()
    x = b.input("x", 16, 64, 28, 28)
    w = [b.input(f"w{i}", 64, 64, 3, 3) for i in range(4)]
    a = b.conv(x, w[0], padding=1, name="a")
    a1, a2 = b.conv(a, w[1], padding=1, name="a1"), b.conv(a, w[2], padding=1, name="a2")
    inner = b.op(aten.add.Tensor, a1, a2, name="inner")
    br = b.conv(x, w[3], padding=1, name="b")
    gm = b.done(b.op(aten.cat.default, [inner, br], 1, name="cat"))
    plan = plan_streams(gm, 4)
    assert plan.assign["a"] == plan.assign["a1"] == plan.assign["inner"] == plan.assign["cat"] == 0
    assert {plan.assign["a2"], plan.assign["b"]} == {1, 2}
    assert plan.waits["inner"] == ["a2"] and plan.waits["cat"] == ["b"]
    check_sound(gm, plan)
    check_run(gm, plan, real_args(gm))


def test_small_branch_stays_on_stream_0():
    b = Builder()
    x, s = b.input("x", 8, 64, 56, 56), b.input("s", 1, 16)
    w = b.input("w", 64, 64, 3, 3)
    big = b.op(aten.relu.default, b.conv(x, w, padding=1))
    tiny = b.op(aten.mul.Tensor, b.op(aten.sigmoid.default, s), s)
    gm = b.done(big, tiny)
    plan = plan_streams(gm, 4)
    assert set(plan.assign.values()) == {0} and not plan.waits and not plan.branches
    check_run(gm, plan, real_args(gm))
    big_plan = plan_streams(residual_graph(), 4, min_us=1e6)  # a branch under the threshold
    assert set(big_plan.assign.values()) == {0} and not big_plan.waits


def test_in_place_write_orders_readers():
    b = Builder()
    x = b.input("x", 2, 8, 8, 8)
    a = b.op(aten.add.Tensor, x, x, name="a")
    before = b.op(aten.mul.Tensor, a, 2.0, name="before")
    write = b.op(aten.relu_.default, a, name="write")
    after = b.op(aten.mul.Tensor, a, 3.0, name="after")
    view = b.op(aten.view.default, a, [2, 512], name="view")
    gm = b.done(b.op(aten.add.Tensor, before, after, name="out"), view, write)
    deps = {v.name: {u.name for u in us} for v, us in dependencies(gm).items()}
    assert "before" in deps["write"]  # every earlier reader before the write
    assert "write" in deps["after"] and "write" in deps["view"]  # every later reader after it
    for n in (2, 3, 4):
        plan = plan_streams(gm, n, min_us=0.0)
        assert len(set(plan.assign.values())) > 1
        check_sound(gm, plan)
        check_run(gm, plan, real_args(gm))


def test_option_validation():
    assert Options.from_any({}).streams == 0
    assert Options.from_any({"streams": 3}).streams == 3
    for bad in (-1, 9, True, 2.0, "2"):
        with pytest.raises(ValueError, match="streams"):
            Options.from_any({"streams": bad})


@st.composite
def random_dags(draw):
    """Graphs of adds, muls, convs, cats (then a 1x1 conv back), ReLUs and in-place ReLUs, with
    random fan-out (any earlier value is an operand) and fan-in (adds, muls, cats of several)."""
    b = Builder()
    vals = [b.input(f"x{i}", 1, 4, 6, 6) for i in range(draw(st.integers(1, 2)))]
    w3, w8 = b.input("w3", 4, 4, 3, 3), b.input("w8", 4, 8, 1, 1)
    computed = []  # what in-place ReLUs may write: results and views of results, never inputs
    for _ in range(draw(st.integers(2, 14))):
        kind = draw(st.sampled_from(["add", "mul", "conv", "cat", "relu", "relu_", "view"]))
        pick = lambda: vals[draw(st.integers(0, len(vals) - 1))]  # noqa: E731
        if kind == "view":  # of an input: no GPU work, ordering nothing (streams.host_nodes)
            src = pick()
            vals.append(b.op(aten.view.default, src, [1, 4, 6, 6]))
            if src.op != "placeholder" and src.target is not aten.view.default:
                computed.append(vals[-1])
            continue
        if kind == "relu_" and computed:
            n = b.op(aten.relu_.default, computed[draw(st.integers(0, len(computed) - 1))])
        elif kind in ("add", "mul"):
            n = b.op(aten.add.Tensor if kind == "add" else aten.mul.Tensor, pick(), pick())
        elif kind == "conv":
            n = b.conv(pick(), w3, padding=1)
        elif kind == "cat":
            n = b.conv(b.op(aten.cat.default, [pick(), pick()], 1), w8)
        else:
            n = b.op(aten.relu.default, pick())
        vals.append(n)
        computed.append(n)
    sinks = [n for n in vals if n.op == "call_function" and not n.users]
    return b.done(*(sinks or vals[-1:]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gm=random_dags(), n=st.integers(1, 4), min_us=st.sampled_from([0.0, 0.0, 1e-4, 2.0]))
def test_random_dags_sound_and_equal(gm, n, min_us):
    plan = plan_streams(gm, n, min_us=min_us)
    assert set(plan.assign.values()) <= set(range(max(n, 1)))
    if not plan.branches:
        assert set(plan.assign.values()) <= {0} and not plan.waits and not plan.cross_reads
    check_sound(gm, plan)
    check_run(gm, plan, real_args(gm))


def test_explain_lists_the_plan():
    """Option streams: the cuda executor plans the lowered graph and the report lists the plan."""
    import fxopt

    class ThreeBranches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.Conv2d(64, 64, 1)
            self.c = torch.nn.Conv2d(64, 32, 3, padding=1)

        def forward(self, x):
            return torch.cat([torch.relu(self.a(x)), torch.relu(self.b(x)), self.c(x)], 1)

    x = torch.randn(16, 64, 28, 28)
    report = fxopt.explain(ThreeBranches().eval(), x, options={"executor": "cuda", "streams": 4})
    lines = report.graphs[0].executor_details.get("streams")
    assert lines and lines[0].startswith("streams: 3 used, 2 branches") and len(lines) == 3
    assert "graph 0:   stream 1: " in report.fusion_table()
    off = fxopt.explain(ThreeBranches().eval(), x, options={"executor": "cuda"})
    assert "streams" not in off.graphs[0].executor_details


class Refolded(torch.nn.Module):
    """Stands for the folded constants (``fxopt_constants``): weights computed from the inputs."""

    def forward(self, w1, w2):
        return (w1 * 2.0, w2 * 0.5)


def test_folded_constants_are_inputs():
    """The folded constants and the getitems unpacking them start no branch and order nothing; a
    refresh runs on stream 0 before the side streams fork (or is followed by a fork again)."""
    root = torch.nn.Module()
    root.fxopt_constants = Refolded()
    b = Builder()
    x = b.input("x", 8, 64, 56, 56)
    w1, w2 = b.input("w1", 64, 64, 3, 3), b.input("w2", 64, 64, 1, 1)
    consts = b.g.call_module("fxopt_constants", (w1, w2))
    consts.meta["val"] = (w1.meta["val"] * 2.0, w2.meta["val"] * 0.5)
    k1, k2 = b.op(operator.getitem, consts, 0), b.op(operator.getitem, consts, 1)
    big = b.op(aten.relu.default, b.conv(x, k1, padding=1), name="big")
    side = b.conv(x, k2, name="side")
    b.g.output(b.op(aten.add.Tensor, big, side, name="add"))
    gm = fx.GraphModule(root, b.g)
    assert {n.name for n in host_nodes(gm)} == {consts.name, k1.name, k2.name}
    plan = plan_streams(gm, 4)
    assert plan.assign["side"] == 1 and plan.assign["big"] == 0 and plan.waits == {"add": ["side"]}
    assert [branch for _, branch in plan.branches] == [["side"]]
    check_sound(gm, plan)
    api = check_run(gm, plan, real_args(gm))
    assert api.log.index(("use", 0)) < api.log.index(("record", 0, "start"))  # after the constants

    b = Builder()  # the constants after the side streams forked: they fork again after them
    x, main, early, consts = branches_then_constants(b, 8, 64, 56)
    late = b.conv(x, b.op(operator.getitem, consts, 1), name="late")
    b.g.output(b.op(aten.cat.default, [main, early, late], 1))
    gm = fx.GraphModule(root, b.g)
    plan = plan_streams(gm, 4)
    assert plan.assign["early"] and plan.assign["late"]
    check_sound(gm, plan)
    api = check_run(gm, plan, real_args(gm))
    refold = api.log.index(("record", 0, consts.name))
    assert api.log.index(("record", 0, "start")) < api.log.index(("use", plan.assign["early"])) < refold
    assert all(("wait", t, consts.name) in api.log[refold:] for t in (1, 2, 3) if t in plan.assign.values())
    assert refold < max(i for i, e in enumerate(api.log) if e == ("use", plan.assign["late"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streams_values_and_capture():
    """On a GPU: the real streams give gm's values, run as they are and captured in a CUDA graph
    (the side streams fork from the capturing stream and join it)."""
    from fxopt.backends.cuda.runtime.streams import CudaStreams

    gm = inception_graph(batch=2)
    args = [a.cuda() for a in real_args(gm)]
    plan = plan_streams(gm, 4, min_us=0.0)
    want = gm(*args)
    streams = CudaStreams(4)
    torch.testing.assert_close(run_plan(gm, plan, streams, args), want)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_plan(gm, plan, streams, args)  # warm-up off the capturing stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_plan(gm, plan, streams, args)
    graph.replay()
    torch.testing.assert_close(out, want)
