"""pad_channels: channel counts that are not a multiple of 8 carried at the next multiple.

Structural (what widens, what reads the true channels and why, idempotence, when the pass stays
off), numeric (eager's results and strides, ``graph.lint``, the generated kernels' semantics on the
CPU) and a hypothesis property over random CNNs, whose channel counts (1-12) are mostly unaligned."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings

import fxopt
from fxopt.config import Options
from fxopt.passinfra import PassContext
from fxopt.passes import pad_channels
from fxopt.testing import check_equivalence, cnn_cases

ON = {"layout": "channels_last", "pad_channels": "on", "strict": True}


class RexBlock(nn.Module):
    """An expansion block with a squeeze-excite gate and a partial residual over a channel slice,
    of counts that are not multiples of 8 (as ReXNet's)."""

    def __init__(self, cin=19, mid=114, cout=27, rd=9):
        super().__init__()
        self.cin = cin
        self.exp = nn.Sequential(nn.Conv2d(cin, mid, 1), nn.BatchNorm2d(mid), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(mid, mid, 3, 1, 1, groups=mid), nn.BatchNorm2d(mid))
        self.se1, self.se2 = nn.Conv2d(mid, rd, 1), nn.Conv2d(rd, mid, 1)
        self.pwl = nn.Sequential(nn.Conv2d(mid, cout, 1), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.dw(self.exp(x))
        y = y * torch.sigmoid(self.se2(F.relu(self.se1(y.mean((2, 3), keepdim=True)))))
        y = self.pwl(F.relu6(y))
        return torch.cat([y[:, :self.cin] + x, y[:, self.cin:]], dim=1)


class Rex(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 19, 3, 2, 1), nn.BatchNorm2d(19), nn.SiLU())
        self.b1, self.b2 = RexBlock(19, 114, 27, 9), RexBlock(27, 162, 38, 13)
        self.head = nn.Conv2d(38, 64, 1)
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        y = self.head(self.b2(self.b1(self.stem(x))))
        return self.fc(y.mean((2, 3))), y  # a wide value's true channels as an output too


def _init(m: nn.Module, seed=0) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.copy_(torch.randn(mod.num_features, generator=g) * 0.1)
            mod.running_var.copy_(torch.rand(mod.num_features, generator=g) + 0.5)
    return m.eval()


def _record(report):
    return next(p for p in report.passes if p.name == "pad_channels")


def _wide(report) -> dict:
    return {n.name: n.meta["fxopt_channels"] for n in report.after.graph.nodes if "fxopt_channels" in n.meta}


def test_rex_block_runs_wide_and_gives_eagers_results_and_strides():
    m, x = _init(Rex()), torch.randn(2, 3, 20, 20)
    r = fxopt.explain(m, x, options=ON)
    r.after.graph.lint()
    wide = _wide(r)
    assert {(19, 24), (27, 32), (114, 120), (38, 40), (9, 16), (13, 16)} <= set(wide.values())
    convs = [n for n in r.after.graph.nodes if n.target is torch.ops.fxopt.fused_conv.default]
    # every convolution reads and writes a multiple of 8 channels but the stem's input (3) and the head's output
    for c in convs:
        w = c.meta["val"].shape[1]
        assert w % 8 == 0, (c.name, w)
    compiled = torch.compile(m, backend="fxopt", options=ON)
    with torch.no_grad():
        got, want = compiled(x), m(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert g.stride() == w.stride()
    torch.compiler.reset()


def test_half_precision_through_the_cuda_executors_kernels_on_the_cpu():
    """The generated kernels' IR (emulated on the CPU) over the wide tensors: slices, the concat,
    the gate, the depthwise convolution's widened groups."""
    m, x = _init(Rex()).half(), torch.randn(2, 3, 16, 16).half()
    opts = dict(ON, executor="cuda", emulate_kernels=True)
    compiled = torch.compile(m, backend="fxopt", options=opts)
    with torch.no_grad():
        got, want = compiled(x), m.float()(x.float())
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2)
    torch.compiler.reset()


def test_idempotent():
    m, x = _init(Rex()), torch.randn(1, 3, 16, 16)
    r = fxopt.explain(m, x, options=ON)
    ctx = PassContext(options=Options(pad_channels="on"), device_type="cpu")
    gm = r.after
    res = pad_channels.run(gm, ctx)
    assert not res.modified


def test_auto_pads_for_cuda_16_bit_only_and_off_means_off():
    m, x = _init(Rex()), torch.randn(1, 3, 16, 16)
    for opts in ({"layout": "channels_last"}, {"layout": "channels_last", "pad_channels": "off"}):
        r = fxopt.explain(m, x, options=opts)
        assert not _wide(r)
        assert any(n.startswith("skipped") for n in _record(r).notes)
    # float32 under "auto" on CUDA: the convolutions are not 16-bit; nothing widens
    r = fxopt.explain(m, x, options={"layout": "channels_last", "pad_channels": "off"})
    ctx = PassContext(options=Options(), device_type="cuda")
    assert pad_channels.should_run(r.after, ctx) is None
    assert not pad_channels.run(r.after, ctx).modified
    ctx = PassContext(options=Options(), device_type="cuda", mode="training")
    assert pad_channels.should_run(r.after, ctx) == "training graph"


class _Guards(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 12, 3, padding=1)
        self.b = nn.Conv2d(8, 12, 1)

    def forward(self, x):
        y = self.a(x)
        q = y / (y - y)  # division by the extra channels' zero: not finite, not carried
        s = y * self.b(x).sum(1, keepdim=True)  # a runtime operand broadcast over the channels
        return y.relu(), q, s, y.sum(1)


def test_guards_read_the_true_channels():
    m, x = _Guards().eval(), torch.randn(2, 8, 6, 6)
    r = fxopt.explain(m, x, options=ON)
    r.after.graph.lint()
    g = r.after.graph
    assert _wide(r).get("fused_conv_default") == (12, 16)
    div = next(n for n in g.nodes if n.target is torch.ops.aten.div.Tensor)
    assert "fxopt_channels" not in div.meta
    assert all(a.meta["val"].shape[1] == 12 for n in g.nodes for a in n.all_input_nodes
               if n.target in (torch.ops.aten.div.Tensor, torch.ops.aten.sum.dim_IntList))
    compiled = torch.compile(m, backend="fxopt", options=ON)
    with torch.no_grad():
        for g_, w in zip(compiled(x), m(x)):
            torch.testing.assert_close(g_, w, rtol=1e-4, atol=1e-4, equal_nan=True)
            assert g_.stride() == w.stride()
    torch.compiler.reset()


class _Grouped(nn.Module):
    """An unaligned conv read by a grouped conv (which would read a slice, copied by the library
    on every call) and, through a widened conv, by the next conv (which reads it wide)."""

    def __init__(self):
        super().__init__()
        self.a, self.grouped = nn.Conv2d(8, 12, 3, padding=1), nn.Conv2d(12, 12, 3, padding=1, groups=2)
        self.b, self.c = nn.Conv2d(8, 20, 1), nn.Conv2d(20, 16, 1)

    def forward(self, x):
        return self.grouped(self.a(x)), self.c(self.b(x).relu())


def test_a_conv_read_by_a_grouped_conv_keeps_its_true_width():
    m, x = _Grouped().eval(), torch.randn(2, 8, 6, 6)
    r = fxopt.explain(m, x, options=ON)
    r.after.graph.lint()
    wide = _wide(r)
    assert list(wide.values()) == [(20, 24)]  # only b: a is declined
    assert any("kept at its true width" in line for line in _record(r).notes)
    assert not any(n.meta.get("fxopt_channels_slice") for n in r.after.graph.nodes)
    compiled = torch.compile(m, backend="fxopt", options=ON)
    with torch.no_grad():
        for g_, w in zip(compiled(x), m(x)):
            torch.testing.assert_close(g_, w, rtol=1e-4, atol=1e-4)
    torch.compiler.reset()


def _examples(n):
    current = settings.default.max_examples
    return settings(max_examples=min(n, current) if current <= 25 else current)


@_examples(15)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), max_layers=6))
def test_property_random_cnns_padded(case):
    check_equivalence(case, options={"layout": "channels_last", "pad_channels": "on"})


@_examples(6)
@given(cnn_cases(dtypes=(torch.bfloat16,), ndims=(2,), max_layers=5))
def test_property_random_cnns_padded_bfloat16(case):
    check_equivalence(case, options={"layout": "channels_last", "pad_channels": "on"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 8])
def test_gpu_half_pads_by_default_and_gives_eagers_results(batch):
    m = _init(Rex()).half().cuda()
    x = torch.randn(batch, 3, 32, 32, device="cuda").half()
    graphs = []
    from fxopt.testing.strategies import compile_with_fxopt

    compiled = compile_with_fxopt(m, {"strict": True}, graphs)
    with torch.no_grad():
        strides = [t.stride() for t in m(x)]
        for _ in range(3):  # the first call measures, later ones replay
            got = compiled(x)
        want = m.float()(x.float())
    assert any("fxopt_channels" in n.meta for g in graphs for n in g.after.graph.nodes)
    for g, w, st in zip(got, want, strides):
        torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2)
        assert g.stride() == st
    torch.compiler.reset()


def test_symbolic_batch_and_package_keep_the_wide_graph_correct(tmp_path):
    """The pass on Dynamo's symbolic graph (one compile for every batch size) and in a package
    specialized per batch on load: eager's results and strides at each size."""
    m = _init(Rex())
    compiled = torch.compile(m, backend="fxopt", options=ON, dynamic=True)
    path = str(tmp_path / "rex.fxopt")
    fxopt.package(m, (torch.randn(2, 3, 16, 16),), path, options=ON)
    loaded = fxopt.load(path)
    with torch.no_grad():
        for b in (1, 3, 4):
            x = torch.randn(b, 3, 16, 16)
            want = m(x)
            for run in (compiled, loaded):
                for g, w in zip(run(x), want):
                    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
                    assert g.stride() == w.stride()
    torch.compiler.reset()


@_examples(8)
@given(cnn_cases(dtypes=(torch.float16,), ndims=(2,), max_layers=5))
def test_property_random_cnns_padded_through_the_cuda_executors_kernels(case):
    """float16 graphs run by the cuda executor's kernel IR emulated on the CPU (slices of wide values,
    widened depthwise groups, concats ending wide, as the generated kernels see them), padded and
    not: the same results and strides (against eager, the executor's own fp16 rounding over deep
    chains is the executor tests' business)."""
    import copy

    from fxopt.testing.strategies import compile_with_fxopt

    opts = {"layout": "channels_last", "executor": "cuda", "emulate_kernels": True, "strict": True}
    outs = []
    for pad in ("on", "off"):
        compiled = compile_with_fxopt(copy.deepcopy(case.model), dict(opts, pad_channels=pad))
        with torch.no_grad():
            outs.append(compiled(*case.inputs))
    torch.compiler.reset()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-2, atol=1e-3)
    assert outs[0].stride() == outs[1].stride()
