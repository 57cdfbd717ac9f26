"""The references a fuzz program's values are judged against (``check.compare``): the model in
float64 (``Reference64``), the rounding spread of a training step (float64 runs of the rounded
problem and with every op's result perturbed, ``Spread`` of ``Samples``), and PyTorch's own compiled
graph (``CompiledPeer``), eager's error at nearby inputs (``EagerNearby``). How they decide: ``docs/NUMERICS.md``, "How the fuzzer judges a difference".
"""
from __future__ import annotations

import contextlib
import copy

import torch

from .graphs import Program


#: runs of the float64 model with every op's operands and result perturbed, per program
PERTURBED_SAMPLES = 4

#: eager runs at inputs a few units of the last place from the program's (``EagerNearby``)
NEARBY_SAMPLES = 4

#: the branch-flip run flips an element whose distance from a kink is at most this many times the
#: largest distance any perturbed run moved it
FLIP_BAND = 2.0

#: ops whose result adds up terms (its rounding error scales with the terms, not with the result)
_SUMMING = frozenset({
    "conv1d", "conv2d", "conv3d", "conv_transpose2d", "linear", "matmul", "mm", "bmm", "addmm", "add", "sub",
    "__add__", "__sub__", "__radd__", "__rsub__", "batch_norm", "layer_norm", "group_norm", "instance_norm", "sum",
    "mean", "var", "std", "avg_pool2d", "adaptive_avg_pool2d", "interpolate", "softmax", "log_softmax"})


def unit_roundoff(dtype: torch.dtype, device_type: str) -> float:
    """The relative rounding of one op in a program's forward: the dtype's (a 16-bit inference model,
    or a training step's autocast dtype) unit roundoff; float32 on CUDA: TF32's (cuDNN's convolutions
    use it by default); else 0."""
    if dtype == torch.float16:
        return 2.0 ** -11
    if dtype == torch.bfloat16:
        return 2.0 ** -8
    return 2.0 ** -11 if device_type == "cuda" else 0.0


def _kinks(func, args, kwargs) -> list | None:
    """Where ``func``'s derivative jumps (its branches meet), for the piecewise ops a CNN uses; None
    for every other op. Ties of a max pool or an ``amax`` are branches too, not modelled here."""
    name = getattr(func, "__name__", "")
    if name in ("abs", "relu", "leaky_relu", "prelu"):
        return [0.0]
    if name == "relu6":
        return [0.0, 6.0]
    if name in ("hardsigmoid", "hardswish"):
        return [-3.0, 3.0]
    if name in ("hardtanh", "clamp", "clip"):
        default = (-1.0, 1.0) if name == "hardtanh" else (None, None)
        lo = args[1] if len(args) > 1 else kwargs.get("min_val", kwargs.get("min", default[0]))
        hi = args[2] if len(args) > 2 else kwargs.get("max_val", kwargs.get("max", default[1]))
        return [float(v) for v in (lo, hi) if isinstance(v, (int, float))]
    return None


class RoundEveryOp(torch.overrides.TorchFunctionMode):
    """The standard model of rounding, applied to a float64 run (seeded): every op computed exactly
    on operands each within the unit roundoff ``u`` of the values it is handed (the ops that add up
    terms: convolutions, products, sums, norms; their rounding error scales with the terms, which
    may cancel) and its floating-point result times ``1 + d``, ``d`` uniform in ``[-u, u]``; in a
    training step the gradient the backward computes for that result too (a 16-bit backward rounds
    every gradient it writes: a convolution's bias gradient before a training BatchNorm adds up
    thousands of rounded terms whose exact sum is 0, GPU fuzz 6e42ecd3e1: 0.03 to 0.4 from float64
    across eager, its channels_last run and fxopt, by the loss's random weights alone). Its
    values and gradients, against the exact ones, are how far rounding anywhere in the forward moves
    them: through ``abs`` / ``relu`` / ``hardsigmoid`` of values within rounding of their kink, a
    gradient element flips between branches in every implementation, eager's and fxopt's at other
    elements (GPU fuzz, 16-bit training: weight gradients 2-150x eager's error away from float64,
    with the regions' kernels within 4 ulps of their references). In-place results and the inputs
    returned as they are stay untouched.

    ``kinks``: a list that gets the argument of every piecewise op (``_kinks``), in call order;
    ``flip``: per such call, a band: every element within it of a kink takes the other branch (its
    argument reflected across the kink, the gradient flowing as through the argument itself)."""

    def __init__(self, u: float, seed: int, kinks: list | None = None, flip: list | None = None):
        super().__init__()
        self.u, self.gen = u, torch.Generator().manual_seed(seed)
        self.kinks, self.flip, self.calls = kinks, flip, 0

    def _perturbed(self, t: torch.Tensor) -> torch.Tensor:
        d = (torch.rand(t.shape, generator=self.gen, dtype=torch.float64) * 2 - 1) * self.u
        return t * (1 + d.to(t.device))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        points = _kinks(func, args, kwargs) if args and isinstance(args[0], torch.Tensor) else None
        if points is not None and args[0].dtype == torch.float64:
            x = args[0]
            if self.kinks is not None:
                self.kinks.append(x.detach().clone())
            if self.flip is not None and self.calls < len(self.flip) and self.flip[self.calls].shape == x.shape:
                band, shift = self.flip[self.calls], torch.zeros_like(x)
                for k in points:
                    near = (x.detach() - k).abs() <= band
                    shift = torch.where(near, 2 * (k - x.detach()), shift)
                args = (x + shift,) + tuple(args[1:])
            self.calls += 1
        if self.u and name in _SUMMING:
            args = tuple(self._perturbed(a) if isinstance(a, torch.Tensor) and a.dtype == torch.float64
                         and a.numel() else a for a in args)
        out = func(*args, **kwargs)
        if (self.u and isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel()
                and not name.endswith("_") and not name.startswith("__")
                and not any(out is a for a in args if isinstance(a, torch.Tensor))):
            out = self._perturbed(out)
            if out.requires_grad:  # the backward rounds too: the gradient reaching this op's result
                out.register_hook(self._perturbed)
        return out


class Samples(list):
    """Results of several rounded float64 runs (``compare`` takes the largest spread)."""


class Spread:
    """The rounded float64 runs of a program, asked as one reference (each method: ``Samples``):
    ``refs`` (the rounded problem, the perturbed runs) and, once they have run, the branch-flip run
    (``flipped``): the exact model with every element that lies within ``FLIP_BAND`` times the
    perturbed runs' largest movement of a kink flipped to the other branch. Random runs find a flip
    only by chance (GPU fuzz 736f3d759a: one element of 504 within rounding of ``abs``'s kink, hit
    by 1 of 12 runs); this run finds every one the runs show to be that close."""

    def __init__(self, refs: list, exact: "Reference64"):
        self.refs, self.exact, self._flip = refs, exact, None

    def flipped(self) -> "Reference64 | None":
        if self._flip is None:
            for r in self.refs:
                r.out()
            self.exact.out()
            base, runs = self.exact.kinks, [r.kinks for r in self.refs]
            if not base or any(len(k) != len(base) or any(a.shape != b.shape for a, b in zip(k, base))
                               for k in runs):
                self._flip = False  # no kink, or the runs took other paths: nothing to flip
            else:
                bands = [FLIP_BAND * torch.stack([(k[j] - b).abs() for k in runs]).amax(0)
                         for j, b in enumerate(base)]
                self._flip = Reference64(self.exact.source_model, self.exact.source_x, self.exact.program,
                                         rounding=self.exact.dtype, flip=bands)
        return self._flip or None

    def _all(self) -> list:
        flip = self.flipped()
        return self.refs + ([flip] if flip is not None else [])

    def out(self):
        return Samples(r.out() for r in self._all())

    def loss(self, loss_fn):
        return Samples(r.loss(loss_fn) for r in self._all())

    def grad(self, name: str, loss_fn):
        return Samples(r.grad(name, loss_fn) for r in self._all())

    def buffer(self, name: str):
        return Samples(r.buffer(name) for r in self._all())


class Reference64:
    """The model run in float64, lazily: a copy of the model and input taken now (before eager's
    step changes them), run on the first call; for a training step the loss's backward too.
    It runs on the CPU whatever the program's device: a CUDA kernel that is wrong in eager's layout
    is as wrong in float64 there, and a reference that shares eager's error passes eager and fails
    a correct fxopt (GPU fuzz 68a548ca2f: the channels_last ``avg_pool2d_backward`` of a padded pool,
    eager's layout, agreed with float64 on the GPU to 3e-9 in the same layout and was 0.25 from
    float64 on the CPU; fxopt, which reads NCHW copies there, was flagged).
    ``kinks``: the arguments of its piecewise ops once it has run (``RoundEveryOp``)."""

    def __init__(self, model, x, program: Program, rounding: torch.dtype | None = None,
                 perturb: float = 0.0, seed: int = 0, flip: list | None = None):
        self.model, self.x, self.training = copy.deepcopy(model), x.detach().clone(), program.mode == "training"
        self.program, self.dtype = program, getattr(torch, program.dtype)
        self._out = self._loss = None
        self.perturb, self.seed, self.flip, self.kinks = perturb, seed, flip, []
        #: how rounding moves the result: under 16-bit autocast the rounded problem (operands
        #: rounded to the autocast dtype), ``PERTURBED_SAMPLES`` runs with every op's operands and
        #: result perturbed by up to the unit roundoff (``RoundEveryOp``) and the branch-flip run
        self.rounded: Spread | None = None
        if rounding is None:
            self.source_model, self.source_x = copy.deepcopy(model), x.detach().clone()  # the flip run's
            u = unit_roundoff(self.dtype, x.device.type)
            autocast = self.training and self.dtype != torch.float32
            m, xr = ((_rounded(model, self.dtype), x.detach().to(self.dtype).to(x.dtype)) if autocast
                     else (model, x))
            samples = [Reference64(m, xr, program, rounding=self.dtype)] if autocast else []
            if u:
                samples += [Reference64(m, xr, program, rounding=self.dtype, perturb=u, seed=program.seed * 7 + k)
                            for k in range(PERTURBED_SAMPLES)]
            self.rounded = Spread(samples, self) if samples else None

    def out(self):
        if self._out is None:  # on the CPU: see the class's docstring
            self.model.double().cpu()
            self.x = self.x.double().cpu().requires_grad_(self.training)
            mode = RoundEveryOp(self.perturb, self.seed, kinks=self.kinks, flip=self.flip)
            with contextlib.nullcontext() if self.training else torch.no_grad(), mode:
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


class EagerNearby:
    """Eager's own error at inputs a few units of the last place from the program's (each element
    times ``1 + d``, ``|d|`` up to 4 units of the input dtype's roundoff; ``NEARBY_SAMPLES`` of them),
    each against the model in float64 at that input (a ``Reference64`` there), lazily: per output (``errors``), and for a
    training step the loss's and each gradient's (``loss_error``, ``grad_error``), the largest.
    Where a value cancels (a normalization over two values equal in exact arithmetic, a sum of
    terms whose result is 0 but not the last thing computed), eager's error is rounding noise whose
    size one input says little of: CPU fuzz 88d430b4dc (float32 training): InstanceNorm over two
    values, GroupNorm (a mean of +-pairs, 0 exactly), ``abs`` of half the channels, a training
    BatchNorm over the two values, which scales their float32 difference by ``1 / sqrt(eps)``;
    eager 3.6e-4 from float64 at the program's input (5.3e-4 at the nearby ones), fxopt 9.0e-4; the
    first layer's weight gradient eager 2.3e-4 there, 1.2e-4 to 0.051 nearby, fxopt 2.7e-3; the
    float64 runs that perturb each op's operands by float32's roundoff moved the output 2e-5 to
    4e-5. ``model`` and ``x``: copies nothing changes (``Reference64``'s ``source_model`` and
    ``source_x``, taken before eager's step); each run works on a copy of its own."""

    def __init__(self, model, x, program: Program):
        self.model, self.x, self.program = model, x, program
        self._out: list | None = None
        self._step: dict | None = None

    def _inputs(self):
        """(eager's input, the float64 reference there), ``NEARBY_SAMPLES`` times."""
        u = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}.get(self.x.dtype, 2.0 ** -24)
        gen = torch.Generator().manual_seed(self.program.seed * 13 + 5)
        for _ in range(NEARBY_SAMPLES):
            d = (torch.rand(self.x.shape, generator=gen, dtype=torch.float64) * 2 - 1) * 4 * u
            xk = torch.empty_like(self.x).copy_(self.x.double().cpu() * (1 + d))  # the input's layout kept
            yield xk, Reference64(self.model, xk, self.program, rounding=self.x.dtype)  # (rounding: no spread)

    def _amp(self):
        dtype = getattr(torch, self.program.dtype)
        return (torch.autocast(self.x.device.type, dtype=dtype)
                if self.program.mode == "training" and dtype != torch.float32 else contextlib.nullcontext())

    def errors(self) -> list:
        from fxopt.tolerances import max_error

        if self._out is None:
            worst: list = []
            for xk, ref in self._inputs():
                with torch.no_grad(), self._amp():
                    got = _flat(copy.deepcopy(self.model)(xk))
                errs = [max_error(g, e) if isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor) else 0.0
                        for g, e in zip(got, _flat(ref.out()))]
                worst = errs if not worst else [max(a, b) for a, b in zip(worst, errs)]
            self._out = worst
        return self._out

    def _steps(self, loss_fn) -> dict:
        """The loss's and every gradient's largest error over the nearby inputs (``loss_fn(outs,
        ref)``: the training check's loss, in float64 with ``ref``)."""
        from fxopt.tolerances import max_error

        if self._step is None:
            worst: dict = {}
            for xk, ref in self._inputs():
                m, xg = copy.deepcopy(self.model), xk.detach().requires_grad_(True)
                with self._amp():
                    loss = loss_fn(m(xg))
                loss.backward()
                errs = {"loss": max_error(loss.detach(), ref.loss(loss_fn).detach())}
                names = [n for n, p in m.named_parameters() if p.grad is not None] + ["input"] * (xg.grad is not None)
                for name in names:
                    g, g64 = xg.grad if name == "input" else dict(m.named_parameters())[name].grad, ref.grad(name, loss_fn)
                    if g64 is not None:
                        errs[name] = max_error(g, g64)
                for k, v in errs.items():
                    worst[k] = max(v, worst.get(k, 0.0))
            self._step = worst
        return self._step

    def loss_error(self, loss_fn) -> list:
        return [self._steps(loss_fn).get("loss", 0.0)]

    def grad_error(self, name: str, loss_fn) -> list:
        """[the largest error of gradient ``name`` ("input": the input's)], or [] where none was had."""
        e = self._steps(loss_fn).get(name)
        return [] if e is None else [e]


def _flat(out) -> list:
    """A program's outputs as a list, one level (``check`` indexes outputs so)."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _rounded(model, dtype: torch.dtype):
    """A copy of ``model`` whose floating-point parameters and buffers are rounded to ``dtype`` (and
    kept in their own dtype): the operands autocast hands the kernels."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for t in list(m.parameters()) + list(m.buffers()):
            if t.is_floating_point():
                t.copy_(t.to(dtype).to(t.dtype))
    return m
