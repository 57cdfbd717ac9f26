"""Cached FakeTensor propagation (fxopt/fakeprop.py): recomputes only what a rewrite could change,
and always leaves the same metadata a fresh propagation would."""
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
