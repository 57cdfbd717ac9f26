"""A fused kernel rounds every 16-bit value it computes inline to its dtype, as eager rounds each
op's result (CPU only; ``backends/cuda/schedule/build.py``).

GPU fuzz 649729573e (seed 61, float16 inference on ``[1, 1, 1, 2]``): ``x = abs(conv(x));
x = x - x.mean((1,), keepdim=True); InstanceNorm(x)``. Over one channel the mean is the value
itself, so eager subtracts two equal float16 numbers and normalizes zeros: 0. fxopt stored the
mean rounded to float16 (its node's dtype) but recomputed ``abs(conv + bias)`` inline in float32,
unrounded, in the InstanceNorm's kernel: the difference was the value's rounding error, which the
normalization scaled up (0.00965 from eager on the H200, +-0.15 here with chosen values).
``check_fusion`` did not see it: its float32 fallback reference is fed the region's float16
inputs, the rounded mean among them, and so reproduced the kernel's error.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fxopt.backends.cuda import ir
from fxopt.testing.fusion import evaluate_regions


def _regions(model, inputs):
    return evaluate_regions(model, inputs)


class _MeanThenNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.InstanceNorm2d(1)

    def forward(self, x, y):
        x = torch.abs(x + y)
        x = x - x.mean((1,), keepdim=True)
        return self.norm(x)


def test_a_value_and_its_stored_mean_round_alike():
    """649729573e's pattern on chosen values: ``x + y`` is not a float16 number (1 + 2^-11 rounds to
    1), so the value unrounded minus its rounded mean was 2^-11 and the InstanceNorm made it
    +-0.15; rounded as eager rounds it, the difference is 0 and so is the output."""
    x = torch.tensor([1.0, 3.0]).view(1, 1, 1, 2).half()
    y = torch.tensor([2.0**-11, 3 * 2.0**-11]).view(1, 1, 1, 2).half()
    wide = x.float() + y.float()
    assert not torch.equal(wide.half().float(), wide)  # the values make the rounding matter
    model = _MeanThenNorm().half().eval()
    with torch.no_grad():
        assert torch.equal(model(x, y), torch.zeros_like(x))
    regions = _regions(model, (x, y))
    norm = [r for r in regions if any("batch_norm" in op for op in r[0].ops)]
    assert norm and any("aten.abs.default" in op for op in norm[0][0].ops)  # abs(x + y) recomputed there
    for region, got, want in regions:
        for g, w in zip(got, want):
            assert torch.equal(g, w), (region.name, g, w)


def test_the_rounding_is_a_cast_only_where_a_value_can_leave_its_dtype():
    """A 16-bit sum is rounded (``Cast``); a load of a 16-bit input, its negation, magnitude, max,
    a selection between such values and a constant that is a float16 number are not wrapped."""
    from fxopt.backends.cuda.schedule.build import rounded

    bufs = [ir.Buffer("a", (4,), (1,), torch.float16), ir.Buffer("b", (4,), (1,), torch.float32)]
    a, b = ir.Load(0, ir.Ix()), ir.Load(1, ir.Ix())
    h = torch.float16
    assert rounded(ir.op("add", a, a), h, bufs) == ir.Cast(ir.op("add", a, a), h)
    assert rounded(b, h, bufs) == ir.Cast(b, h)
    for e in (a, ir.op("abs", a), ir.op("neg", a), ir.op("maximum", a, ir.op("relu", a)),
              ir.Where(ir.op("gt", a, 0.0), a, ir.Const(0.5)), ir.Cast(b, h)):
        assert rounded(e, h, bufs) is e
    assert rounded(ir.Const(0.1), h, bufs) == ir.Const(float(torch.tensor(0.1).half()))
    assert rounded(ir.op("add", a, a), torch.bfloat16, bufs) == ir.Cast(ir.op("add", a, a), torch.bfloat16)


_OPS = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "scale": lambda a, b: a * 0.3, "abs": lambda a, b: torch.abs(a), "relu": lambda a, b: torch.relu(a),
    "max": lambda a, b: torch.maximum(a, b), "neg": lambda a, b: -a,
}


class _Chain(nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def forward(self, x, y):
        for name in self.ops:
            x = _OPS[name](x, y)
        return x - x.mean((1,), keepdim=True), x.sum((2, 3))


@settings(max_examples=25, deadline=None, database=None)
@given(ops=st.lists(st.sampled_from(sorted(_OPS)), min_size=1, max_size=5),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_fused_16_bit_chains_equal_eagers_ops_bitwise(ops, dtype, seed):
    """A chain of exactly rounded 16-bit ops (each float32 result rounded once, as eager's kernels
    compute them) fused into pointwise and reduction kernels gives eager's bits; a reduction's sum
    may differ in its float32 order only (within the dtype's rounding)."""
    g = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(2, 1, 3, 4, generator=g).to(dtype) for _ in range(2))
    model = _Chain(ops).eval()
    for region, got, want in _regions(model, (x, y)):
        for gt, w in zip(got, want):
            if "aten.sum.dim_IntList" in region.ops:
                torch.testing.assert_close(gt, w, rtol=2e-2, atol=2e-2)
            else:
                assert torch.equal(gt, w), (ops, region.name, region.ops, gt, w)


class _ScaledMeans(nn.Module):
    def forward(self, x):
        y = x * 0.3 + 0.1
        return y.mean((0, 2, 3), keepdim=True), y.sum((2, 3))


def test_the_column_emulator_rounds_where_the_ir_rounds():
    """``fxopt.fuzz.simt`` runs a column reduction's C thread by thread against its IR: the IR's
    16-bit roundings (``fx_to_f32(fx_from<T>(v))``) round in the emulator too (a store's does not:
    the IR's reference outputs are float64), or every such kernel would differ by a rounding."""
    from fxopt.fuzz.backend_api import reduction_sources
    from fxopt.fuzz.simt import check_column_geometry, is_column_kernel
    from fxopt.testing import check_fusion
    from fxopt.testing.strategies import CNNCase

    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(8, 16, 5, 7).to(dtype).contiguous(memory_format=torch.channels_last)
        checked = 0
        for sched in check_fusion(CNNCase(_ScaledMeans().eval(), (x,), dtype, False, []), {}):
            for region in sched.regions:
                for ks in reduction_sources(region.kernel, False) if hasattr(region.kernel, "reduced") else []:
                    if is_column_kernel(ks):
                        assert "fx_to_f32(fx_from<" in ks.source
                        check_column_geometry(ks, high=4, rtol=1e-4, atol=1e-4)
                        checked += 1
        assert checked >= 2


class _SigmoidInstanceNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 3, padding=1, bias=False)
        self.norm = nn.InstanceNorm2d(1)

    def forward(self, x):
        return self.norm(torch.sigmoid(self.conv(x)))


def test_an_ill_conditioned_region_is_judged_by_its_ops_rounded_as_eager_rounds(monkeypatch):
    """An InstanceNorm of four close float16 values (CPU fuzz, seed 191): eager's float16 CPU kernel
    is 0.004 off the exact result of its own ops and the float32 ops 0.007 (they skip the rounding of
    the sigmoid it normalizes), the kernel exact: the region check accepts it against the ops each
    computed in float64 and rounded to its dtype, and still refuses a kernel off by as much."""
    from fxopt.testing import CNNCase
    from fxopt.testing.fusion import check_fusion

    torch.manual_seed(0)
    model = _SigmoidInstanceNorm().half().eval()
    x = torch.randn([1, 1, 1, 4], generator=torch.Generator().manual_seed(1)).half()
    with torch.no_grad():
        s = torch.sigmoid(model.conv(x)).double()
        exact = ((s - s.mean()) / ((s - s.mean()).pow(2).mean() + 1e-5).sqrt())
        assert (model(x).double() - exact).abs().max() > 2e-3  # eager's own kernel misses it
    case = lambda: CNNCase(model, (x,), torch.float16, False, ["conv-sigmoid", "instancenorm"])  # noqa: E731
    regions = [r for sched in check_fusion(case(), {"autotune_cache": False}) for r in sched.regions]
    assert any("_native_batch_norm_legit" in str(r.ops) for r in regions), [r.ops for r in regions]
    evaluate = ir.evaluate

    def off(k, ins, outs):
        evaluate(k, ins, outs)
        for o in outs:
            if o.dtype == torch.float16 and o.numel() == 4:
                o.add_(0.006)

    monkeypatch.setattr(ir, "evaluate", off)
    with pytest.raises(AssertionError, match="rounded to its dtype"):
        for _ in check_fusion(case(), {"autotune_cache": False}):
            pass


class _GatedSigmoidInstanceNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 4, 3, padding=1), nn.InstanceNorm2d(4)

    def forward(self, x):
        return self.norm(torch.sigmoid(self.conv(x * torch.sigmoid(x.mean((1,), keepdim=True)))))


def test_a_rounding_boundary_scaled_by_a_normalization_is_judged_by_the_ops_in_float32():
    """CPU fuzz 3711c98f78: a sigmoid of a conv (with its bias, in the region's float32) lands within
    float32's error of a float16 rounding boundary and rounds the other way than in float64; the
    InstanceNorm over 55 values near 1 scales that ulp to 0.0035, beyond the tolerance. The region
    check takes the ops each computed in float32 and rounded (the kernel's arithmetic, the same
    roundings) where the float64 ones differ, and refuses a kernel off by as much either way."""
    from fxopt.testing import CNNCase
    from fxopt.testing.fusion import check_fusion

    torch.manual_seed(0)
    model = _GatedSigmoidInstanceNorm().half().eval()
    x = torch.randn([1, 4, 5, 11], generator=torch.Generator().manual_seed(1)).half()
    case = lambda: CNNCase(model, (x,), torch.float16, False, ["gate", "conv-sigmoid", "instancenorm"])  # noqa: E731
    regions = [r for sched in check_fusion(case(), {"autotune_cache": False}) for r in sched.regions]
    assert any("_native_batch_norm_legit" in str(r.ops) for r in regions), [r.ops for r in regions]


def test_the_float32_reference_rounds_every_op_as_the_float64_one_does(monkeypatch):
    """Off by 0.0035 where the float64 and float32 references agree: refused (the kernel above is
    accepted for matching the float32 one, not for a wider tolerance)."""
    from fxopt.testing import CNNCase
    from fxopt.testing.fusion import check_fusion

    torch.manual_seed(0)
    model = _GatedSigmoidInstanceNorm().half().eval()
    x = torch.randn([1, 4, 5, 11], generator=torch.Generator().manual_seed(1)).half()
    evaluate = ir.evaluate

    def off(k, ins, outs):
        evaluate(k, ins, outs)
        for o in outs:
            if o.dtype == torch.float16 and o.numel() == 220:
                o.view(-1)[7] += 0.004 + 0.011 * o.view(-1)[7].abs()

    monkeypatch.setattr(ir, "evaluate", off)
    with pytest.raises(AssertionError, match="rounded to its dtype"):
        for _ in check_fusion(CNNCase(model, (x,), torch.float16, False, []), {"autotune_cache": False}):
            pass


class _PooledHardsigmoidNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.c0 = nn.Conv2d(1, 1, 1, bias=False)
        self.c1 = nn.Conv2d(1, 1, 3, padding=1, bias=False)
        self.norm = nn.InstanceNorm2d(1)

    def forward(self, x):
        x = torch.abs(self.c0(F.max_pool2d(x, 3, 1)))
        return self.norm(F.hardsigmoid(self.c1(x))), x


@pytest.mark.parametrize("off", [0.0, 2e-4])
def test_an_ill_conditioned_float32_region_is_no_worse_than_eager_against_its_exact_ops(monkeypatch, off):
    """An InstanceNorm of four close float32 values (CPU fuzz 918fc985d9): float32 roundings alone put
    the kernel 1.8e-5 from eager (tolerance 1e-5); the region check accepts an error against the ops
    each computed in float64 of at most twice eager's own plus the tolerance, and refuses more."""
    from fxopt.testing import CNNCase
    from fxopt.testing.fusion import check_fusion

    torch.manual_seed(0)
    model = _PooledHardsigmoidNorm().eval()
    x = torch.randn([1, 1, 4, 4], generator=torch.Generator().manual_seed(1))
    evaluate = ir.evaluate

    def shifted(k, ins, outs):
        evaluate(k, ins, outs)
        for o in outs:
            if "native_batch_norm" in k.name and o.numel() == 4:
                o.add_(off)

    monkeypatch.setattr(ir, "evaluate", shifted)
    case = CNNCase(model, (x,), torch.float32, False, ["pool", "conv-abs", "conv-hardsigmoid", "instancenorm"])
    if off:
        with pytest.raises(AssertionError, match="float64"):
            list(check_fusion(case, {"autotune_cache": False}))
    else:
        regions = [r for sched in check_fusion(case, {"autotune_cache": False}) for r in sched.regions]
        assert any("_native_batch_norm_legit" in str(r.ops) for r in regions)
