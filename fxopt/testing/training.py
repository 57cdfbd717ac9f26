"""The reference training loop, and loss curves compared against eager's.

The loop every training measurement and test of fxopt uses (the benchmark ``fxopt bench --train``,
the data-parallel launcher ``fxopt.bench.ddp`` and the tests), so that a loss curve measured on one
backend compares with another's step for step::

    from fxopt.testing.training import TrainLoop, make_batches, max_rel_diff

    batches = make_batches(4, 32, (3, 32, 32), classes=10, device="cpu")
    loop = TrainLoop(torch.compile(model, backend="fxopt"), model.parameters(), "cpu", amp=torch.bfloat16)
    losses = [loop.step(*batches[i % len(batches)]) for i in range(20)]

One step: ``zero_grad``; forward and cross-entropy under ``torch.autocast(device, amp)`` (no autocast
with ``amp=None``: float32); backward; Adam. With ``amp=torch.float16`` a ``torch.amp.GradScaler``
scales the loss and skips steps whose gradients overflow (``scaler.step`` + ``scaler.update``);
bfloat16 has float32's exponent range and trains without one. ``step`` returns the loss as a
detached tensor (no host synchronisation: read the values after the steps to be timed).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Iterable, Optional

import torch
import torch.nn.functional as F

#: names for the loop's precision (command lines, reports)
AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "none": None}

#: max relative difference of a backend's first 20 losses from eager's, by autocast dtype. Rounding
#: differences (another summation order, a fused kernel) are amplified by each optimizer step; these
#: bounds hold the loss curve to the dtype's own precision (float32: ~1e-6 per op on the CPU; on CUDA
#: convolutions and matrix products run in TF32 as in eager).
LOSS_TOLERANCE = {None: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}

#: final loss (after a few hundred steps of a ``LearningTask``) within this relative distance of eager's
FINAL_LOSS_TOLERANCE = 0.05
#: the final loss: the mean over this many last steps (as many fresh batches; trainings that
#: differ by rounding reach nearby but not equal weights, whose loss on one batch differs more)
FINAL_LOSS_STEPS = 50

#: one rounding of the loop's precision (unit roundoff), by autocast dtype: the size of the
#: perturbation ``TrainLoop(grad_noise=...)`` gives the rounding references of the benchmarks
UNIT_ROUNDOFF = {None: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def amp_name(amp: Optional[torch.dtype]) -> str:
    return "none" if amp is None else str(amp).replace("torch.", "")


class TrainLoop:
    """The reference loop over ``model`` (eager or compiled; ``params`` are what Adam updates).

    ``grad_noise=(eps, seed)`` multiplies every gradient, before the optimizer step, by
    ``1 + eps * u`` with ``u`` uniform in [-1, 1] from a generator seeded with ``seed`` (the same
    numbers on every data-parallel rank: replicas stay equal): another implementation's rounding,
    at every step, for runs of eager that set how far rounding alone moves a loss curve (the
    benchmarks' rounding references)."""

    def __init__(self, model, params: Iterable[torch.nn.Parameter], device: str,
                 amp: Optional[torch.dtype] = torch.float16, lr: float = 1e-3, scaler: Optional[bool] = None,
                 grad_noise: Optional[tuple[float, int]] = None):
        if amp not in AMP_DTYPES.values():
            raise ValueError(f"amp must be one of {list(AMP_DTYPES)}, got {amp!r}")
        self.model, self.device, self.amp = model, device, amp
        self.params = list(params)
        self.optimizer = torch.optim.Adam(self.params, lr=lr)
        use_scaler = amp == torch.float16 if scaler is None else scaler
        self.scaler = torch.amp.GradScaler(device) if use_scaler else None
        self.grad_noise = None
        self.mark = None
        if grad_noise is not None:
            eps, seed = grad_noise
            dev = self.params[0].device if self.params else torch.device(device)
            self.grad_noise = (float(eps), torch.Generator(device=dev).manual_seed(int(seed)))

    def _perturb_gradients(self) -> None:
        eps, gen = self.grad_noise
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    u = torch.rand(p.grad.shape, generator=gen, device=p.grad.device, dtype=torch.float32)
                    p.grad.mul_(u.mul_(2 * eps).add_(1 - eps).to(p.grad.dtype))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step on the batch ``(x, y)``; returns the loss (detached, float32).
        ``self.mark``, where set (a benchmark's phase timer), is called with ``"start"``,
        ``"forward"``, ``"backward"`` and ``"optimizer"`` as the step reaches each point."""
        mark = self.mark
        if mark is not None:
            mark("start")
        self.optimizer.zero_grad(set_to_none=True)
        amp = torch.autocast(self.device, dtype=self.amp) if self.amp is not None else contextlib.nullcontext()
        with amp:
            loss = F.cross_entropy(self.model(x), y)
        if mark is not None:
            mark("forward")
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if mark is not None:
            mark("backward")
        if self.grad_noise is not None:
            self._perturb_gradients()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if mark is not None:
            mark("optimizer")
        return loss.detach().float()


def make_batches(n: int, batch: int, shape: Sequence[int], classes: int, device: str = "cpu",
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` seeded batches ``(x, y)``: float32 inputs of shape ``(batch, *shape)`` (autocast casts
    them) and class labels in ``[0, classes)``; the loop cycles through them."""
    gen = torch.Generator().manual_seed(seed + 4242)
    return [(torch.randn((batch, *shape), generator=gen).to(device),
             torch.randint(0, classes, (batch,), generator=gen).to(device)) for _ in range(n)]


class LearningTask(Sequence):
    """Batches of a task a CNN learns and cannot memorize, for loss curves that converge: batch ``i``
    is drawn afresh (seeded by ``seed`` and ``i``, on ``device``): every sample gets a random
    per-channel offset (a colour cast) on unit Gaussian noise, and its label is the class (of the
    first ``min(classes, task_classes)``) whose fixed random direction has the largest dot product
    with the offset. The loss falls from ln(classes) as the model learns the rule and levels off
    above zero (near-ties between classes stay), so a final loss compares how far two trainings got,
    not how two memorizations of a few batches round (their loss ends near 4e-4, where rounding alone
    moves the relative difference by several percent). ``len`` is ``steps``."""

    def __init__(self, steps: int, batch: int, shape: Sequence[int], classes: int, device: str = "cpu",
                 seed: int = 0, task_classes: int = 10):
        gen = torch.Generator().manual_seed(seed + 777)
        self.steps, self.batch, self.shape, self.device, self.seed = steps, batch, tuple(shape), device, seed
        self.teacher = torch.randn(shape[0], min(classes, task_classes), generator=gen).to(device)

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.steps:
            raise IndexError(i)
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + i)
        cast = torch.randn((self.batch, self.shape[0]) + (1,) * (len(self.shape) - 1), generator=gen,
                           device=self.device)
        x = torch.randn((self.batch, *self.shape), generator=gen, device=self.device) + cast
        return x, (cast.flatten(1) @ self.teacher).argmax(1)


def run_steps(loop: TrainLoop, batches: Sequence, steps: int, start: int = 0,
              seed: Optional[int] = None) -> list[torch.Tensor]:
    """``steps`` steps of ``loop``, step ``i`` on ``batches[i % len(batches)]`` (``i`` from
    ``start``); the losses as detached tensors. With ``seed``, step ``i`` starts from
    ``torch.manual_seed(seed + i)``: the random ops of the model (dropout) draw the same numbers at
    step ``i`` whatever ran before it, so loss curves of backends trained in turns compare."""
    losses = []
    for i in range(start, start + steps):
        if seed is not None:
            torch.manual_seed(seed + i)
        losses.append(loop.step(*batches[i % len(batches)]))
    return losses


def max_rel_diff(losses: Sequence[float], reference: Sequence[float]) -> float:
    """max over steps of |loss - reference| / |reference| (inf where a loss is not finite and the
    reference's is)."""
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses against {len(reference)}")
    worst = 0.0
    for a, b in zip(map(float, losses), map(float, reference)):
        if a != a or b != b:  # NaN: equal only to a NaN
            worst = max(worst, 0.0 if (a != a and b != b) else float("inf"))
            continue
        worst = max(worst, abs(a - b) / abs(b) if b else abs(a))
    return worst
