"""The fuzzer's float64 references (``fxopt.fuzz.references``): where they run, and how far the
rounded runs say a 16-bit training step's values may move."""
import pytest
import torch

from fxopt.fuzz import check as fuzz_check
from fxopt.fuzz import references as fuzz_refs
from fxopt.fuzz.graphs import Program, render


def _bias_before_bn(dtype: str, batch: int = 16) -> Program:
    init = ["self.m0 = nn.Conv2d(3, 4, 1)", "self.m1 = nn.BatchNorm2d(4)"]
    return Program(render(init, ["x = torch.tanh(self.m1(self.m0(x)))"], "x"), (batch, 3, 6, 5), dtype,
                   "contiguous", "training", 11, {"executor": "torch"}, ["t"])


def _loss(outs, ref=False):
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(outs.shape, generator=gen, dtype=torch.float64).to(outs.device)
    return ((outs.double() if ref else outs.float()) * w.to(outs.dtype if not ref else torch.float64)).sum()


def test_rounded_runs_round_the_backward_too():
    """A convolution's bias gradient before a training BatchNorm is 0 exactly: a sum of the
    BatchNorm's input gradient, which cancels. A 16-bit backward writes each of those terms rounded,
    so every implementation's sum is noise of the terms' size (GPU fuzz 6e42ecd3e1). The perturbed
    runs round every gradient the backward computes as well, so their spread has that size (rounding
    the forward alone leaves the exact BatchNorm backward's terms cancelling, to 1e-14)."""
    prog = _bias_before_bn("bfloat16")
    model, x = fuzz_check.build(prog, "cpu")
    ref = fuzz_refs.Reference64(model, x, prog)
    exact = ref.grad("m0.bias", _loss)
    assert float(exact.abs().max()) < 1e-10
    perturbed = [r for r in ref.rounded.refs if r.perturb]
    assert len(perturbed) == fuzz_refs.PERTURBED_SAMPLES
    spreads = [float((r.grad("m0.bias", _loss) - exact).abs().max()) for r in perturbed]
    # the terms: the gradient reaching the convolution's output, per channel
    m = ref.model
    xr = x.detach().double().requires_grad_(True)
    y = m.m0(xr)
    y.retain_grad()
    _loss(torch.tanh(m.m1(y)), True).backward()
    terms = y.grad.abs()
    u = fuzz_refs.unit_roundoff(torch.bfloat16, "cpu")
    worst = float(u * terms.sum((0, 2, 3)).max())  # every rounding error of one sign
    typical = float(u * terms.pow(2).sum((0, 2, 3)).sqrt().max())  # a random walk of them
    assert all(s < worst for s in spreads)
    assert max(spreads) > 0.5 * typical, (spreads, typical)  # measured: 1.0-1.5x on this program


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_float64_reference_runs_on_the_cpu():
    """A CUDA kernel wrong in eager's layout would be as wrong in float64 on the GPU (GPU fuzz
    68a548ca2f): the reference is the CPU's."""
    prog = _bias_before_bn("float32", batch=2)
    model, x = fuzz_check.build(prog, "cuda")
    ref = fuzz_refs.Reference64(model, x, prog)
    assert ref.out().device.type == "cpu" and ref.grad("m0.weight", _loss).device.type == "cpu"
    assert next(model.parameters()).device.type == "cuda"  # the model itself is left where it was


def test_a_cancelled_value_is_judged_by_the_size_of_its_noise():
    """Where float64's value is 0 (at most ``CANCELLED`` of the noise), fxopt's error may be up to
    ``NOISE_FACTOR`` times the largest sample; anywhere else twice, as before; and not beyond."""
    from fxopt.fuzz.check import NOISE_FACTOR, Mismatch, compare

    eager = torch.tensor([0.1, -0.05])
    zero = torch.tensor([1e-15, -2e-15], dtype=torch.float64)
    compare("b.grad", torch.tensor([0.4, 0.1]), eager, lambda: zero, 1e-3, 1e-3)  # 4x eager's noise
    with pytest.raises(Mismatch, match=r"exactly 0 in float64: up to 8x"):
        compare("b.grad", torch.tensor([0.1 * NOISE_FACTOR + 0.01, 0.0]), eager, lambda: zero, 1e-3, 1e-3)
    nonzero = torch.tensor([0.2, -0.05], dtype=torch.float64)  # the same differences where it is not 0
    with pytest.raises(Mismatch, match=r"error vs float64 0.3, eager.s 0.1 \(atol"):
        compare("b.grad", torch.tensor([0.5, -0.05]), torch.tensor([0.3, -0.05]), lambda: nonzero, 1e-3, 1e-3)
