"""The references a fuzz program's values are judged against (``check.compare``): the model in
float64 (``Reference64``), the rounding spread of a training step (float64 runs of the rounded
problem and with every op's result perturbed, ``Spread`` of ``Samples``), and PyTorch's own compiled
graph (``CompiledPeer``). How they decide: ``docs/NUMERICS.md``, "How the fuzzer judges a difference".
"""
from __future__ import annotations

import contextlib
import copy

import torch

from .graphs import Program


#: runs of the float64 model with every op's result perturbed, per training program
PERTURBED_SAMPLES = 2


def unit_roundoff(dtype: torch.dtype, device_type: str) -> float:
    """The relative rounding of one op's result in a training step's forward: the autocast dtype's
    unit roundoff; float32 on CUDA: TF32's (cuDNN's convolutions use it by default); else 0."""
    if dtype == torch.float16:
        return 2.0 ** -11
    if dtype == torch.bfloat16:
        return 2.0 ** -8
    return 2.0 ** -11 if device_type == "cuda" else 0.0


class RoundEveryOp(torch.overrides.TorchFunctionMode):
    """Every floating-point result of a torch function times ``1 + d``, ``d`` uniform in ``[-u, u]``
    (seeded): the standard model of rounding each op's result, applied to the float64 forward. Its
    gradient, against the exact one, is how far rounding anywhere in the forward moves a gradient:
    through ``abs`` / ``relu`` / ``hardsigmoid`` of values within rounding of their kink, a gradient
    element flips between branches in every implementation, eager's and fxopt's at other elements
    (GPU fuzz, 16-bit training: weight gradients 2-150x eager's error away from float64, with the
    regions' kernels within 4 ulps of their references). In-place results and the inputs
    returned as they are stay untouched."""

    def __init__(self, u: float, seed: int):
        super().__init__()
        self.u, self.gen = u, torch.Generator().manual_seed(seed)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if (isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel()
                and not name.endswith("_") and not name.startswith("__")
                and not any(out is a for a in args if isinstance(a, torch.Tensor))):
            d = (torch.rand(out.shape, generator=self.gen, dtype=torch.float64) * 2 - 1) * self.u
            out = out * (1 + d.to(out.device))
        return out


class Samples(list):
    """Results of several rounded float64 runs (``compare`` takes the largest spread)."""


class Spread:
    """The rounded float64 runs of a training step, asked as one reference (each method: ``Samples``)."""

    def __init__(self, refs: list):
        self.refs = refs

    def out(self):
        return Samples(r.out() for r in self.refs)

    def loss(self, loss_fn):
        return Samples(r.loss(loss_fn) for r in self.refs)

    def grad(self, name: str, loss_fn):
        return Samples(r.grad(name, loss_fn) for r in self.refs)

    def buffer(self, name: str):
        return Samples(r.buffer(name) for r in self.refs)


class Reference64:
    """The model run in float64, lazily: a copy of the model and input taken now (before eager's
    step changes them), run on the first call; for a training step the loss's backward too."""

    def __init__(self, model, x, program: Program, rounding: torch.dtype | None = None,
                 perturb: float = 0.0, seed: int = 0):
        self.model, self.x, self.training = copy.deepcopy(model), x.detach().clone(), program.mode == "training"
        self._out = self._loss = None
        self.perturb, self.seed = perturb, seed
        #: how rounding moves the result (a training step only): the rounded problem (operands
        #: rounded to the autocast dtype; 16-bit autocast) and ``PERTURBED_SAMPLES`` runs with
        #: every op's result perturbed by up to the unit roundoff (``RoundEveryOp``), as ``Samples``
        self.rounded: Spread | None = None
        dtype = getattr(torch, program.dtype)
        if rounding is None and self.training:
            u = unit_roundoff(dtype, x.device.type)
            samples = []
            if dtype != torch.float32:
                samples.append(Reference64(_rounded(model, dtype), x.detach().to(dtype).to(x.dtype), program,
                                           rounding=dtype))
            if u:
                m, xr = ((_rounded(model, dtype), x.detach().to(dtype).to(x.dtype)) if dtype != torch.float32
                         else (model, x))
                samples += [Reference64(m, xr, program, rounding=dtype, perturb=u, seed=program.seed * 7 + k)
                            for k in range(PERTURBED_SAMPLES)]
            self.rounded = Spread(samples) if samples else None

    def out(self):
        if self._out is None:
            self.model.double()
            self.x = self.x.double().requires_grad_(self.training)
            perturbed = RoundEveryOp(self.perturb, self.seed) if self.perturb else contextlib.nullcontext()
            with contextlib.nullcontext() if self.training else torch.no_grad(), perturbed:
                self._out = self.model(self.x)
        return self._out

    def loss(self, loss_fn):
        if self._loss is None:
            self._loss = loss_fn(self.out(), True)
            self._loss.backward()
        return self._loss

    def buffer(self, name: str):
        """Buffer ``name`` after the float64 forward (a training BatchNorm's running statistics)."""
        self.out()
        return dict(self.model.named_buffers())[name]

    def grad(self, name: str, loss_fn):
        """The float64 gradient of parameter ``name`` (``"input"``: of the input)."""
        self.loss(loss_fn)
        p = self.x if name == "input" else dict(self.model.named_parameters())[name]
        return p.grad


class CompiledPeer:
    """The model as ``torch.compile(backend="aot_eager")`` runs it (AOTAutograd's graph on PyTorch's
    kernels), lazily: a copy of the model and input taken now, run on the first call, for a training
    step under the program's autocast, with the loss's backward too."""

    def __init__(self, model, x, program: Program, device: str):
        self.model, self.x, self.program, self.device = copy.deepcopy(model), x.detach().clone(), program, device
        self._out = self._loss = None

    def out(self):
        if self._out is None:
            training, dtype = self.program.mode == "training", getattr(torch, self.program.dtype)
            torch.compiler.reset()  # (fxopt's compiled model has run: nothing more is called on it)
            fn = torch.compile(self.model, backend="aot_eager")
            amp = (torch.autocast(self.device, dtype=dtype) if training and dtype != torch.float32
                   else contextlib.nullcontext())
            self.x.requires_grad_(training)
            with amp, (contextlib.nullcontext() if training else torch.no_grad()):
                self._out = fn(self.x)
        return self._out

    def buffer(self, name: str):
        self.out()
        return dict(self.model.named_buffers())[name]

    def grad(self, name: str, loss_fn):
        if self._loss is None:
            self._loss = loss_fn(self.out())
            self._loss.backward()
        return self.x.grad if name == "input" else dict(self.model.named_parameters())[name].grad


def _rounded(model, dtype: torch.dtype):
    """A copy of ``model`` whose floating-point parameters and buffers are rounded to ``dtype`` (and
    kept in their own dtype): the operands autocast hands the kernels."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.copy_(t.to(dtype).to(t.dtype))
    return m
