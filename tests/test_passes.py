"""Structural and numeric tests of each pass on small hand-built models."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.ops import FUSED_CONV, FUSED_LINEAR
from fxopt.testing import SmallResNet

BN_OPS = ("aten._native_batch_norm_legit_no_training.default", "aten._native_batch_norm_legit_functional.default",
          "aten.native_batch_norm.default", "aten._batch_norm_with_update_functional.default")


def calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def record(report, name):
    return next(p for p in report.passes if p.name == name)


class ConvBN(nn.Module):
    def __init__(self, ndim=2, groups=1, bias=True, act=None):
        super().__init__()
        conv, bn = {1: (nn.Conv1d, nn.BatchNorm1d), 2: (nn.Conv2d, nn.BatchNorm2d), 3: (nn.Conv3d, nn.BatchNorm3d)}[ndim]
        self.conv = conv(4, 8, 3, padding=1, groups=groups, bias=bias)
        self.bn = bn(8)
        self.act = act or nn.Identity()
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


@pytest.mark.parametrize("ndim,groups,bias", [(1, 1, True), (2, 1, False), (2, 2, True), (2, 4, False), (3, 1, True)])
def test_fold_batchnorm_conv(ndim, groups, bias):
    m = ConvBN(ndim, groups, bias).eval()
    x = torch.randn((2, 4) + (6,) * ndim)
    r = fxopt.explain(m, x, options={"passes": ["fold_batchnorm"]})
    assert not any(op in r.op_counts_after for op in BN_OPS)
    assert r.op_counts_before["aten._native_batch_norm_legit_no_training.default"] == 1
    assert record(r, "fold_batchnorm").changed
    with torch.no_grad():
        torch.testing.assert_close(r.after(*_inputs_of(r, m, x)), (m(x),), rtol=1e-5, atol=1e-5)


def _inputs_of(report, model, x):
    """The runtime inputs of the captured graph, in placeholder order (params by name)."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    values = []
    for node in report.before.graph.nodes:
        if node.op == "placeholder":
            values.append(None)
    # Dynamo orders placeholders as they are first used; rebuild by shape/identity through a real compile.
    graphs = []
    from fxopt.backend import fxopt_backend

    captured = {}

    def backend(gm, inputs):
        captured["inputs"] = inputs
        return fxopt_backend(gm, inputs, options={"passes": []}, _sink=graphs)

    torch.compiler.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    del params, values
    return captured["inputs"]


def test_fold_batchnorm_linear():
    m = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2)
    r = fxopt.explain(m, torch.randn(3, 6))
    assert not any(op in r.op_counts_after for op in BN_OPS)
    assert r.op_counts_after.get(str(FUSED_LINEAR)) == 1


def test_fold_batchnorm_leaves_training_batchnorm():
    m = ConvBN().train()
    r = fxopt.explain(m, torch.randn(2, 4, 6, 6))
    assert any(op in r.op_counts_after for op in BN_OPS)
    assert not record(r, "fold_batchnorm").changed


def test_fold_batchnorm_negative_conv_output_used_twice():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y

    r = fxopt.explain(M().eval(), torch.randn(1, 3, 8, 8))
    assert r.op_counts_after.get("aten._native_batch_norm_legit_no_training.default") == 1
    assert any("other users" in n for n in record(r, "fold_batchnorm").notes)


ACTS = [(nn.ReLU(), "relu", []), (nn.ReLU(inplace=True), "relu", []), (nn.ReLU6(), "hardtanh", [0.0, 6.0]),
        (nn.Hardtanh(-2, 3), "hardtanh", [-2.0, 3.0]), (nn.LeakyReLU(0.2), "leaky_relu", [0.2]), (nn.SiLU(), "silu", []),
        (nn.GELU(), "gelu", []), (nn.GELU(approximate="tanh"), "gelu_tanh", []), (nn.Hardswish(), "hardswish", []),
        (nn.Hardsigmoid(), "hardsigmoid", []), (nn.Sigmoid(), "sigmoid", []), (nn.Tanh(), "tanh", [])]


@pytest.mark.parametrize("act,name,params", ACTS, ids=[a[1] + str(i) for i, a in enumerate(ACTS)])
def test_fuse_conv_bn_activation(act, name, params):
    m = ConvBN(act=act).eval()
    x = torch.randn(2, 4, 7, 7)
    r = fxopt.explain(m, x)
    fused = calls(r.after, FUSED_CONV)
    assert len(fused) == 1
    assert fused[0].args[8] == name and fused[0].args[9] == pytest.approx(params)
    assert r.op_counts_after.get(str(FUSED_CONV)) == 1 and len(r.op_counts_after) <= 3  # fused + constants
    compiled = torch.compile(m, backend="fxopt")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)


def test_fuse_residual_add_relu():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return F.relu(self.conv(x) + x)

    r = fxopt.explain(Block().eval(), torch.randn(1, 4, 5, 5))
    (fused,) = calls(r.after, FUSED_CONV)
    assert fused.args[3] is not None and fused.args[8] == "relu"
    assert "aten.add.Tensor" not in r.op_counts_after and "aten.relu.default" not in r.op_counts_after


def test_fuse_stops_at_shared_intermediate():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            y = self.conv(x)
            return torch.relu(y), y

    r = fxopt.explain(M().eval(), torch.randn(1, 3, 6, 6))
    (fused,) = calls(r.after, FUSED_CONV)
    assert fused.args[8] == "none"
    assert r.op_counts_after.get("aten.relu.default") == 1


def test_fuse_broadcast_add_is_not_residual():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.b = nn.Parameter(torch.randn(4, 1, 1))

        def forward(self, x):
            return self.conv(x) + self.b

    r = fxopt.explain(M().eval(), torch.randn(1, 3, 6, 6))
    (fused,) = calls(r.after, FUSED_CONV)
    assert fused.args[3] is None


def test_fuse_is_idempotent():
    from fxopt.passes import fuse_conv_epilogue

    r = fxopt.explain(SmallResNet().eval(), torch.randn(1, 3, 32, 32))
    gm = r.after
    from fxopt.config import Options
    from fxopt.passinfra import PassContext

    result = fuse_conv_epilogue.run(gm, PassContext(options=Options()))
    assert not result.modified


def test_training_graph_keeps_batchnorm_and_fuses_only_legal():
    r = fxopt.explain(SmallResNet().train(), torch.randn(2, 3, 32, 32), training=True)
    kinds = [g.kind for g in r.graphs]
    assert kinds == ["forward", "backward"]
    fw = r.graphs[0]
    assert any(op in fxopt.report.op_counts(fw.after) for op in BN_OPS)
    # the joint-graph passes (before the split) are in the report's table once, with their reasons
    rows = [line.split() for line in r.table().splitlines() if line.startswith("0:joint")]
    assert [row[1] for row in rows] == ["redundant_clones", "training_batchnorm", "training_layout",
                                        "training_batchnorm_relu", "pool_backward_layout"]
    assert "not CUDA" in r.table() and "1:joint" not in r.table()


def test_layout_channels_last_gives_eager_strides():
    m = SmallResNet().eval()
    x = torch.randn(2, 3, 32, 32)
    r = fxopt.explain(m, x, options={"layout": "channels_last"})
    assert record(r, "layout").changed
    convs = calls(r.after, FUSED_CONV)
    assert all(c.args[0].meta["val"].is_contiguous(memory_format=torch.channels_last) for c in convs)
    out = next(n for n in r.after.graph.nodes if n.op == "output").args[0][0]
    assert out.meta["val"].is_contiguous()
    compiled = torch.compile(m, backend="fxopt", options={"layout": "channels_last"})
    with torch.no_grad():
        got, want = compiled(x), m(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.stride() == want.stride()


def test_layout_converts_only_what_is_not_channels_last_already():
    """A 1x1 weight (and any tensor whose strides are both formats) gets no conversion inserted,
    rather than one that ``drop_redundant`` removes again (its users' metadata would have to be
    recomputed twice)."""
    from fxopt.passes.layout import to_channels_last

    m = nn.Sequential(nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 1), nn.ReLU()).eval()
    r = fxopt.explain(m, torch.randn(2, 8, 10, 10), options={"layout": "contiguous"})
    gm = r.after
    convs = calls(gm, FUSED_CONV)
    before = [c.args[1] for c in convs]
    assert to_channels_last(gm, {}) == 2
    assert convs[1].args[1] is before[1]  # 1x1 weight: already channels_last-contiguous
    assert convs[0].args[1] is not before[0] and convs[0].args[1].kwargs["memory_format"] is torch.channels_last
    assert all(c.args[0].target is torch.ops.aten.clone.default for c in convs)  # NCHW activations
    gm.graph.lint()


def test_layout_auto_skips_small_cnns_and_takes_conv_heavy_ones_on_cuda():
    from fxopt.config import Options
    from fxopt.passes.layout import should_run
    from fxopt.passinfra import PassContext
    from fxopt.testing.models import SeedCNN

    def reason(model):
        r = fxopt.explain(model.eval(), torch.randn(1, 3, 32, 32), options={"layout": "contiguous"})
        return should_run(r.after, PassContext(options=Options(), device_type="cuda"))

    # conv 3->6 and 6->16: nothing for NHWC kernels to vectorize over, only boundary copies
    assert reason(SeedCNN()) == "every convolution has fewer than 16 input or output channels"
    assert reason(SmallResNet()) is None
    assert reason(nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3))) is not None
    assert reason(nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Conv2d(16, 16, 3))) is None


def test_layout_returns_conv_output_with_eager_strides():
    m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(2, 3, 9, 9).contiguous(memory_format=fmt)
        compiled = torch.compile(m, backend="fxopt", options={"layout": "channels_last"})
        with torch.no_grad():
            got, want = compiled(x), m(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert got.stride() == want.stride()
        torch.compiler.reset()


class _SliceOutputs(nn.Module):
    """A conv's output concatenated, and sliced / split into graph outputs (views of it)."""
    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.bn = nn.Conv2d(4, 6, 1), nn.Conv2d(6, 6, 3, padding=1), nn.BatchNorm2d(10)

    def forward(self, x):
        y = self.c1(x)
        a, b = torch.split(y, [2, 4], 1)
        return torch.relu(self.bn(torch.cat([x, y], 1))), y[:, 3:], b, self.c2(torch.cat([a, b], 1)), a * 2


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_layout_gives_slices_of_a_conv_output_eagers_strides(fmt):
    """Slicing views keep NHWC flowing inside the graph; a view handed out keeps eager's strides,
    which are those of eager's base (an NHWC one where the model runs channels_last, else NCHW)."""
    m = _SliceOutputs().eval().to(memory_format=fmt)
    x = torch.randn(2, 4, 5, 5).contiguous(memory_format=fmt)
    r = fxopt.explain(m, x, options={"layout": "channels_last"})
    r.after.graph.lint()
    split = next(n for n in r.after.graph.nodes if n.target in (torch.ops.aten.split_with_sizes.default,
                                                                 torch.ops.aten.split.Tensor))
    # the split reads the conv's NHWC output in place where eager's was NHWC; else an NCHW copy of it
    assert (split.args[0].target is torch.ops.aten.clone.default) == (fmt is torch.contiguous_format)
    compiled = torch.compile(m, backend="fxopt", options={"layout": "channels_last"})
    with torch.no_grad():
        got, want = compiled(x), m(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        assert g.stride() == w.stride(), (g.shape, g.stride(), w.stride())
    torch.compiler.reset()


def test_layout_keeps_the_output_conversion_where_only_size_one_strides_differ():
    """A pooled NHWC output (1, c, 1, 1) is contiguous too, but its strides are not eager's: the
    conversion before the output stays (found by the thorough hypothesis profile); a conversion
    before a non-output consumer (the flatten of a classifier head) is still dropped."""
    def conversions(gm):
        return [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default
                and n.kwargs.get("memory_format") is torch.contiguous_format]

    pooled = nn.Sequential(nn.Conv2d(2, 2, 1, stride=2, bias=False), nn.GELU(), nn.Conv2d(2, 2, 1, bias=False),
                           nn.GELU(), nn.MaxPool2d(2)).eval()
    x = torch.randn(1, 2, 6, 6)
    r = fxopt.explain(pooled, x, options={"layout": "channels_last"})
    (conv,) = conversions(r.after)
    assert conv in next(n for n in r.after.graph.nodes if n.op == "output").args[0]
    compiled = torch.compile(pooled, backend="fxopt", options={"layout": "channels_last"})
    with torch.no_grad():
        got, want = compiled(x), pooled(x)
    torch.testing.assert_close(got, want)
    assert got.stride() == want.stride() == (2, 1, 1, 1)
    torch.compiler.reset()

    head = nn.Sequential(nn.Conv2d(2, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 3)).eval()
    r = fxopt.explain(head, x, options={"layout": "channels_last"})
    assert not conversions(r.after)  # (1, 4, 1, 1) before flatten: strides of size-1 dims do not matter
    r.after.graph.lint()


def test_fold_constants_evaluates_once_and_refolds_on_change():
    m = ConvBN(act=nn.ReLU()).eval()
    x = torch.randn(2, 4, 6, 6)
    graphs = []
    # the optimized graph must run (the cpu executor may pick the unoptimized one for a tiny graph, or
    # an ONNX Runtime / OpenVINO session where one measures faster)
    compiled = fxopt.testing.compile_with_fxopt(
        m, {"baseline_check": False, "cpu_onnxruntime": False, "cpu_openvino": False, "cpu_generated_c": False}, graphs)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        folded = graphs[0].after.fxopt_constants
        assert folded.evaluations >= 1
        n = folded.evaluations
        compiled(x)
        assert folded.evaluations == n  # cached
        m.bn.running_var.mul_(2.0)  # in place: version counter moves
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    assert graphs[0].after.fxopt_constants.evaluations == n + 1


def test_optimizer_step_is_seen_by_compiled_inference():
    m = SmallResNet().eval()
    compiled = torch.compile(m, backend="fxopt")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        compiled(x)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(x).sum().backward()
    opt.step()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)


def test_dead_code_removes_unused():
    class M(nn.Module):
        def forward(self, x):
            unused = torch.sin(x) * 2  # noqa: F841
            return x.to(torch.float32) + 1

    r = fxopt.explain(M(), torch.randn(3))
    assert "aten.sin.default" not in r.op_counts_after


def test_layout_on_the_cpu_follows_the_target_not_the_executor_option():
    """The layout pass asks ``ctx.target`` whether NHWC convolutions pay on the CPU: a target
    without them keeps NCHW with its reason, one with them for the graph's dtype takes NHWC."""
    from fxopt.config import Options
    from fxopt.passes.layout import should_run
    from fxopt.passinfra import PassContext
    from fxopt.target import Target

    r = fxopt.explain(SmallResNet().eval(), torch.randn(2, 3, 32, 32), options={"passes": ["fuse_conv_epilogue"]})
    gm = r.graphs[0].after
    no = Target(device_type="cpu", executor="torch", cpu_channels_last="no NHWC here")
    yes = Target(device_type="cpu", executor="cpu", cpu_channels_last=None,
                 cpu_channels_last_dtypes=(torch.float32,))
    wrong_dtype = Target(device_type="cpu", executor="cpu", cpu_channels_last=None,
                         cpu_channels_last_dtypes=(torch.bfloat16,))
    ask = lambda t: should_run(gm, PassContext(options=Options(), device_type="cpu", target=t))  # noqa: E731
    assert ask(no) == "layout='auto' keeps NCHW on CPU: no NHWC here"
    assert ask(yes) is None
    assert "bfloat16" in ask(wrong_dtype)


def test_output_formats_gives_outputs_eagers_format_where_a_decomposition_changed_it():
    """An output whose eager format (recorded from Dynamo's graph) is channels_last but whose value
    in the graph is contiguous (a decomposed upsample on CUDA) gets a conversion; a view's output
    (no dense format) and an output already right get none; training graphs are left alone."""
    from fxopt.config import Options
    from fxopt.passes import output_formats
    from fxopt.passinfra import PassContext

    class M(nn.Module):
        def forward(self, x):
            return x * 2, x + 1, (x - 1)[:, :1]

    x = torch.randn(2, 3, 4, 5)
    r = fxopt.explain(M(), x, options={"layout": "contiguous"})
    gm = r.after
    ctx = PassContext(options=Options(), device_type="cpu")
    ctx.mode = "inference"
    ctx.output_formats = [torch.channels_last, torch.contiguous_format, None]
    assert [i for i, _, _ in output_formats.wrong_formats(gm, ctx)] == [0]
    res = output_formats.run(gm, ctx)
    assert res.modified
    gm.graph.lint()
    outs = gm(x)
    want = M()(x)
    assert outs[0].is_contiguous(memory_format=torch.channels_last) and outs[1].is_contiguous()
    for g, w in zip(outs, want):
        torch.testing.assert_close(g, w)
    assert not output_formats.run(gm, ctx).modified  # idempotent
    ctx.mode = "training"
    assert not output_formats.run(r.after, ctx).modified


def test_eager_output_formats_come_from_dynamos_graph_where_the_outputs_match():
    from fxopt.backend import _eager_output_formats

    cl, nchw = torch.channels_last, torch.contiguous_format
    assert _eager_output_formats([nchw, nchw], [cl, None]) == [cl, nchw]
    assert _eager_output_formats([nchw], [cl, cl]) == [nchw]  # AOTAutograd added or dropped outputs
