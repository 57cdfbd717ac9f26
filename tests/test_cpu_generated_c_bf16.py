"""A bfloat16 graph's convolutions and linear layers in the generated C as AVX-512 BF16 dot products
(backends/c_bf16.py): torch's bfloat16 semantics (inputs rounded to bfloat16, products summed in
float32) checked against a float32 computation of the same bfloat16 values to one rounding of the
output; the same source built for a target without the instruction computes in float32."""
from __future__ import annotations

import copy
import functools
import subprocess

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings

from fxopt.backends import c_build, cpu_c
from fxopt.backends.c_emit import Declined
from fxopt.backends.c_source import generate
from fxopt.testing.strategies import cnn_cases
from fxopt.tolerances import tolerance
from test_cpu_generated_c import Convs, aten_graph

pytestmark = pytest.mark.skipif(cpu_c.why_unavailable() is not None, reason=str(cpu_c.why_unavailable()))


@functools.lru_cache(maxsize=None)
def _target_has_bf16() -> bool:
    cc = c_build.compiler()
    r = subprocess.run([cc, *c_build.FLAGS[:3], "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True)
    return "__AVX512BF16__" in r.stdout


needs_bf16 = pytest.mark.skipif(not _target_has_bf16(), reason="the compiler's target has no AVX-512 BF16")


@pytest.fixture(autouse=True)
def _generated_c_on(monkeypatch):
    monkeypatch.setenv("FXOPT_CPU_GENERATED_C", "1")


def run(model: nn.Module, x: torch.Tensor, watch=False):
    """(runner, its outputs, the source) of the bfloat16 ``model`` at ``x``."""
    gm, args = aten_graph(model, x)
    runner = cpu_c.CRunner(gm, [i for i, a in enumerate(args) if a.data_ptr() != x.data_ptr()], watch=watch)
    out = runner(*args)
    return runner, list(out) if isinstance(out, (list, tuple)) else [out], generate(gm, args).source


def exact(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The bfloat16 model's values in float32 arithmetic (a copy of it in float32), rounded once."""
    m32 = copy.deepcopy(model).float()
    with torch.no_grad():
        return m32(x.float()).to(torch.bfloat16)


def assert_one_rounding(got: torch.Tensor, want: torch.Tensor):
    """Within one bfloat16 rounding (float32 sums in another order may round the other way)."""
    assert got.dtype == torch.bfloat16
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=scale * 2 ** -12)


@needs_bf16
@pytest.mark.parametrize("cin,cout,k,stride,padding,dilation,groups,size", [
    (3, 6, 5, 1, 0, 1, 1, 32),    # an odd channel count: the last pair's high half zero
    (16, 32, 3, 1, 1, 1, 1, 16),  # padding: masked taps
    (4, 12, 3, 1, 2, 2, 2, 11),   # dilation, groups of two channels
    (5, 7, (1, 3), (2, 1), (0, 1), 1, 1, 9),  # a row stride of 2, odd channels, rectangular kernel
    (10, 10, 3, 1, 1, 1, 5, 20),  # two channels a group, a row wider than a vector
])
def test_convolutions_sum_bfloat16_pairs(cin, cout, k, stride, padding, dilation, groups, size):
    torch.manual_seed(0)
    m = Convs(cin, cout, k, stride, padding, dilation, groups, nn.ReLU()).eval().to(torch.bfloat16)
    x = torch.randn(2, cin, size, size).to(torch.bfloat16)
    _, (got,), src = run(m, x)
    assert "bfloat16 pairs" in src and "_mm512_dpbf16_ps" in src
    assert_one_rounding(got, exact(m, x))


class Linears(nn.Module):
    def __init__(self, k):
        super().__init__()
        self.a, self.b = nn.Linear(k, 37), nn.Linear(37, 5, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@needs_bf16
@pytest.mark.parametrize("k", [7, 84, 2048])
def test_linear_layers_sum_bfloat16_pairs(k):
    """Rows padded to 32 with zeros (7, 84 inputs), a long row (2,048), a bias and none."""
    torch.manual_seed(0)
    m = Linears(k).eval().to(torch.bfloat16)
    x = torch.randn(3, k).to(torch.bfloat16)
    _, (got,), src = run(m, x)
    assert src.count("rows as bfloat16") == 2
    # the second layer's input rounded to bfloat16, as torch's bfloat16 layer has it
    h = torch.relu(x.float() @ m.a.weight.float().T + m.a.bias.float()).to(torch.bfloat16).float()
    assert_one_rounding(got, (h @ m.b.weight.float().T).to(torch.bfloat16))


def test_without_the_instruction_the_same_source_computes_in_float32(monkeypatch):
    """Built for a target without AVX-512 BF16: the ``#else`` branches, float32 sums of the widened
    values (no rounding of the convolution's input), within bfloat16's tolerance of float32 eager."""
    from fxopt.testing import SeedCNN2

    torch.manual_seed(0)
    m = SeedCNN2().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = m(x)
    mb, xb = m.to(torch.bfloat16), x.to(torch.bfloat16)
    monkeypatch.setattr(c_build, "FLAGS", c_build.FLAGS + ("-mno-avx512bf16",))
    _, (plain,), src = run(mb, xb)
    assert "#ifdef __AVX512BF16__" in src
    err = ((plain.float() - want).abs().max() / want.abs().max()).item()
    assert err <= tolerance(torch.bfloat16)[0]
    assert_one_rounding(plain, exact(mb, xb))  # float32 sums of the bfloat16 values, rounded once


@needs_bf16
def test_weights_laid_out_again_as_pairs():
    """A watched bfloat16 weight changed in place: its pairs are laid out again at the next call."""
    torch.manual_seed(0)
    m = Convs(16, 32, 3, 1, 1, 1, 1, nn.ReLU()).eval().to(torch.bfloat16)
    x = torch.randn(1, 16, 16, 16).to(torch.bfloat16)
    gm, args = aten_graph(m, x)
    runner = cpu_c.CRunner(gm, [i for i, a in enumerate(args) if a.data_ptr() != x.data_ptr()], watch=True)
    assert_one_rounding(runner(*args)[0], exact(m, x))
    weight = next(a for a in args if a.shape == m.conv.weight.shape)
    with torch.no_grad():
        weight.mul_(-0.5)
        m.conv.weight.copy_(weight)
    assert_one_rounding(runner(*args)[0], exact(m, x))


@needs_bf16
@settings(deadline=None, max_examples=10)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), max_layers=4))
def test_random_bfloat16_cnns_within_tolerance_or_decline(case):
    """Random CNNs in bfloat16: within bfloat16's tolerance of float32 eager, and no further from it
    than eager bfloat16 is (plus a rounding), or declined with a reason."""
    model = case.model.eval()
    x = case.inputs[0]
    with torch.no_grad():
        want = model(x)
    mb, xb = model.to(torch.bfloat16), x.to(torch.bfloat16)
    try:
        _, got, _ = run(mb, xb)
    except Declined as e:
        assert str(e)
        return
    with torch.no_grad():
        eager = mb(xb)
    want = list(want) if isinstance(want, (list, tuple)) else [want]
    eager = list(eager) if isinstance(eager, (list, tuple)) else [eager]
    for g, w, e in zip(got, want, eager):
        scale = w.abs().max().item() or 1.0
        err = (g.float() - w).abs().max().item() / scale
        assert err <= max(tolerance(torch.bfloat16)[0], 2 * (e.float() - w).abs().max().item() / scale + 8e-3)


@needs_bf16
def test_autocast_graph_lays_its_weights_out_once():
    """Under bfloat16 autocast the weights reach the convolution and the linear layers through casts of
    float32 parameters: laid out as pairs at a call that lays weights out, not at every call; within
    bfloat16's tolerance of float32 eager."""
    from fxopt.testing import SeedCNN2

    torch.manual_seed(0)
    m = SeedCNN2().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = m(x)
    with torch.autocast("cpu", torch.bfloat16):
        gm, args = aten_graph(m, x)
    params = [i for i, a in enumerate(args) if a.data_ptr() != x.data_ptr()]
    src = generate(gm, args, params).source
    prepare, every_call = src.split("  if (P) {", 1)[1].split("  if (nt > 1)", 1)[0].split("\n  }\n", 1)
    assert prepare.count("wq[") == 4 and "wq[" not in every_call  # two convolutions, two linear layers
    (got,) = cpu_c.CRunner(gm, params, watch=False)(*args)
    assert ((got.float() - want).abs().max() / want.abs().max()).item() <= tolerance(torch.bfloat16)[0]
