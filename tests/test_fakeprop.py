"""Cached FakeTensor propagation (fxopt/fakeprop.py): recomputes only what a rewrite could change,
and always leaves the same metadata a fresh propagation would."""
import operator

import torch
import torch.fx as fx
from hypothesis import given, settings
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxopt.fakeprop import CachedFakeTensorProp, fake_inputs_key, meta_key
from fxopt.testing import cnn_cases

aten = torch.ops.aten


def _traced():
    def f(x, w):
        y = torch.relu(torch.conv2d(x, w, padding=1))
        return torch.flatten(y.mean(dim=(2, 3), keepdim=True), 1) * 2

    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(f)(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))


def _meta(gm):
    out = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out[n.name] = (tuple(v.shape), v.stride(), v.dtype)
    return out


def test_unchanged_graph_is_all_hits_and_a_rewrite_recomputes_only_its_node():
    gm = _traced()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(torch.randn(2, 3, 8, 8)), mode.from_tensor(torch.randn(4, 3, 3, 3))]
    cache = {}
    with mode:
        first = CachedFakeTensorProp(gm, mode, cache)
        first.propagate_dont_convert_inputs(*fakes)
        again = CachedFakeTensorProp(gm, mode, cache)
        again.propagate_dont_convert_inputs(*fakes)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert first.hits == 0 and again.hits == len(calls)
    relu = next(n for n in calls if n.target is aten.relu.default)
    relu.target = aten.sigmoid.default  # same metadata out: everything after it stays cached
    with mode:
        third = CachedFakeTensorProp(gm, mode, cache)
        third.propagate_dont_convert_inputs(*fakes)
    assert third.hits == len(calls) - 1
    gm.graph.lint()


def test_metadata_change_propagates_downstream():
    gm = _traced()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    x = mode.from_tensor(torch.randn(2, 3, 8, 8))
    w = mode.from_tensor(torch.randn(4, 3, 3, 3))
    cache = {}
    with mode:
        CachedFakeTensorProp(gm, mode, cache).propagate_dont_convert_inputs(x, w)
        conv = next(n for n in gm.graph.nodes if n.target is aten.convolution.default)
        args = list(conv.args)
        args[4] = [0, 0]  # padding 1 -> 0: every later shape changes
        conv.args = tuple(args)
        CachedFakeTensorProp(gm, mode, cache).propagate_dont_convert_inputs(x, w)
    conv_val = conv.meta["val"]
    assert tuple(conv_val.shape) == (2, 4, 6, 6)
    assert tuple(next(iter(conv.users)).meta["val"].shape) == (2, 4, 6, 6)


def test_symbolic_sizes_are_not_compared():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC])
    t = mode.from_tensor(torch.randn(3, 4), source=ConstantSource("x"), symbolic_context=ctx)
    assert not isinstance(t.shape[0], int)
    assert fake_inputs_key([t]) is None
    assert meta_key((1, 2.0, None, torch.float16)) == (1, 2.0, None, torch.float16)


def test_a_symbolic_graph_is_cached_by_its_size_expressions_without_guards():
    """Symbolic sizes are keyed by their expressions: an unchanged symbolic graph is all hits, a
    rewrite recomputes only what it touched, and no propagation after the first adds a guard."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(lambda x, w: torch.relu(torch.conv2d(x, w, padding=1)).mean(dim=(2, 3), keepdim=True) * 2)(
        torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3))  # (no size literal: a view would specialize)
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    sym = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC] + [DimDynamic.DYNAMIC] * 2)
    fakes = [mode.from_tensor(torch.randn(2, 3, 8, 8), source=ConstantSource("x"), symbolic_context=sym),
             mode.from_tensor(torch.randn(4, 3, 3, 3), static_shapes=True)]
    cache = {}
    with mode:
        CachedFakeTensorProp(gm, mode, cache).propagate_dont_convert_inputs(*fakes)
        guards = len(env.guards)
        again = CachedFakeTensorProp(gm, mode, cache)
        again.propagate_dont_convert_inputs(*fakes)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert again.hits == len(calls) and len(env.guards) == guards
    out = calls[-1].meta["val"]
    assert not isinstance(out.shape[0], int)
    relu = next(n for n in calls if n.target is aten.relu.default)
    relu.target = aten.sigmoid.default
    with mode:
        third = CachedFakeTensorProp(gm, mode, cache)
        third.propagate_dont_convert_inputs(*fakes)
    assert third.hits == len(calls) - 1 and len(env.guards) == guards


@settings(max_examples=10)
@given(cnn_cases(ndims=(2,)))
def test_pipeline_metadata_equals_a_fresh_propagation(case):
    import fxopt

    r = fxopt.explain(case.model, *case.inputs)
    for g in r.graphs:
        gm = g.after
        cached = _meta(gm)
        fakes = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        mode = next(v.fake_mode for v in fakes if hasattr(v, "fake_mode"))
        with mode:
            FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
        assert _meta(gm) == cached


def test_the_first_pass_recomputes_only_what_it_rewrote():
    """The cache is seeded from the graph as AOTAutograd handed it over, before any pass, and an
    inference graph is propagated with grad off as it was traced: after BatchNorm folding the
    ReLUs (same input metadata, new producer) are not recomputed."""
    import fxopt.fakeprop as fp

    runs = []
    real_run_node = CachedFakeTensorProp.run_node

    def spy(self, n):
        if not runs or runs[-1][0] is not self:
            runs.append((self, []))
        before = self.hits
        out = real_run_node(self, n)
        if n.op == "call_function" and self.hits == before:
            runs[-1][1].append(n.target)
        return out

    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    import fxopt
    fp.CachedFakeTensorProp.run_node = spy
    try:
        fxopt.explain(m, torch.randn(1, 3, 12, 12))
    finally:
        fp.CachedFakeTensorProp.run_node = real_run_node
    first = runs[0][1]  # the propagation after fold_batchnorm
    assert aten.convolution.default in first  # the rewritten convs (folded weights)
    assert aten.relu.default not in first


def test_folded_constants_reuse_the_recorded_fake_results():
    """fold_constants hands the module the fake results its folded nodes carried: propagating
    metadata afterwards does not trace the weight-only graph again (inputs of other metadata do)."""
    from fxopt.passes.fold_constants import FoldedConstants

    class Boom(torch.nn.Module):
        calls = 0

        def forward(self, *a):
            Boom.calls += 1
            return (a[0] * 2,)

    mode = FakeTensorMode()
    w = mode.from_tensor(torch.randn(4, 3))
    out = mode.from_tensor(torch.randn(4, 3))
    folded = FoldedConstants(Boom(), ["w"])
    folded.remember_fake([w], [out])
    with mode:
        assert folded(mode.from_tensor(torch.randn(4, 3)))[0] is out and Boom.calls == 0
        other = folded(mode.from_tensor(torch.randn(5, 3)))
    assert Boom.calls == 1 and tuple(other[0].shape) == (5, 3)


def test_folded_constants_under_another_fake_mode_are_made_in_that_mode_without_tracing():
    """Each size of a symbolic graph propagates in a fake mode of its own: the weight-only graph is
    traced once; the same metadata under another mode gives that mode's fake tensors of the same
    shape, strides and dtype. Outputs sharing a storage are traced again."""
    from fxopt.passes.fold_constants import FoldedConstants

    class Count(torch.nn.Module):
        calls = 0

        def forward(self, w, b):
            Count.calls += 1
            return (w.t().contiguous() * 2, b.to(torch.float16))

    folded = FoldedConstants(Count(), ["w", "b"])
    first = FakeTensorMode()
    with first:
        a = folded(first.from_tensor(torch.randn(4, 3)), first.from_tensor(torch.randn(4)))
    assert Count.calls == 1
    second = FakeTensorMode()
    with second:
        b = folded(second.from_tensor(torch.randn(4, 3)), second.from_tensor(torch.randn(4)))
        assert Count.calls == 1 and all(t.fake_mode is second for t in b)
        assert [(t.shape, t.stride(), t.dtype) for t in a] == [(t.shape, t.stride(), t.dtype) for t in b]
        (b[0] + 1).sum()  # usable in its mode
        other = folded(second.from_tensor(torch.randn(5, 3)), second.from_tensor(torch.randn(4)))
    assert Count.calls == 2 and tuple(other[0].shape) == (3, 5)

    class Views(torch.nn.Module):
        calls = 0

        def forward(self, w):
            Views.calls += 1
            y = w * 2
            return (y, y.view(-1))

    folded = FoldedConstants(Views(), ["w"])
    for _ in range(2):
        mode = FakeTensorMode()
        with mode:
            folded(mode.from_tensor(torch.randn(4, 3)))
    assert Views.calls == 2


def test_placeholders_keep_their_value_for_the_same_input_object():
    gm = _traced()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [mode.from_tensor(torch.randn(2, 3, 8, 8)), mode.from_tensor(torch.randn(4, 3, 3, 3))]
    cache = {}
    x_node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with mode:
        CachedFakeTensorProp(gm, mode, cache).propagate_dont_convert_inputs(*fakes)
        recorded = x_node.meta["val"]
        CachedFakeTensorProp(gm, mode, cache).propagate_dont_convert_inputs(*fakes)
        assert x_node.meta["val"] is recorded  # not snapshotted again
        other = mode.from_tensor(torch.randn(2, 3, 10, 10))
        CachedFakeTensorProp(gm, mode, cache).propagate_dont_convert_inputs(other, fakes[1])
    assert x_node.meta["val"] is not recorded and tuple(x_node.meta["val"].shape) == (2, 3, 10, 10)
    conv = next(n for n in gm.graph.nodes if n.target is aten.convolution.default)
    assert tuple(conv.meta["val"].shape) == (2, 4, 10, 10)  # downstream recomputed for the new input


def _bn_training_graph():
    """A training BatchNorm as ``training_batchnorm`` leaves it: forward with update, backward reading
    the reserve."""
    g = fx.Graph()
    x, w, b, rm, rv, grad = (g.placeholder(n) for n in ("x", "w", "b", "rm", "rv", "grad"))
    bn = g.call_function(aten._batch_norm_with_update_functional.default, (x, w, b, rm, rv, 0.1, 1e-5))
    out, mean, rstd, reserve = (g.call_function(operator.getitem, (bn, i)) for i in range(4))
    dx = g.call_function(aten.batch_norm_backward.default,
                         (grad, x, w, None, None, mean, rstd, True, 1e-5, [True, True, True], reserve))
    g.output((out, dx))
    return fx.GraphModule(torch.nn.Module(), g)


def _symbolic_cuda_inputs(batch: int, channels: int):
    """Fake CUDA inputs in a shape environment of their own, the batch symbolic (needs no GPU)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    sym = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * 3)

    def fake(shape, name, symbolic=False):
        t = torch.empty(shape, device="meta", dtype=torch.float16 if len(shape) == 4 else torch.float32)
        with mode:
            if not symbolic:
                return mode.from_tensor(t, static_shapes=True).to("cuda")
            return mode.from_tensor(t, symbolic_context=sym, source=ConstantSource(name)).to("cuda")

    xs = (batch, channels, 5, 5)
    inputs = [fake(xs, "x", True), *(fake((channels,), n) for n in ("w", "b", "rm", "rv")), None]
    with mode:
        inputs[-1] = torch.empty_like(inputs[0])
    return env, mode, inputs


def _eq_guards(env) -> list:
    return [str(g.expr) for g in env.guards if str(g.expr).startswith("Eq(")]


def test_the_batchnorm_reserve_query_does_not_specialize_a_symbolic_batch(monkeypatch):
    """cuDNN's reserve-space query reads concrete sizes (here as cuDNN 9.19 answers it: 0 bytes,
    whatever the batch); propagation through fxopt keeps the batch symbolic, a plain FakeTensorProp
    specializes it."""
    from fxopt.fakeprop import propagate

    def query(x, training):
        return int(x.shape[0]) * 0  # reads the size as an int, as the C++ query does
    monkeypatch.setattr(torch._C, "_get_cudnn_batch_norm_reserve_space_size", query)
    gm = _bn_training_graph()
    env, mode, inputs = _symbolic_cuda_inputs(6, 4)
    with mode:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    assert _eq_guards(env), "the query no longer guards: this test shows nothing"
    env, mode, inputs = _symbolic_cuda_inputs(7, 6)
    propagate(gm, inputs)
    assert _eq_guards(env) == []
    out, reserve = (n.meta["val"] for n in gm.graph.nodes if n.name in ("getitem", "getitem_3"))
    assert not isinstance(out.shape[0], int) and reserve.shape == (0,)
    dx = next(n for n in gm.graph.nodes if n.target is aten.batch_norm_backward.default).meta["val"][0]
    assert dx.shape == out.shape


def test_a_reserve_that_takes_memory_specializes_every_size_as_before(monkeypatch):
    """A cuDNN whose reserve space is not empty: its size may hold for the traced sizes only, so they
    are all specialized (the graph is then static, never wrong)."""
    from fxopt.fakeprop import propagate

    monkeypatch.setattr(torch._C, "_get_cudnn_batch_norm_reserve_space_size", lambda x, training: 64)
    gm = _bn_training_graph()
    env, mode, inputs = _symbolic_cuda_inputs(5, 10)
    assert inputs[0].shape[0].node.expr.free_symbols
    propagate(gm, inputs)
    assert inputs[0].shape[0].node.expr == 5  # the batch is a constant of the shape environment now
    reserve = next(n for n in gm.graph.nodes if n.name == "getitem_3").meta["val"]
    assert reserve.shape == (64,)


def test_a_graph_made_static_records_its_size_inputs_as_ints_and_folds_them():
    """A symbolic graph's size input (Dynamo passes the batch as an int) specialized at a size: its
    value is that int, not the symbolic one it had (which a torch version's FakeTensorProp leaves), so
    the size folds into the ops and nothing reads the symbol (reading it would add a guard)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from fxopt.package_batch import specialise_at

    g = fx.Graph()
    s, x = g.placeholder("s"), g.placeholder("x")
    v = g.call_function(aten.view.default, (x, [s, -1]))
    g.output((g.call_function(aten.relu.default, (v,)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    env = ShapeEnv()
    s.meta["val"] = env.create_unspecified_symint_and_symbol(4, ConstantSource("s"), DimDynamic.DYNAMIC)
    assert not isinstance(s.meta["val"], int)
    static, counts = specialise_at(gm, [3, torch.randn(3, 2, 2)])
    s2, _ = (n for n in static.graph.nodes if n.op == "placeholder")
    assert s2.meta["val"] == 3 and type(s2.meta["val"]) is int
    view = next(n for n in static.graph.nodes if n.target is aten.view.default)
    assert view.args[1] == [3, -1] and counts["sizes_folded"] == 1
    assert not env.guards and not env.replacements
