"""pool_backward_layout: PyTorch's CUDA avg_pool2d_backward is wrong on channels_last tensors
where the pool pads (the pass's docstring); the pass gives it NCHW copies. Structural on fake CUDA
values (CPU), numeric on a GPU: eager's NCHW call against float64, and fxopt's training step."""
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt.config import Options
from fxopt.passes import pool_backward_layout
from fxopt.passinfra import PassContext

aten = torch.ops.aten
CL = torch.channels_last


def _graph(device="cuda", padding=1, fmt=CL, shape=(2, 8, 7, 6)):
    with FakeTensorMode():
        x = torch.empty(shape, device=device).contiguous(memory_format=fmt)
        out_hw = (shape[2] + 2 * padding - 2 + 1, shape[3] + 2 * padding - 2 + 1)
        grad = torch.empty(shape[0], shape[1], *out_hw, device=device).contiguous(memory_format=fmt)
        args = ([2, 2], [1, 1], [padding, padding], False, False, None)
        res = aten.avg_pool2d_backward(grad, x, *args)
    g = fx.Graph()
    pg, px = g.placeholder("grad"), g.placeholder("x")
    pg.meta["val"], px.meta["val"] = grad, x
    n = g.call_function(aten.avg_pool2d_backward.default, (pg, px, *args))
    n.meta["val"] = res
    user = g.call_function(aten.relu.default, (n,))
    user.meta["val"] = res
    g.output(user)
    return fx.GraphModule(torch.nn.Module(), g)


def _ctx():
    return PassContext(options=Options(), mode="training", device_type="cuda")


def _pool(gm):
    return next(n for n in gm.graph.nodes if n.target is aten.avg_pool2d_backward.default)


def test_padded_pool_gradient_on_cuda_reads_nchw_copies_and_keeps_the_traced_layout():
    gm = _graph()
    res = pool_backward_layout.run(gm, _ctx())
    assert res.modified
    pool = _pool(gm)
    for a in pool.args[:2]:
        assert a.target is aten.clone.default and a.kwargs["memory_format"] is torch.contiguous_format
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    back = relu.args[0]
    assert back.target is aten.clone.default and back.kwargs["memory_format"] is CL and back.args[0] is pool
    gm.graph.lint()


@pytest.mark.parametrize("case, why", [
    (dict(padding=0), "does not pad"), (dict(device="cpu"), "not a CUDA value")])
def test_kept_with_a_reason(case, why):
    gm = _graph(**case)
    ctx = _ctx()
    assert not pool_backward_layout.run(gm, ctx).modified
    assert any(why in line for line in sum(ctx.notes.values(), []))


def test_contiguous_values_are_copied_too_and_nothing_is_copied_back():
    """Traced NCHW is no proof: a tensor with a dimension of size 1 can be both (the docstring)."""
    gm = _graph(fmt=torch.contiguous_format)
    assert pool_backward_layout.run(gm, _ctx()).modified
    relu = next(n for n in gm.graph.nodes if n.target is aten.relu.default)
    assert relu.args[0].target is aten.avg_pool2d_backward.default


def test_idempotent():
    gm = _graph()
    pool_backward_layout.run(gm, _ctx())
    code = gm.code
    ctx = _ctx()
    assert not pool_backward_layout.run(gm, ctx).modified and gm.code == code
    assert any("already" in line for line in sum(ctx.notes.values(), []))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_training_through_a_padded_average_pool_matches_float64_on_the_gpu():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.AvgPool2d(2, 1, 1),
                                torch.nn.Conv2d(8, 4, 1)).cuda()
    x = torch.randn(2, 3, 7, 6, device="cuda")
    ref = __import__("copy").deepcopy(model).double()
    ref(x.double()).sum().backward()
    mine = __import__("copy").deepcopy(model)
    compiled = torch.compile(mine, backend="fxopt")
    with torch.autocast("cuda", dtype=torch.float16):
        out = compiled(x)
    out.float().sum().backward()
    got = dict(mine.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad.double(), p.grad, rtol=2e-2, atol=5e-2)
