"""The joint-graph passes of training (``fxopt.pipeline.JOINT_PIPELINE``): structural checks on
small joint graphs traced with fake CUDA tensors (no GPU needed), and numeric checks on the CPU."""
import copy
import operator

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.config import Options
from fxopt.pipeline import ALL_PASS_NAMES, run_joint_pipeline
from fxopt.testing.training import TrainLoop, make_batches, run_steps

aten = torch.ops.aten
F16 = torch.float16


def _joint(flatten_spatial: bool):
    """A joint-like graph: autocast casts into two convolutions, a weight gradient cast back."""
    def f(w1, w2, x, g):
        c1 = aten.convolution(aten._to_copy(x, dtype=F16), aten._to_copy(w1, dtype=F16), None,
                              [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        w2h = aten._to_copy(w2, dtype=F16)
        r = aten.relu(c1)
        c2 = aten.convolution(r, w2h, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        out = aten.view(c2, [2, -1]) if flatten_spatial else aten.mean(c2, [2, 3])
        gw = aten.convolution_backward(g, r, w2h, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                       [False, True, False])[1]
        return out, aten._to_copy(gw, dtype=torch.float32)

    mode = FakeTensorMode()
    with mode:
        args = [torch.empty(4, 3, 3, 3, device="cuda"), torch.empty(4, 4, 3, 3, device="cuda"),
                torch.empty(2, 3, 8, 8, device="cuda"), torch.empty(2, 4, 8, 8, device="cuda", dtype=F16)]
        gm = make_fx(f)(*args)
    return gm, args


def _casts(gm):
    return [n for n in gm.graph.nodes if n.target is aten._to_copy.default]


def test_training_layout_casts_conv_operands_channels_last_and_the_weight_gradient_back():
    gm, args = _joint(flatten_spatial=False)
    out, records = run_joint_pipeline(gm, args, Options())
    rec = {r.name: r for r in records}["training_layout"]
    assert rec.changed, rec.notes
    formats = [n.kwargs.get("memory_format") for n in _casts(out)]
    assert formats.count(torch.channels_last) == 3 and formats.count(torch.contiguous_format) == 1
    conv2 = [n for n in out.graph.nodes if n.target is aten.convolution.default][1]
    assert conv2.meta["val"].is_contiguous(memory_format=torch.channels_last)  # propagated
    grad = next(n for n in _casts(out) if n.kwargs.get("dtype") == torch.float32)
    assert grad.meta["val"].is_contiguous()
    again, records = run_joint_pipeline(out, args, Options())  # idempotent: nothing left to match
    assert not {r.name: r for r in records}["training_layout"].changed


def test_training_layout_declines_a_graph_whose_views_need_nchw_and_is_an_option():
    gm, args = _joint(flatten_spatial=True)
    out, records = run_joint_pipeline(gm, args, Options())
    rec = {r.name: r for r in records}["training_layout"]
    assert not rec.changed and any("does not propagate" in n for n in rec.notes), rec.notes
    assert all("memory_format" not in n.kwargs for n in _casts(out))  # the graph as traced
    gm, args = _joint(flatten_spatial=False)
    _, records = run_joint_pipeline(gm, args, Options(layout="contiguous"))
    assert not {r.name: r for r in records}["training_layout"].changed
    _, records = run_joint_pipeline(gm, args, Options.from_any({"disable": ["training_layout"]}, ALL_PASS_NAMES))
    assert {r.name: r for r in records}["training_layout"].status == "disabled"


def test_training_batchnorm_runs_eager_kernels_with_the_reserve_and_keeps_eager_numbers():
    from fxopt.backend import fxopt_backend

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, affine=False), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    ref = copy.deepcopy(model)
    reports: list = []
    compiled = torch.compile(model, backend=lambda gm, ex: fxopt_backend(gm, ex, _sink=reports))
    batches = make_batches(2, 4, (3, 8, 8), 5)
    losses = [run_steps(TrainLoop(m, m_.parameters(), "cpu", amp=None), batches, 4)
              for m, m_ in ((compiled, model), (ref, ref))]
    assert [float(a) for a in losses[0]] == [float(b) for b in losses[1]]  # the same kernels as eager
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(model[1].running_var, ref[1].running_var, rtol=0, atol=0)
    fw, bw = (r for r in reports if r.kind in ("forward", "backward"))
    joint = {p["name"]: p for p in fw.training["joint_passes"]}["training_batchnorm"]
    assert joint["changed"] and any("no affine weight" in n for n in joint["notes"])  # the second BN
    fw_ops = {n.target for n in fw.before.graph.nodes}
    bw_ops = {n.target for n in bw.before.graph.nodes}
    assert aten._batch_norm_with_update_functional.default in fw_ops
    assert aten.batch_norm_backward.default in bw_ops  # reads the reserve the forward saved
    assert aten._native_batch_norm_legit_functional.default in fw_ops  # the affine-free one stays
    reserve_read = [n for n in bw.before.graph.nodes if n.target is aten.batch_norm_backward.default][0].args[10]
    assert reserve_read.op == "placeholder"


def test_training_batchnorm_keeps_evaluation_mode_and_foreign_users():
    from fxopt.passes import training_batchnorm

    g = torch.fx.Graph()
    x, w, b, rm, rv = (g.placeholder(n) for n in ("x", "w", "b", "rm", "rv"))
    bn = g.call_function(aten._native_batch_norm_legit_functional.default, (x, w, b, rm, rv, False, 0.1, 1e-5))
    g.output((g.call_function(operator.getitem, (bn, 0)),))
    assert training_batchnorm.illegal_reason(bn) == "evaluation mode"
    bn.args = (x, w, b, rm, rv, True, 0.1, 1e-5)
    mean = g.call_function(operator.getitem, (bn, 1))
    g.call_function(aten.add.Tensor, (mean, 1))
    assert "several users" not in (training_batchnorm.illegal_reason(bn) or "")
    assert training_batchnorm.illegal_reason(bn) == "its statistics are read by aten.add.Tensor"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activation_gradients_fuse_into_one_region_matching_aten(dtype):
    """ReLU's and ReLU6's gradients (the backward graph's pointwise work) are fusion-scheduler
    ops: fused with their neighbours, the IR kernels equal to the ATen ops, NVRTC-compiled."""
    from fxopt.testing.fusion import check_regions
    from fxopt.tolerances import tolerance

    def f(g, x, r):
        dx = aten.threshold_backward(g, x, 0)
        d6 = aten.hardtanh_backward(g, r, 0.0, 6.0)
        return aten.add(dx, d6), aten.mul(dx, 2)

    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 5, dtype=dtype)
    x[0, 0, 0, :3] = 0.0  # exactly at the threshold: the gradient is 0 there
    inputs = [torch.randn(2, 8, 5, 5, dtype=dtype), x, torch.randn(2, 8, 5, 5, dtype=dtype) * 6]
    gm = make_fx(f, tracing_mode="fake")(*inputs)
    sched = check_regions(gm, inputs, *tolerance(dtype), compile_kernels=True)
    assert not sched.unfused, sched.unfused  # nothing left to ATen
    ops = {o for r in sched.regions for o in r.ops}
    assert {"aten.threshold_backward.default", "aten.hardtanh_backward.default"} <= ops, ops
