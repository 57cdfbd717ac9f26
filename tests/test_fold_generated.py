"""fold_constants on generated constants (passes/fold_constants.py): the values a graph computes
from ``arange`` and literals alone (bilinear upsampling's interpolation weights) are folded once,
the integer indices of its gathers stay index arithmetic in the graph (the cuda executor reads
them as index maps), and symbolic, large or training graphs' generated values are left alone."""
import operator

import pytest
import torch
import torch.nn.functional as F
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.config import Options
from fxopt.passes import fold_constants
from fxopt.passinfra import PassContext

aten = torch.ops.aten
DECOMP = get_decompositions([aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default])


def _bilinear(x):
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False) * 2.0


def _graph(fn, x, mode="fake"):
    return make_fx(fn, decomposition_table=DECOMP, tracing_mode=mode)(x)


def _ctx(mode="inference"):
    ctx = PassContext(options=Options(), mode=mode)
    ctx.current_pass = "fold_constants"  # where the pipeline files the pass's notes
    return ctx


def _ancestors(node):
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def test_interpolation_weights_are_folded_and_indices_stay():
    x = torch.randn(2, 3, 5, 7)
    gm, ref = _graph(_bilinear, x), _graph(_bilinear, x)
    n_gathers = sum(n.target is aten._unsafe_index.Tensor for n in gm.graph.nodes)
    ctx = _ctx()
    res = fold_constants.run(gm, ctx)
    assert res.modified
    gm.graph.lint()
    nodes = list(gm.graph.nodes)
    folded = [n for n in nodes if n.op == "call_function" and n.target is operator.getitem]
    assert folded and all(n.meta["val"].is_floating_point() for n in folded)  # the weights only
    gathers = [n for n in nodes if n.target is aten._unsafe_index.Tensor]
    assert len(gathers) == n_gathers == 4
    for g in gathers:  # each index is still computed from arange, not read from the folded module
        for idx in g.args[1]:
            if idx is None:
                continue
            up = _ancestors(idx)
            assert any(a.target is aten.arange.default or a.target is aten.arange.start_step for a in up
                       if a.op == "call_function")
            assert not any(a.op == "call_module" for a in up)
    assert "generated constants" in " ".join(ctx.notes["fold_constants"])
    torch.testing.assert_close(gm(x), ref(x), rtol=0, atol=0)  # the same arithmetic, done once


def test_folding_twice_changes_nothing():
    x = torch.randn(1, 2, 3, 3)
    gm = _graph(_bilinear, x)
    assert fold_constants.run(gm, _ctx()).modified
    code = gm.code
    again = _ctx()
    assert not fold_constants.run(gm, again).modified
    assert gm.code == code and "already folded" in again.notes["fold_constants"][0]


def test_symbolic_sizes_are_not_folded():
    x = torch.randn(2, 3, 5, 7)
    gm = _graph(_bilinear, x, mode="symbolic")
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    res = fold_constants.run(gm, _ctx())
    assert not res.modified, gm.code
    assert any(n.target is aten.arange.default or n.target is aten.arange.start_step for n in gm.graph.nodes)


def test_training_graphs_without_frozen_weights_are_skipped():
    gm = _graph(_bilinear, torch.randn(1, 2, 3, 3))
    ctx = _ctx("training")
    assert not fold_constants.run(gm, ctx).modified
    assert "training graph" in ctx.notes["fold_constants"][0]


def test_large_generated_values_are_computed_per_call(monkeypatch):
    monkeypatch.setattr(fold_constants, "MAX_GENERATED_ELEMENTS", 8)  # every weight vector is larger
    gm = _graph(_bilinear, torch.randn(1, 2, 5, 7))
    assert not fold_constants.run(gm, _ctx()).modified


@pytest.mark.parametrize("align", [False, True])
def test_generated_constants_alone_fold_in_a_graph_without_weights(align):
    """No frozen parameter at all: the folded module takes no input and still evaluates once."""
    x = torch.randn(2, 3, 4, 6)

    def f(t):
        return torch.relu(F.interpolate(t, size=(7, 13), mode="bilinear", align_corners=align))

    gm, ref = _graph(f, x), _graph(f, x)
    assert fold_constants.run(gm, _ctx()).modified
    call, = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert call.args == ()
    module = getattr(gm, call.target)
    out1, out2 = gm(x), gm(x)
    assert module.evaluations == 1
    torch.testing.assert_close(out1, ref(x), rtol=0, atol=0)
    torch.testing.assert_close(out2, ref(x), rtol=0, atol=0)
    torch.testing.assert_close(out1, f(x))  # and eager's kernel within float32 rounding


def test_every_creation_op_is_an_overload_a_node_can_name():
    """Graph nodes carry op overloads (``prims.iota.default``), never packets: a packet among the
    creation ops would never match one."""
    assert all(isinstance(op, torch._ops.OpOverload) for op in fold_constants.CREATION_OPS)
    assert torch.ops.prims.iota.default in fold_constants.CREATION_OPS
