"""Hypothesis strategies for random CNNs with matching inputs, and equivalence checks.

    from hypothesis import given
    from fxopt.testing import cnn_cases, check_equivalence

    @given(cnn_cases())
    def test_my_pass(case):
        check_equivalence(case, options={"passes": ["my_pass"]})

A ``CNNCase`` holds a module (eval mode unless ``training``), example inputs
and a readable description of the architecture (shown by hypothesis on failure).
The generated modules cover conv1d/conv2d (kernel 1-7, stride 1-2, padding incl.
'same', dilation, groups incl. depthwise), BatchNorm with random statistics,
every activation fxopt fuses, max/avg/adaptive pooling, residual adds,
concatenation, and flatten + linear heads, in float32/float64/bfloat16/float16.
With ``training=True`` the models are in training mode (BatchNorm normalises by
batch statistics and updates its running statistics) and also draw ResNet basic
blocks (conv-BN-act-conv-BN plus an identity or strided 1x1 conv-BN shortcut,
added, act: a gradient that flows into two branches and sums); ``check_equivalence``
then compares the loss, every parameter's gradient, the input's gradient and the
updated buffers with eager's (optionally under ``torch.autocast``).
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from hypothesis import strategies as st

from fxopt.tolerances import max_error, tolerance

ACTIVATIONS = {
    "relu": lambda: nn.ReLU(), "relu_inplace": lambda: nn.ReLU(inplace=True), "relu6": lambda: nn.ReLU6(),
    "leaky_relu": lambda: nn.LeakyReLU(0.1), "silu": lambda: nn.SiLU(), "gelu": lambda: nn.GELU(),
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "hardswish": lambda: nn.Hardswish(),
    "hardsigmoid": lambda: nn.Hardsigmoid(), "sigmoid": lambda: nn.Sigmoid(), "tanh": lambda: nn.Tanh(),
    "none": lambda: nn.Identity(),
}

#: number of generated graphs compared by check_equivalence in this process
GRAPHS_CHECKED = 0


@dataclass
class CNNCase:
    model: nn.Module
    inputs: tuple
    dtype: torch.dtype
    training: bool = False
    description: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        shapes = [tuple(t.shape) for t in self.inputs]
        return f"CNNCase({str(self.dtype).replace('torch.', '')}, inputs={shapes}, training={self.training}, " \
               f"layers={self.description})"


def _rand_bn(bn: nn.Module, gen: torch.Generator) -> nn.Module:
    c = bn.num_features
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=gen) * 0.5)
        bn.running_var.copy_(torch.rand(c, generator=gen) + 0.5)
        if bn.affine:
            bn.weight.copy_(torch.rand(c, generator=gen) + 0.5)
            bn.bias.copy_(torch.randn(c, generator=gen) * 0.2)
    return bn


class Step(nn.Module):
    """One generated layer: `kind` decides how `forward` combines the submodules."""

    def __init__(self, kind: str, body: nn.Module, extra: Optional[nn.Module] = None):
        super().__init__()
        self.kind, self.body, self.extra = kind, body, extra

    def forward(self, x):
        if self.kind == "residual":
            return self.extra(self.body(x) + x)
        if self.kind == "basic_block":  # extra = (shortcut, activation)
            shortcut, act = self.extra
            return act(self.body(x) + shortcut(x))
        if self.kind == "concat":
            return torch.cat([self.body(x), self.extra(x)], dim=1)
        if self.kind == "flatten_linear":
            return self.body(torch.flatten(x, 1))
        return self.body(x)


class Branches(nn.Module):
    """Parallel convolutions of one input, summed, with an identity term maybe (``x`` or a
    BatchNorm of ``x``), then an activation: the re-parameterizable blocks of RepVGG / MobileOne /
    ACNet."""

    def __init__(self, convs: list, identity: Optional[nn.Module], with_x: bool, act: nn.Module):
        super().__init__()
        self.convs, self.identity, self.with_x, self.act = nn.ModuleList(convs), identity, with_x, act

    def forward(self, x):
        y = self.convs[0](x)
        for conv in self.convs[1:]:
            y = y + conv(x)
        if self.identity is not None:
            y = y + self.identity(x)
        elif self.with_x:
            y = y + x
        return self.act(y)


class RandomCNN(nn.Module):
    def __init__(self, steps: list[nn.Module]):
        super().__init__()
        self.steps = nn.ModuleList(steps)

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return x


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def conv_params(draw, cin: int, size: int, ndim: int):
    """A legal (module kwargs, output size) for a conv on `size`-long spatial dims."""
    k = draw(st.integers(1, min(7, size)))
    stride = draw(st.sampled_from([1, 1, 2]))
    dilation = draw(st.sampled_from([1, 1, 2])) if k > 1 and (k - 1) * 2 + 1 <= size else 1
    eff = dilation * (k - 1) + 1
    if stride == 1 and draw(st.booleans()):
        padding = "same"
    else:
        padding = draw(st.integers(0, eff // 2))
    groups_kind = draw(st.sampled_from(["one", "one", "depthwise", "grouped"]))
    cout = draw(st.sampled_from([cin, 4, 8, 12]))
    if groups_kind == "depthwise":
        groups, cout = cin, cin * draw(st.sampled_from([1, 2]))
    elif groups_kind == "grouped":
        common = [g for g in _divisors(cin) if cout % g == 0]
        groups = draw(st.sampled_from(common))
    else:
        groups = 1
    out = size if padding == "same" else (size + 2 * padding - eff) // stride + 1
    kwargs = dict(in_channels=cin, out_channels=cout, kernel_size=k, stride=stride, padding=padding,
                  dilation=dilation, groups=groups, bias=draw(st.booleans()))
    return kwargs, cout, out


#: the layers a generated model is drawn from (repeats weigh the draw)
LAYER_KINDS = ("conv", "conv", "conv", "residual", "concat", "pool", "branches")
#: training cases also draw ResNet basic blocks
TRAINING_LAYER_KINDS = LAYER_KINDS + ("basic_block",)


@st.composite
def cnn_cases(draw, dtypes=(torch.float32,), ndims=(2,), max_layers: int = 5, training: bool = False,
              heads: bool = True, min_batch: int = 1, max_batch: int = 3, kinds=None):
    """A random CNN (eval mode unless `training`) with a matching random input. `kinds`: the layer
    kinds to draw from (default ``LAYER_KINDS``, ``TRAINING_LAYER_KINDS`` with `training`)."""
    kinds = list(kinds or (TRAINING_LAYER_KINDS if training else LAYER_KINDS))
    ndim = draw(st.sampled_from(list(ndims)))
    dtype = draw(st.sampled_from(list(dtypes)))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    conv_cls, bn_cls = {1: (nn.Conv1d, nn.BatchNorm1d), 2: (nn.Conv2d, nn.BatchNorm2d)}[ndim]
    batch = draw(st.integers(min_batch, max_batch))
    c = draw(st.integers(1, 4))
    size = draw(st.integers(6, 20) if ndim == 2 else st.integers(8, 48))
    in_shape = (batch, c) + (size,) * ndim
    steps, desc = [], []

    def conv_block(cin, size):
        kw, cout, out = draw(conv_params(cin, size, ndim))
        layers = [conv_cls(**kw)]
        text = f"conv{ndim}d(k{kw['kernel_size']} s{kw['stride']} p{kw['padding']} d{kw['dilation']} g{kw['groups']})"
        if draw(st.booleans()):
            layers.append(_rand_bn(bn_cls(cout, affine=draw(st.booleans())), gen))
            text += "-bn"
        act = draw(st.sampled_from(sorted(ACTIVATIONS)))
        layers.append(ACTIVATIONS[act]())
        return nn.Sequential(*layers), cout, out, f"{text}-{act}"

    for _ in range(draw(st.integers(1, max_layers))):
        kind = draw(st.sampled_from(kinds))
        if kind == "pool" and size >= 2:
            pool = draw(st.sampled_from(["max", "avg", "adaptive"]))
            if pool == "adaptive":
                out = draw(st.integers(1, size))
                mod = (nn.AdaptiveAvgPool1d if ndim == 1 else nn.AdaptiveAvgPool2d)(out)
            else:
                cls = {("max", 1): nn.MaxPool1d, ("max", 2): nn.MaxPool2d,
                       ("avg", 1): nn.AvgPool1d, ("avg", 2): nn.AvgPool2d}[(pool, ndim)]
                mod, out = cls(2), size // 2
            steps.append(Step("plain", mod))
            desc.append(f"{pool}pool->{out}")
            size = out
        elif kind == "residual":
            kw = dict(in_channels=c, out_channels=c, kernel_size=3, padding=1, bias=draw(st.booleans()))
            body = nn.Sequential(conv_cls(**kw), _rand_bn(bn_cls(c), gen))
            act = draw(st.sampled_from(sorted(ACTIVATIONS)))
            steps.append(Step("residual", body, ACTIVATIONS[act]()))
            desc.append(f"residual(conv3-bn)+{act}")
        elif kind == "basic_block" and size >= 2:
            stride = draw(st.sampled_from([1, 2]))
            cout = draw(st.sampled_from([c, 4, 8]))
            act = draw(st.sampled_from(["relu", "relu_inplace", "silu", "hardswish"]))
            body = nn.Sequential(conv_cls(c, cout, 3, stride, 1, bias=False), _rand_bn(bn_cls(cout), gen),
                                 ACTIVATIONS[act](), conv_cls(cout, cout, 3, 1, 1, bias=False),
                                 _rand_bn(bn_cls(cout), gen))
            if stride == 1 and cout == c:
                shortcut, text = nn.Identity(), "identity"
            else:
                shortcut = nn.Sequential(conv_cls(c, cout, 1, stride, bias=False), _rand_bn(bn_cls(cout), gen))
                text = f"conv1 s{stride}-bn"
            steps.append(Step("basic_block", body, nn.ModuleList([shortcut, ACTIVATIONS[act]()])))
            desc.append(f"basic_block(conv3 s{stride}-bn-{act}-conv3-bn + {text})-{act}")
            c, size = cout, (size - 1) // stride + 1
        elif kind == "branches" and ndim == 2 and size >= 3:
            k = draw(st.sampled_from([3, 5] if size >= 5 else [3]))
            stride = draw(st.sampled_from([1, 1, 2]))
            dil = draw(st.sampled_from([1, 2])) if 2 * (k - 1) + 1 <= size else 1
            cout = draw(st.sampled_from([c, c, 4]))
            groups = draw(st.sampled_from([g for g in _divisors(c) if cout % g == 0 and g <= 4]))
            shapes = draw(st.lists(st.sampled_from([(k, k), (1, 1), (1, k), (k, 1), (k, k)]), min_size=1, max_size=3))
            convs, texts = [], []
            for kh, kw in shapes:
                conv = conv_cls(c, cout, (kh, kw), stride, (dil * (kh - 1) // 2, dil * (kw - 1) // 2), dil, groups,
                                bias=draw(st.booleans()))
                bn = draw(st.booleans())
                convs.append(nn.Sequential(conv, _rand_bn(bn_cls(cout), gen)) if bn else conv)
                texts.append(f"conv{kh}x{kw}{'-bn' if bn else ''}")
            ident = draw(st.sampled_from(["none", "x", "bn"])) if stride == 1 and cout == c else "none"
            act = draw(st.sampled_from(sorted(ACTIVATIONS)))
            identity = _rand_bn(bn_cls(c), gen) if ident == "bn" else None
            steps.append(Step("plain", Branches(convs, identity, ident == "x", ACTIVATIONS[act]())))
            desc.append(f"branches(s{stride} d{dil} g{groups}: {' + '.join(texts)}"
                        f"{'' if ident == 'none' else ' + ' + ident})-{act}")
            c, size = cout, (size - 1) // stride + 1
        elif kind == "concat" and size >= 3:
            a, ca, sa, ta = conv_block(c, size)
            kw = dict(in_channels=c, out_channels=draw(st.sampled_from([2, 4])), kernel_size=1)
            b = nn.Sequential(conv_cls(**kw), nn.ReLU())
            if sa != size:
                continue
            steps.append(Step("concat", a, b))
            desc.append(f"cat({ta}, conv1)")
            c = ca + kw["out_channels"]
        else:
            body, c, size, text = conv_block(c, size)
            steps.append(Step("plain", body))
            desc.append(text)
        if size < 1:
            break
    if not steps:  # every drawn layer was skipped: a model needs at least one
        body, c, size, text = conv_block(c, size)
        steps.append(Step("plain", body))
        desc.append(text)
    if heads and draw(st.booleans()):
        act = draw(st.sampled_from(["relu", "none", "gelu", "hardswish"]))
        features = c * size**ndim
        head = nn.Sequential(nn.Linear(features, 16), ACTIVATIONS[act](), nn.Linear(16, 5))
        steps.append(Step("flatten_linear", head))
        desc.append(f"flatten-linear-{act}-linear")
    model = RandomCNN(steps).to(dtype)
    model.train(training)
    x = torch.randn(in_shape, generator=gen).to(dtype)
    return CNNCase(model, (x,), dtype, training, desc)


def compile_with_fxopt(model: nn.Module, options=None, graphs: Optional[list] = None):
    """torch.compile(model, backend=fxopt) with a fresh Dynamo cache; graphs collects the GraphReports."""
    from fxopt.backend import fxopt_backend

    torch.compiler.reset()

    def backend(gm, inputs):
        return fxopt_backend(gm, inputs, options=options, _sink=graphs)

    return torch.compile(model, backend=backend)


def check_equivalence(case: CNNCase, options=None, rtol=None, atol=None, autocast: Optional[torch.dtype] = None) -> list:
    """Compile `case.model` with fxopt and assert outputs (and gradients) match eager.

    Inference cases: outputs and their strides. Training cases (``case.training``): the output, the
    loss ``(out * w).sum()`` for a fixed random ``w`` (so that every output element's gradient
    differs), every parameter's gradient (10x the tolerance), the input's gradient and the buffers
    the step updated (BatchNorm running statistics). `autocast`: run both forwards under
    ``torch.autocast`` to that dtype (tolerances then default to that dtype's).

    Returns the GraphReports of the compiled graphs (at least one, or it fails).
    """
    global GRAPHS_CHECKED
    rtol_d, atol_d = tolerance(autocast or case.dtype)
    rtol, atol = rtol or rtol_d, atol or atol_d
    graphs: list = []
    eager = case.model
    model = copy.deepcopy(case.model)
    compiled = compile_with_fxopt(model, options, graphs)
    if case.training:
        _check_training_step(eager, model, compiled, case.inputs, rtol, atol, autocast)
    else:
        with torch.no_grad():
            out_e, out_c = eager(*case.inputs), compiled(*case.inputs)
        torch.testing.assert_close(out_c, out_e, rtol=rtol, atol=atol)
        assert out_c.stride() == out_e.stride(), f"strides {out_c.stride()} != eager {out_e.stride()}"
    assert graphs, "fxopt compiled no graph"
    for g in graphs:
        assert g.fallback is None, g.fallback
        g.after.graph.lint()
    GRAPHS_CHECKED += 1
    return graphs


class _Float64Step:
    """The model's forward and backward in float64 (a copy of the model and inputs taken now), run
    on the first call of ``output`` or ``grads``: its output; every parameter's gradient by name, the
    inputs' by position."""

    def __init__(self, model: nn.Module, inputs):
        self.model = copy.deepcopy(model).double()
        self.inputs = [t.detach().double().requires_grad_(True) for t in inputs]
        self._out = self._grads = None

    def output(self) -> torch.Tensor:
        if self._out is None:
            self._out = self.model(*self.inputs).double()
        return self._out

    def grads(self, w: torch.Tensor) -> dict:
        if self._grads is None:
            (self.output() * w.double()).sum().backward()
            self._grads = {**{n: p.grad for n, p in self.model.named_parameters()},
                           **{i: t.grad for i, t in enumerate(self.inputs)}}
        return self._grads


def _as_close_as_eager(got: torch.Tensor, want: torch.Tensor, exact, rtol: float, atol: float, what: str) -> None:
    """``got`` within the tolerance of eager's ``want``, or (an ill-conditioned value: a BatchNorm
    over few values divides by their spread, its backward cancels, and 16-bit rounding moves the
    result by more than its tolerance in eager as well) no further from the float64 result
    ``exact()`` than twice eager's error plus ``atol``: the fuzzer's judgement
    (``fxopt.tolerances.max_error``). Shape and dtype always as eager's."""
    assert (got.shape, got.dtype) == (want.shape, want.dtype), f"{what}: {got.shape} {got.dtype} != eager's " \
        f"{want.shape} {want.dtype}"
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    except AssertionError:
        err, eager_err = (max_error(t, exact()) for t in (got, want))
        if not err <= 2 * eager_err + atol:
            raise AssertionError(f"{what}: error against float64 {err:.3g}, eager's {eager_err:.3g} "
                                 f"(up to twice eager's + {atol} allowed)") from None


def _check_training_step(eager: nn.Module, model: nn.Module, compiled, inputs, rtol, atol, autocast) -> None:
    """One forward + backward of `eager` and of `compiled` (which trains `model`, a copy of it)."""
    device = inputs[0].device.type
    amp = torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    exact = _Float64Step(eager, inputs)  # a copy taken before eager's step changes the buffers
    inputs_e = [t.detach().clone().requires_grad_(True) for t in inputs]
    inputs_c = [t.detach().clone().requires_grad_(True) for t in inputs]
    with amp:
        out_e, out_c = eager(*inputs_e), compiled(*inputs_c)
    # a training BatchNorm over few values divides by their spread: 16-bit rounding before it moves
    # an output by more than the tolerance in eager as well (judged as the gradients are)
    _as_close_as_eager(out_c, out_e, exact.output, rtol, atol, "output")
    w = torch.randn(out_e.shape, generator=torch.Generator().manual_seed(0)).to(out_e.device)
    loss_e, loss_c = (out_e.float() * w).sum(), (out_c.float() * w).sum()
    torch.testing.assert_close(loss_c, loss_e, rtol=rtol, atol=atol * max(1.0, out_e.numel() ** 0.5),
                               msg=lambda m: f"loss: {m}")
    loss_e.backward()
    loss_c.backward()
    grads_e, grads_c = dict(eager.named_parameters()), dict(model.named_parameters())
    assert list(grads_c) == list(grads_e)
    for name, p_e in grads_e.items():
        g_e, g_c = p_e.grad, grads_c[name].grad
        assert (g_c is None) == (g_e is None), f"{name}: gradient {g_c is not None} vs eager {g_e is not None}"
        if g_e is not None:
            _as_close_as_eager(g_c, g_e, lambda name=name: exact.grads(w)[name], rtol * 10, atol * 10, f"{name}.grad")
    for i, (t_c, t_e) in enumerate(zip(inputs_c, inputs_e)):
        _as_close_as_eager(t_c.grad, t_e.grad, lambda i=i: exact.grads(w)[i], rtol * 10, atol * 10, "input.grad")
    buffers_c = dict(model.named_buffers())
    for name, b_e in eager.named_buffers():
        torch.testing.assert_close(buffers_c[name], b_e, rtol=rtol, atol=atol, msg=lambda m: f"buffer {name}: {m}")
