"""Normalizations over a row of equal values give exactly 0, as eager's CUDA (Welford) statistics do.

A row's mean was its sum times ``float32(1 / r)``: for seven values of -1.5 that is -1.5000001, and
its deviation of 1.2e-7, scaled by ``rsqrt(eps)``, came out as 3.8e-5 where eager gives 0 (a float32
training graph of the GPU fuzzer: conv, abs, a row padded with -1.5, LayerNorm over 7 channels,
within atol 1e-5 of nothing). The kernels' IR runs here by ``ir.evaluate``, in float32 as the
generated C computes. The rows here sum exactly in float32 (a padded row of -1.5 or 0, the
fuzzer's pad values); a row of 0.1s sums with rounding, and its deviations are that rounding, as on
the CPU in eager.
"""
import pytest
import torch
import torch.nn as nn

from fxopt.backends.cuda.compiler import compile_ptx, nvrtc_available
from fxopt.backends.cuda.kernels.region import generate_kernel
from fxopt.testing.fusion import evaluate_regions


class Norm(nn.Module):
    def __init__(self, c: int, kind: str):
        super().__init__()
        self.kind = kind
        self.ln = nn.LayerNorm(c, elementwise_affine=False)
        self.gn = nn.GroupNorm(1, c, affine=False)
        self.inorm = nn.InstanceNorm2d(c)

    def forward(self, x):
        x = x * 1.0  # a graph op before the statistics, fused with them
        if self.kind == "layer":
            return self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        if self.kind == "group":
            return self.gn(x)
        if self.kind == "instance":
            return self.inorm(x)
        return x.var(dim=1, keepdim=True, correction=0)


def _kernel_outputs(model, x):
    """Every generated kernel's outputs as ``ir.evaluate`` computes them, by region ops."""
    return [(region.ops, got) for region, got, _ in evaluate_regions(model, (x,), {"executor": "cuda"})]


@pytest.mark.parametrize("kind", ["layer", "group", "instance", "var"])
@pytest.mark.parametrize("c,value", [(7, -1.5), (3, 0.25), (11, 3.0)])
def test_a_constant_row_normalizes_to_exactly_zero(kind, c, value):
    x = torch.full((2, c, 3, 2), value)
    found = _kernel_outputs(Norm(c, kind).eval(), x)
    assert found, "no generated kernel"
    for ops, outs in found:
        main = outs[0]  # the normalized values (var: the variance itself)
        assert main.abs().max().item() == 0.0, (ops, main.abs().max().item())



class GatedNorm(nn.Module):
    """A product normalized over one channel: ``x * y - mean(x * y)`` is 0 exactly, the product
    recomputed after its sum (GPU fuzz 696d585eed: a gate, LayerNorm over one channel)."""

    def forward(self, x):
        g = x * x.mean((1,), keepdim=True)
        return nn.functional.layer_norm(g.permute(0, 2, 3, 1), (g.shape[1],)).permute(0, 3, 1, 2)


@pytest.mark.skipif(not nvrtc_available(), reason="needs NVRTC")
def test_a_recomputed_product_is_rounded_as_written_no_fused_multiply_add():
    """The generated code rounds each sum, difference and product as the IR does: no product is
    contracted into an FMA with the sum it feeds or with its difference from its own mean (the
    contracted form subtracted a rounded mean from an unrounded product: 1 ulp, scaled by
    ``rsqrt(eps)``, 1.8e-5 on the GPU where eager and the IR give 0)."""
    found = [(r, got) for r, got, _ in evaluate_regions(GatedNorm(), (torch.randn(2, 1, 3, 4),), {"executor": "cuda"})
             if "aten.native_layer_norm.default" in r.ops]
    assert found, "no generated normalization"
    for region, (normalized, *_) in found:
        assert normalized.abs().max().item() == 0.0  # the IR: exactly 0
        ks = generate_kernel(region.kernel)
        ptx = compile_ptx(ks.source, ks.name)
        assert "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx, ks.source
