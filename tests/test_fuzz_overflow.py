"""The fuzzer's judgement of a 16-bit training step whose eager backward overflowed (GPU fuzz
60928602b9): a BatchNorm over a channel that a dilated depthwise conv left constant (its taps read
only padding) divides by sqrt(eps), the float16 gradient leaves the range, and the conv's weight
gradient is then ``inf * 0``: NaN in one implementation, 0 in another, 0 in float64. Differing
gradients there are recorded (``outcome["eager_overflow"]``), not a failure; without eager's
overflow the same difference is a Mismatch."""
import copy

import pytest
import torch

from fxopt.fuzz import Program
from fxopt.fuzz import check as fuzz_check
from fxopt.fuzz.graphs import render
from fxopt.fuzz.references import Reference64

_BN = "_random_stats(self.m{})"
OVERFLOWS = render(
    ["self.m0 = nn.Conv2d(8, 8, 2, stride=1, padding='same', dilation=2, groups=8, bias=False)",
     "self.m1 = nn.BatchNorm2d(8)", _BN.format(1), "self.m2 = nn.Conv2d(8, 8, 1, padding=0, bias=False)",
     "self.m3 = nn.BatchNorm2d(8)", _BN.format(3)],
    ["x = torch.abs(self.m1(self.m0(x)))", "y = x", "x = torch.abs(self.m3(self.m2(x)) + x)"], "x, y")
BENIGN = render(["self.m0 = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)"], ["x = torch.abs(self.m0(x))"], "x")


def _step(source: str, shape, poison: bool):
    """One fp16 training step on the CPU, eager against a copy whose conv weight gradient a hook
    makes NaN (an implementation that computes ``inf * 0``), eager's made finite where NaN (one
    that skips the padding's taps, as eager's on the GPU); returns the outcome."""
    program = Program(source, shape, "float16", "contiguous", "training", 0, {}, ["test"])
    eager, x = fuzz_check.build(program, "cpu")
    mine, spare = copy.deepcopy(eager), copy.deepcopy(eager)  # spare: eager as it comes (run_program's)
    eager.m0.weight.register_hook(lambda g: g.nan_to_num(0.0))
    if poison:
        mine.m0.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    outcome = {}
    fuzz_check._training_step(program, "cpu", eager, mine, mine, x, [], Reference64(eager, x, program),
                              spare, outcome, None)
    return outcome


def test_overflow_watch_names_the_op_that_left_the_range():
    program = Program(OVERFLOWS, (1, 8, 1, 5), "float16", "contiguous", "training", 0, {}, ["test"])
    model, x = fuzz_check.build(program, "cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x.requires_grad_(True))
    watch = fuzz_check._Overflow()
    gen = torch.Generator().manual_seed(2)
    with watch:
        sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in out).backward()
    assert watch.first is not None and "batch_norm_backward" in watch.first


def test_differing_gradients_after_eager_overflowed_are_recorded_not_failed():
    outcome = _step(OVERFLOWS, (1, 8, 1, 5), poison=True)
    assert "batch_norm_backward" in outcome.get("eager_overflow", "")


def test_differing_gradients_without_eager_overflow_fail():
    with pytest.raises(fuzz_check.Mismatch, match="m0.weight.grad"):
        _step(BENIGN, (1, 8, 4, 5), poison=True)
    assert "eager_overflow" not in _step(BENIGN, (1, 8, 4, 5), poison=False)
