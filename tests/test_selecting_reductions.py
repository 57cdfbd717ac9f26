"""A max / min reduction and the values it selects from stay bitwise one computation.

amax's gradient compares the input with the maximum (``x == x.amax(1)``) and divides by the count
of maxima. Where the input was computed inline by two kernels (the reduction's and another's), or
recomputed in the backward, by implementations that round otherwise (a generated ``tanhf``,
PyTorch's GELU: each region keeps what its measurement chose), no element equalled the maximum
and the gradient came out NaN (GPU fuzz a93a79118e, float32 training: GELU, then amax over the
channels). Now the input of such a reduction is stored once where something else reads it too
(``fusion._selected_from``), and the joint graph saves the compared values for the backward
(``fxopt.training.save_compared_values``).
"""
import contextlib

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import fxopt
from fxopt.testing.fusion import evaluate_regions


class GeluMax(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        y = F.gelu(self.conv(x), approximate="tanh")
        return y - y.amax(1, keepdim=True)


def _regions(model, x):
    return [region for region, _, _ in evaluate_regions(model, (x,), {"executor": "cuda"})]


def test_the_values_an_amax_selects_from_are_stored_once_and_read_by_it():
    class Plain(nn.Module):
        def forward(self, x):
            y = F.gelu(x * 2.0, approximate="tanh")
            return y - y.amax(1, keepdim=True)
    regions = _regions(Plain().eval(), torch.randn(2, 3, 4, 4))
    amax = [r for r in regions if "aten.amax.default" in r.ops]
    assert len(amax) == 1 and "aten.gelu.default" not in amax[0].ops  # it reads the stored GELU
    assert sum("aten.gelu.default" in r.ops for r in regions) == 1  # computed by one kernel only


def test_an_amax_over_an_input_read_by_nothing_else_keeps_its_prologue_inline():
    class Only(nn.Module):
        def forward(self, x):
            return F.gelu(x * 2.0).amax(1)
    regions = _regions(Only().eval(), torch.randn(2, 3, 4, 4))
    assert len(regions) == 1 and {"aten.gelu.default", "aten.amax.default"} <= set(regions[0].ops)


def test_the_backward_reads_the_forwards_compared_values_instead_of_recomputing_them():
    report = fxopt.explain(GeluMax(), torch.randn(2, 3, 4, 4, requires_grad=True), training=True,
                           options={"executor": "cuda"})
    backward = [g for g in report.graphs if g.kind == "backward"]
    assert backward and report.graphs[0].training["partitioner"] == "min_cut"
    recomputed = [n for g in backward for n in g.after.graph.nodes
                  if n.op == "call_function" and n.target is torch.ops.aten.gelu.default]
    assert not recomputed


def test_save_compared_values_marks_forward_operands_only():
    from torch.utils.checkpoint import CheckpointPolicy

    from fxopt.training import save_compared_values

    aten = torch.ops.aten
    g = fx.Graph()
    p, t = g.placeholder("primals_1"), g.placeholder("tangents_1")
    y = g.call_function(aten.gelu.default, (p,))
    m = g.call_function(aten.amax.default, (y, [1], True))
    mask = g.call_function(aten.eq.Tensor, (y, m))
    gt = g.call_function(aten.mul.Tensor, (t, 2.0))
    other = g.call_function(aten.eq.Tensor, (gt, m))  # an operand of the backward's own
    g.output((m, mask, other))
    for n, v in ((p, torch.randn(2, 3)), (t, torch.randn(2, 1)), (y, torch.randn(2, 3)), (m, torch.randn(2, 1)),
                 (gt, torch.randn(2, 1))):
        n.meta["val"] = v
    assert save_compared_values(fx.GraphModule(nn.Module(), g)) == 2  # y and m
    assert y.meta["recompute"] == CheckpointPolicy.MUST_SAVE and m.meta["recompute"] == CheckpointPolicy.MUST_SAVE
    assert "recompute" not in gt.meta and "recompute" not in p.meta


def test_option_emulate_kernels_runs_a_training_step_through_the_kernels_ir(monkeypatch):
    """On the CPU, option ``emulate_kernels`` puts each fused region's kernel IR (``ir.evaluate``) in
    its reference's place, the backward's regions included; a region whose inputs are not laid out
    as planned runs its reference, as the generated kernel declines them."""
    import copy

    from fxopt.backends.cuda.schedule import generated

    ran, declined = [], []
    real_call = generated.EmulatedRegion.__call__

    def call(self, *inputs):
        ran.append(self.__name__)
        return real_call(self, *inputs)
    monkeypatch.setattr(generated.EmulatedRegion, "__call__", call)
    model = GeluMax()
    x = torch.randn(2, 3, 4, 4)
    xe, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    mine = copy.deepcopy(model)
    compiled = torch.compile(mine, backend="fxopt", options={"executor": "cuda", "emulate_kernels": True})
    torch.compiler.reset()
    out = compiled(xc)
    out.square().sum().backward()
    want = model(xe)
    want.square().sum().backward()
    assert any("amax" in n for n in ran) and len(ran) >= 4  # forward and backward regions
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(xc.grad, xe.grad)
    torch.testing.assert_close(mine.conv.weight.grad, model.conv.weight.grad)

    region = next(r for r in _regions(GeluMax().eval(), torch.randn(2, 3, 4, 4)) if "aten.amax.default" in r.ops)
    emu = generated.EmulatedRegion(region, lambda *a: declined.append(1) or ("reference",))
    b = region.kernel.inputs[0]
    fits = torch.randn(b.shape).as_strided(b.shape, b.strides) if len(set(b.strides)) == len(b.strides) else None
    other = torch.randn(tuple(reversed(b.shape))).permute(*reversed(range(len(b.shape))))  # other strides
    assert emu(other) == ("reference",) and declined == [1]
    if fits is not None:  # the first call also runs the reference once, for its outputs' dtypes
        assert isinstance(emu(fits)[0], torch.Tensor) and declined == [1, 1]
        assert isinstance(emu(fits)[0], torch.Tensor) and declined == [1, 1]


def test_emulated_regions_give_their_outputs_the_dtypes_of_the_cpus_kernels():
    """CPU fuzz fcaddfc67e: an affine InstanceNorm trained in float16; the CPU's meta gives its
    statistics float16, its kernels float32: emulated outputs take the reference's dtypes."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=2, bias=False), nn.InstanceNorm2d(4, affine=True))
    x = torch.randn(1, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    mine = copy.deepcopy(model)
    torch.compiler.reset()
    compiled = torch.compile(mine, backend="fxopt", options={"executor": "cuda", "emulate_kernels": True})
    with torch.autocast("cpu", dtype=torch.float16):
        out, want = compiled(x), model(x)
    out.float().square().sum().backward()
    want.float().square().sum().backward()
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    for (name, a), b in zip(mine.named_parameters(), model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=5e-2, atol=5e-2, msg=name)


def test_emulated_regions_give_their_outputs_the_strides_of_size_one_dims_the_cpus_kernels_give():
    """CPU fuzz 98f2d714a5: a one-channel value (|BatchNorm|) read by a one-channel 1x1 conv, trained in
    float16. The region's planned strides differ from the CPU kernel's only in the channel dimension
    (size 1: the same memory), but the CPU's float16 convolution backward reads them as another
    memory format and rounds the weight's gradient (a sum with much cancellation) otherwise: 0.85
    from float64 against eager's 0.09. Emulated outputs take the reference's strides there."""
    import contextlib
    import copy

    from fxopt.backends.cuda.schedule.generated import _strides_of_size_one_as

    class OneChannel(nn.Module):
        def __init__(self):
            super().__init__()
            self.m0 = nn.Conv2d(6, 6, 3, padding=1, groups=2, bias=False)
            self.m1 = nn.Conv2d(6, 1, 3, padding=1, bias=False)
            self.m2 = nn.BatchNorm2d(1)
            self.m3 = nn.Conv2d(1, 1, 1, bias=False)
            self.m4 = nn.BatchNorm2d(1)

        def forward(self, x):
            x = y = torch.abs(self.m2(self.m1(F.elu(self.m0(x)))))
            x = F.pad(x, (0, 0, 0, 1))
            x = F.softplus(self.m4(self.m3(x)) + x)
            return F.pad(x, (1, 2, 0, 0), mode="replicate"), y

    torch.manual_seed(0)
    model = OneChannel().train()
    for bn in (model.m2, model.m4):
        with torch.no_grad():
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.2, 0.2)
    x = torch.randn((8, 6, 12, 6), generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last)
    gen = torch.Generator().manual_seed(2)
    ws = [torch.randn((8, 1, 13, 9), generator=gen), torch.randn((8, 1, 12, 6), generator=gen)]

    def loss(outs):
        return sum((o.double() * w.double()).sum() for o, w in zip(outs, ws))

    def weight_grad(m, dtype=None):
        xin = x.double() if dtype is None else x
        with torch.autocast("cpu", dtype=torch.float16) if dtype else contextlib.nullcontext():
            out = m(xin)
        loss(out).backward()
        return m.m3.weight.grad.double().item()

    exact = weight_grad(copy.deepcopy(model).double())
    eager = weight_grad(copy.deepcopy(model), torch.float16)
    mine = copy.deepcopy(model)
    torch.compiler.reset()
    got = weight_grad(torch.compile(mine, backend="fxopt", options={"executor": "cuda", "emulate_kernels": True}),
                      torch.float16)
    assert abs(got - exact) <= 2 * abs(eager - exact) + 0.01, (got, eager, exact)

    t = torch.empty(2, 1, 3, 4).as_strided((2, 1, 3, 4), (12, 1, 4, 1))
    assert _strides_of_size_one_as(t, (12, 12, 4, 1)).stride() == (12, 12, 4, 1)
    assert _strides_of_size_one_as(t, (12, 12, 1, 3)) is t  # differs in a dimension of size 3: kept


def test_emulated_regions_compute_outputs_at_the_cpu_kernels_wider_dtype():
    """CPU fuzz d69f088fdc: an InstanceNorm over two values trained in float16. Traced on the CPU its
    statistics are planned in float16 (the CPU's meta), which the emulated kernel rounded before
    widening them to the CPU kernel's float32; the backward amplifies the saved mean's rounding (rstd
    74): a bias gradient 0.66 from float64 against eager's 0.003. They are computed in float32."""
    import copy

    class TwoValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.m0 = nn.Conv2d(1, 1, 1, stride=2, bias=False)
            self.m1 = nn.BatchNorm2d(1)
            with torch.no_grad():  # the fuzz's statistics, drawn before the later layers' weights
                self.m1.running_mean.uniform_(-0.5, 0.5)
                self.m1.running_var.uniform_(0.5, 1.5)
                self.m1.weight.uniform_(0.5, 1.5)
                self.m1.bias.uniform_(-0.2, 0.2)
            self.m2 = nn.InstanceNorm2d(1, affine=True)
            self.m3 = nn.Linear(2, 3)
            self.m4 = nn.Linear(3, 1)

        def forward(self, x):
            x = F.max_pool2d(self.m2(torch.abs(self.m1(self.m0(x)))), 1, 1, 0)
            return self.m4(F.relu(self.m3(torch.flatten(x, 1))))

    torch.manual_seed(268)
    model = TwoValues().train()
    x = torch.randn((1, 1, 1, 3), generator=torch.Generator().manual_seed(269))
    w = torch.randn((1, 1), generator=torch.Generator().manual_seed(270))

    def bias_grad(m, amp=True):
        with torch.autocast("cpu", dtype=torch.float16) if amp else contextlib.nullcontext():
            out = m(x.double() if not amp else x)
        (out.double() * w.double()).sum().backward()
        return m.m1.bias.grad.double().item()

    exact = bias_grad(copy.deepcopy(model).double(), amp=False)
    eager = bias_grad(copy.deepcopy(model))
    torch.compiler.reset()
    got = bias_grad(torch.compile(copy.deepcopy(model), backend="fxopt",
                                  options={"executor": "cuda", "emulate_kernels": True}))
    assert abs(got - exact) <= 2 * abs(eager - exact) + 0.01, (got, eager, exact)
