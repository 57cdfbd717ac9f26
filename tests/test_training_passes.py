"""The joint-graph passes of training (``fxopt.pipeline.JOINT_PIPELINE``): structural checks on
small joint graphs traced with fake CUDA tensors (no GPU needed), and numeric checks on the CPU."""
import copy
import operator

import pytest
import torch
from hypothesis import given, settings
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fxopt.config import Options
from fxopt.pipeline import ALL_PASS_NAMES, run_joint_pipeline
from fxopt.testing import check_equivalence, cnn_cases
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


def test_training_layout_reshapes_a_flatten_that_needs_nchw_and_is_an_option():
    """A view that needs the NCHW strides (a flatten of a spatial activation into a linear head)
    becomes a reshape: the pass applies, the flatten copies once, no view is left to fail."""
    gm, args = _joint(flatten_spatial=True)
    out, records = run_joint_pipeline(gm, args, Options())
    rec = {r.name: r for r in records}["training_layout"]
    assert rec.changed and any("view(s) made reshapes" in n for n in rec.notes), rec.notes
    assert all(n.kwargs.get("memory_format") is torch.channels_last for n in _casts(out)
               if n.kwargs.get("dtype") in (torch.float16, torch.bfloat16))
    assert not any(n.target is torch.ops.aten.view.default for n in out.graph.nodes)
    gm, args = _joint(flatten_spatial=False)
    _, records = run_joint_pipeline(gm, args, Options(layout="contiguous"))
    assert not {r.name: r for r in records}["training_layout"].changed
    _, records = run_joint_pipeline(gm, args, Options.from_any({"disable": ["training_layout"]}, ALL_PASS_NAMES))
    assert {r.name: r for r in records}["training_layout"].status == "disabled"


def _train_both(model, shape, steps):
    """(eager's copy, [fxopt's losses, eager's], fxopt's reports) after ``steps`` float32 CPU steps
    of ``model`` compiled with fxopt and of a copy run eagerly, from the same weights and batches."""
    from fxopt.backend import fxopt_backend

    ref = copy.deepcopy(model)
    reports: list = []
    compiled = torch.compile(model, backend=lambda gm, ex: fxopt_backend(gm, ex, _sink=reports))
    batches = make_batches(2, 4, shape, 5)
    losses = [run_steps(TrainLoop(m, m_.parameters(), "cpu", amp=None), batches, steps)
              for m, m_ in ((compiled, model), (ref, ref))]
    return ref, losses, reports


def test_training_batchnorm_runs_eager_kernels_with_the_reserve_and_keeps_eager_numbers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8, affine=False), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    ref, losses, reports = _train_both(model, (3, 8, 8), steps=4)
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


# ---------------------------------------------------------------------------- training_batchnorm_relu
class _ResidualBlock(nn.Module):
    """conv-BN-ReLU, conv-BN-add-ReLU (a residual block), and a BN followed by something else."""

    def __init__(self, c=8):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c3, self.b3 = nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c)
        self.head = nn.Linear(c, 5)

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)) + x)
        y = torch.sigmoid(self.b3(self.c3(y)))
        return self.head(y.mean((2, 3)))


def _native_joint_pipeline(monkeypatch):
    """JOINT_PIPELINE with training_batchnorm_relu on its ``native`` backend (any device)."""
    import functools

    from fxopt import pipeline
    from fxopt.passes import training_batchnorm_relu

    entries = [(name, functools.partial(training_batchnorm_relu.run, backend="native")
                if name == "training_batchnorm_relu" else fn) for name, fn in pipeline.JOINT_PIPELINE]
    monkeypatch.setattr(pipeline, "JOINT_PIPELINE", entries)


def test_batchnorm_relu_fuses_forward_and_backward_and_trains_as_eager(monkeypatch):
    from fxopt.ops import BATCH_NORM_RELU, BATCH_NORM_RELU_BACKWARD

    _native_joint_pipeline(monkeypatch)
    torch.manual_seed(0)
    model = _ResidualBlock()
    ref, losses, reports = _train_both(model, (8, 6, 6), steps=3)
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    for (name, b), rb in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, msg=name)
    fw, bw = (r for r in reports if r.kind in ("forward", "backward"))
    fw_ops = [n.target for n in fw.before.graph.nodes]
    bw_ops = [n.target for n in bw.before.graph.nodes]
    assert fw_ops.count(BATCH_NORM_RELU) == 2 and bw_ops.count(BATCH_NORM_RELU_BACKWARD) == 2
    assert aten.relu.default not in fw_ops and aten.threshold_backward.default not in bw_ops
    fused = [n for n in fw.before.graph.nodes if n.target is BATCH_NORM_RELU]
    assert [n.args[5] is not None for n in fused] == [False, True]  # the second one adds the residual
    rec = {p["name"]: p for p in fw.training["joint_passes"]}["training_batchnorm_relu"]
    assert rec["changed"] and any("followed by sigmoid" in n for n in rec["notes"]), rec["notes"]


def _fake_bn_joint(dtype=F16, channels_last=True, residual=True, extra_reader=False, shortcut_bn=False):
    """A joint-like graph of BN (+ add) + ReLU and their gradients, by hand, with fake CUDA values
    on its inputs (tracing BatchNorm on fake CUDA tensors would ask cuDNN for its reserve size)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.fx.Graph()
    with FakeTensorMode():
        vals = {"x": torch.empty(2, 8, 4, 4, device="cuda", dtype=dtype).to(memory_format=fmt)}
        vals["z"], vals["g"] = torch.empty_like(vals["x"]), torch.empty_like(vals["x"])
        vals.update({k: torch.empty(8, device="cuda") for k in ("w", "b", "rm", "rv")})
    ph = {}
    for name in ("x", "w", "b", "rm", "rv", "z", "g"):
        ph[name] = g.placeholder(name)
        ph[name].meta["val"] = vals[name]
    call = g.call_function
    bn = call(aten._batch_norm_with_update_functional.default, tuple(ph[k] for k in ("x", "w", "b", "rm", "rv")) + (0.1, 1e-5))
    items = [call(operator.getitem, (bn, i)) for i in range(6)]
    z = ph["z"]
    if shortcut_bn:  # the residual is another BatchNorm's output (a projection shortcut)
        bn2 = call(aten._batch_norm_with_update_functional.default,
                   tuple(ph[k] for k in ("z", "w", "b", "rm", "rv")) + (0.1, 1e-5))
        items2 = [call(operator.getitem, (bn2, i)) for i in range(6)]
        z = items2[0]
        z.meta["val"] = vals["z"]
    s = call(aten.add.Tensor, (z, items[0]) if shortcut_bn else (items[0], z)) if residual else items[0]
    r = call(aten.relu.default, (s,))
    t = call(aten.threshold_backward.default, (ph["g"], call(aten.detach.default, (r,)), 0))
    gx = call(aten.batch_norm_backward.default, (t, ph["x"], ph["w"], items[4], items[5], items[1], items[2], True,
                                                 1e-5, [True, True, True], items[3]))
    if shortcut_bn:  # the shortcut BatchNorm's backward reads the same gradient
        gz = call(aten.batch_norm_backward.default, (t, ph["z"], ph["w"], items2[4], items2[5], items2[1], items2[2],
                                                     True, 1e-5, [True, True, True], items2[3]))
        t = call(operator.getitem, (gz, 0))
    extra = (call(aten.mul.Tensor, (s, 2)),) if extra_reader else ()
    z_grad = (t,) if residual else ()  # what reaches z is the ReLU's gradient
    g.output((r, *[call(operator.getitem, (gx, i)) for i in range(3)], *z_grad, items[4], items[5], *extra))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("variant,reason", [
    ({}, None), ({"residual": False}, None),
    ({"dtype": torch.float32}, "float32 input"), ({"channels_last": False}, "not channels_last"),
    ({"extra_reader": True}, "followed by"), ({"shortcut_bn": True}, None),
])
def test_batchnorm_relu_match_and_its_reasons(variant, reason):
    from fxopt.passes.training_batchnorm_relu import BN, match

    gm = _fake_bn_joint(**variant)
    bn = next(n for n in gm.graph.nodes if n.target is BN)
    m, why = match(bn)
    if reason is None:
        assert m is not None, why
        assert (m.add is not None) == variant.get("residual", True)
        assert m.grad.target is aten.threshold_backward.default
        assert m.backward.args[1] is bn.args[0]  # this BatchNorm's backward, not the shortcut's
    else:
        assert m is None and reason in why, why


def test_batchnorm_relu_on_a_fake_cuda_graph_asks_cudnn():
    """Without a GPU cuDNN cannot be asked, and the pass says so; with one it fuses. The pass asks
    the target the backend entry builds (``fxopt.backends.target_for``), not the executor."""
    from fxopt.backends import target_for
    from fxopt.passes import training_batchnorm_relu
    from fxopt.passinfra import PassContext

    gm = _fake_bn_joint()
    target = target_for(Options(), "cuda", "training")
    assert target.batch_norm_relu == "cudnn" and target.batch_norm_relu_probe is not None
    ctx = PassContext(options=Options(), mode="training", device_type="cuda", target=target)
    ctx.current_pass = "training_batchnorm_relu"
    result = training_batchnorm_relu.run(gm, ctx)
    notes = ctx.notes.get("training_batchnorm_relu", [])
    if torch.cuda.is_available():
        assert result.modified, notes
    else:
        assert not result.modified and any("cuDNN" in n for n in notes), notes


def test_batchnorm_relu_on_a_symbolic_batch_is_left_alone_without_a_guard():
    """cuDNN sizes the fused kernel's reserve (the ReLU's mask) per batch: on a graph whose batch is
    symbolic the pass keeps the BatchNorm, says why, and neither asks the probe nor adds a guard
    (one would specialize Dynamo's graph to the traced batch)."""
    import dataclasses

    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fxopt.backends import target_for
    from fxopt.passes import training_batchnorm_relu
    from fxopt.passinfra import PassContext

    gm = _fake_bn_joint(residual=False)
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    sym = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * 3)
    x = next(n for n in gm.graph.nodes if n.name == "x")
    meta = torch.empty(3, 8, 4, 4, device="meta", dtype=F16).to(memory_format=torch.channels_last)
    with mode:
        x.meta["val"] = mode.from_tensor(meta, symbolic_context=sym).to("cuda")
    asked = []
    target = dataclasses.replace(target_for(Options(), "cuda", "training"),
                                 batch_norm_relu_probe=lambda *a: asked.append(a) or (0, None))
    ctx = PassContext(options=Options(), mode="training", device_type="cuda", target=target)
    ctx.current_pass = "training_batchnorm_relu"
    before = gm.code
    assert not training_batchnorm_relu.run(gm, ctx).modified and gm.code == before
    assert asked == [] and any("symbolic sizes" in n for n in ctx.notes["training_batchnorm_relu"]), ctx.notes
    assert not [g for g in env.guards if str(g.expr).startswith("Eq(")], env.guards
    x.meta["val"] = torch.empty(3, 8, 4, 4, device="meta", dtype=F16).to(memory_format=torch.channels_last)
    with FakeTensorMode() as static:
        x.meta["val"] = static.from_tensor(x.meta["val"]).to("cuda")
    ctx.notes.clear()
    assert training_batchnorm_relu.run(gm, ctx).modified and len(asked) == 1  # at static sizes it asks


def test_batchnorm_relu_without_the_targets_kernel_is_left_alone():
    """A target without the fused kernel (the generic one, or an executor without it) keeps the
    graph as it is and says why."""
    from fxopt.backends import target_for
    from fxopt.passes import training_batchnorm_relu
    from fxopt.passinfra import PassContext

    for target in (None, target_for(Options(executor="onnxruntime"), "cuda", "training")):
        gm = _fake_bn_joint()
        before = gm.code
        ctx = PassContext(options=Options(), mode="training", device_type="cuda", target=target)
        ctx.current_pass = "training_batchnorm_relu"
        assert not training_batchnorm_relu.run(gm, ctx).modified and gm.code == before
        assert ctx.notes["training_batchnorm_relu"] == [f"skipped: {ctx.target.batch_norm_relu_reason}"]
        assert ctx.target.batch_norm_relu is None


@pytest.mark.parametrize("residual", [True, False])
def test_batchnorm_relu_rewrite_leaves_one_op_each_way_and_is_idempotent(residual):
    from fxopt.ops import BATCH_NORM_RELU, BATCH_NORM_RELU_BACKWARD
    from fxopt.passes import training_batchnorm_relu
    from fxopt.passinfra import PassContext

    gm = _fake_bn_joint(residual=residual)
    ctx = PassContext(options=Options(), mode="training", device_type="cuda")
    assert training_batchnorm_relu.run(gm, ctx, backend="native").modified
    gm.graph.lint()
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert ops.count(BATCH_NORM_RELU) == 1 and ops.count(BATCH_NORM_RELU_BACKWARD) == 1
    gone = (aten.relu.default, aten.add.Tensor, aten.threshold_backward.default, aten.batch_norm_backward.default,
            aten._batch_norm_with_update_functional.default, aten.detach.default)
    assert not set(ops) & set(gone), ops
    fused = next(n for n in gm.graph.nodes if n.target is BATCH_NORM_RELU)
    assert (fused.args[5] is not None) == residual
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    if residual:  # z's gradient is the fused backward's fourth output
        assert outputs[4].target is operator.getitem and outputs[4].args[1] == 3
    assert not training_batchnorm_relu.run(gm, ctx, backend="native").modified


@settings(max_examples=12 if settings.default.max_examples <= 25 else settings.default.max_examples, deadline=None)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), training=True, min_batch=2, max_layers=4))
def test_property_batchnorm_relu_rewrite_of_random_training_graphs_matches_eager(case):
    """training_batchnorm_relu on its native backend, over the training graphs the strategies draw
    (BatchNorm, ReLU, residual blocks): loss, gradients and buffers as eager's; the cuDNN backend's
    kernels are checked against float64 on the GPU (tests/test_gpu.py)."""
    import functools
    from unittest import mock

    from fxopt import pipeline
    from fxopt.passes import training_batchnorm_relu

    entries = [(name, functools.partial(training_batchnorm_relu.run, backend="native")
                if name == "training_batchnorm_relu" else fn) for name, fn in pipeline.JOINT_PIPELINE]
    with mock.patch.object(pipeline, "JOINT_PIPELINE", entries):
        check_equivalence(case)


@pytest.mark.skipif(not torch.backends.cudnn.is_available(), reason="this PyTorch has no cuDNN")
def test_cudnn_batchnorm_bindings_resolve_in_the_library_pytorch_loaded():
    """The CPU-testable half of the cuDNN path: every function it calls exists in the cuDNN
    library PyTorch loaded, with the argument count it is declared with, and a call that needs no
    device answers; without a device the probe declines with that reason."""
    from fxopt.backends.cuda.kernels import batchnorm_train as cb

    lib = cb._lib()
    for name, args in cb._SIGNATURES.items():
        assert len(getattr(lib, name).argtypes) == len(args), name
    assert lib.cudnnGetErrorString(0) == b"CUDNN_STATUS_SUCCESS"
    if not torch.cuda.is_available():
        reserve, why = cb.probe((2, 8, 4, 4), F16, True)
        assert (reserve, why) == (None, "cuDNN needs a CUDA device")


# ---------------------------------------------------------------------------- redundant_clones
def _clone_joint():
    """A joint-like graph with the clones autograd makes before in-place activations (one saved
    for the backward), and clones that must stay: one returned, one of an input, one of a view of
    an input the graph writes at its end, one changing the layout."""
    def f(x, w, g, buf):
        c = aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        saved = aten.clone(c)                      # what hardtanh_'s backward reads
        y = aten.hardtanh(c, 0.0, 6.0)
        dx = aten.hardtanh_backward(g, saved, 0.0, 6.0)
        back = aten.clone(dx)                      # returned: the caller's own tensor
        of_input = aten.clone(x)                   # a copy of a graph input
        of_view = aten.clone(aten.select(aten.view(buf, [1]), 0, 0))  # of a view of one (written below)
        cl = aten.clone(c, memory_format=torch.channels_last)
        written = aten.clone(c)
        aten.copy_(buf, aten.add(aten.mean(written), aten.mean(of_input)))
        return y, back, aten.mean(cl), aten.mul(of_view, 2)

    args = [torch.randn(2, 3, 6, 6), torch.randn(4, 3, 3, 3), torch.randn(2, 4, 6, 6), torch.zeros(())]
    return make_fx(f, tracing_mode="fake")(*args), args


def test_redundant_clones_drops_the_copy_saved_for_backward_and_keeps_the_others():
    from fxopt.passes import redundant_clones
    from fxopt.passinfra import PassContext

    from fxopt.pipeline import copy_graph_module

    gm, args = _clone_joint()
    before = copy_graph_module(gm)
    ctx = PassContext(options=Options(), mode="training")
    clones = [n for n in gm.graph.nodes if n.target is aten.clone.default]
    assert len(clones) == 6
    returned = set(next(n for n in gm.graph.nodes if n.op == "output").all_input_nodes)
    reasons = [redundant_clones.illegal_reason(n, returned) for n in clones]
    assert reasons == [None, "the graph returns it", "it copies (a view of) a graph input",
                       "it copies (a view of) a graph input", "it sets a memory format", None]
    res = redundant_clones.run(gm, ctx)
    assert res.modified
    left = [n for n in res.graph_module.graph.nodes if n.target is aten.clone.default]
    assert len(left) == 4  # the saved copy and the copy only read by a mean went; the others stay
    hb = next(n for n in res.graph_module.graph.nodes if n.target is aten.hardtanh_backward.default)
    assert hb.args[1].target is aten.convolution.default  # the backward reads the original
    res.graph_module.graph.lint()
    torch.testing.assert_close(res.graph_module(*[a.clone() for a in args]), before(*[a.clone() for a in args]),
                               rtol=0, atol=0)  # bit for bit (each on its own copy of the written buffer)
    again = redundant_clones.run(res.graph_module, PassContext(options=Options(), mode="training"))
    assert not again.modified  # idempotent


@pytest.mark.parametrize("act", [nn.ReLU6, nn.SiLU, nn.Hardswish])
def test_redundant_clones_in_place_activations_train_as_eager_without_the_copies(act):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), act(inplace=True),
                          nn.Conv2d(8, 8, 3, padding=1), act(inplace=True),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    ref, losses, reports = _train_both(model, (3, 8, 8), steps=3)
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=name)
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    fw, bw = (r for r in reports if r.kind in ("forward", "backward"))
    rec = {p["name"]: p for p in fw.training["joint_passes"]}["redundant_clones"]
    assert rec["changed"] and any("2 clone(s)" in n for n in rec["notes"]), rec["notes"]
    for r in (fw, bw):
        assert not any(n.target is aten.clone.default for n in r.before.graph.nodes)


# ---------------------------------------------------------------------------- running statistics in place
def _bn_forward(returned_stats: bool, extra_read: bool):
    """A training forward as AOTAutograd gives it: functional BatchNorm, its new statistics and
    the incremented counter copied into the buffers at the end."""
    def f(x, w, b, rm, rv, n):
        out = aten._batch_norm_with_update_functional(x, w, b, rm, rv, 0.1, 1e-5)
        y = aten.relu(out[0])
        if extra_read:
            y = aten.add(y, aten.mean(rm))
        aten.copy_(rm, out[4])
        aten.copy_(rv, out[5])
        aten.copy_(n, aten.add(n, 1))
        return (y, out[1], out[4]) if returned_stats else (y, out[1])

    def inputs():
        torch.manual_seed(0)
        return [torch.randn(4, 3, 5, 5), torch.rand(3) + 0.5, torch.randn(3), torch.randn(3), torch.rand(3) + 1,
                torch.tensor(7)]

    return make_fx(f)(*inputs()), inputs


@pytest.mark.parametrize("returned_stats, extra_read, expect", [(False, False, {"batch_norms": 1, "counters": 1}),
                                                                 (True, False, {"batch_norms": 0, "counters": 1}),
                                                                 (False, True, {"batch_norms": 0, "counters": 1})])
def test_batchnorm_updates_running_statistics_in_place_where_nothing_else_reads_them(returned_stats, extra_read,
                                                                                     expect):
    from fxopt.backends.cuda.runtime.running_stats import update_in_place
    from fxopt.pipeline import copy_graph_module

    gm, inputs = _bn_forward(returned_stats, extra_read)
    before = copy_graph_module(gm)
    assert update_in_place(gm) == expect
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    copies = ops.count(aten.copy_.default)
    assert copies == (0 if expect["batch_norms"] else 2) and ops.count(aten._foreach_add_.Scalar) == 1
    assert (aten._batch_norm_with_update.default in ops) == bool(expect["batch_norms"])
    a, b = inputs(), inputs()
    torch.testing.assert_close(gm(*a), before(*b), rtol=0, atol=0)
    for x, y in zip(a, b):  # the buffers and the counter updated alike
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert int(a[5]) == 8
    assert update_in_place(gm) == {"batch_norms": 0, "counters": 0}  # idempotent


def test_batchnorm_relu_trains_with_statistics_updated_in_place_on_the_cuda_executor(monkeypatch):
    """fxopt::batch_norm_relu (its native backend, on the CPU) and a plain BatchNorm in a model trained
    through the cuda executor's lowering: their statistics and counters are updated in place, the
    training equals eager's."""
    from fxopt.backend import fxopt_backend
    _native_joint_pipeline(monkeypatch)
    torch.manual_seed(0)
    model = _ResidualBlock()
    ref = copy.deepcopy(model)
    reports: list = []
    compiled = torch.compile(model, backend=lambda gm, ex: fxopt_backend(gm, ex, options={"executor": "cuda"},
                                                                         _sink=reports))
    batches = make_batches(2, 4, (8, 6, 6), 5)
    losses = [run_steps(TrainLoop(m, p.parameters(), "cpu", amp=None), batches, 3)
              for m, p in ((compiled, model), (ref, ref))]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]))
    for (name, b), rb in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, msg=name)
    fw = next(r for r in reports if r.kind == "forward")
    # the two fused ones and the plain one (its backward reads no running statistics)
    assert fw.executor_details["updated_in_place"] == {"batch_norms": 3, "counters": 3}
