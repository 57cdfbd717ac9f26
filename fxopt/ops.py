"""fxopt's fused operators, as ``torch.library`` custom ops.

The passes replace chains of ATen ops by these nodes; keeping them as custom
ops (with a fake implementation) keeps every rewritten graph traceable:
FakeTensor propagation, ``graph.lint()``, re-export through AOTAutograd and
ONNX export all see an ordinary operator.

``fxopt::fused_conv``::

    y = conv(x, weight, bias, stride, padding, dilation, groups)   # by `algorithm`
    if residual is not None: y = y + residual
    y = activation(y, *act_params)

``fxopt::fused_linear``::

    y = activation(x @ weight.T + bias, *act_params)

``fxopt::batch_norm_relu`` / ``fxopt::batch_norm_relu_backward`` are training BatchNorm with its
ReLU (and a residual add before it) and their joint gradient::

    y = relu(batch_norm(x, weight, bias, training=True) (+ z))  # with the new running statistics

``backend="cudnn"`` runs cuDNN's fused kernels, which the cuda side registers for the "cuda"
dispatch key (``torch.library.register_kernel``, in ``fxopt.backends.cuda_entry.register_kernels``,
called when a CUDA target is built: never on import); ``"native"`` PyTorch's native BatchNorm
kernels and separate ops (any device).

``fxopt::prepack_conv_weight`` is the weight-only half of an algorithm
(Winograd filter transform, FFT kernel spectrum...). It only ever depends on
weights, so under freezing it is evaluated once at compile time.

The reference implementations here run anywhere (CPU, CUDA) with plain torch
operators (the convolution algorithms' math is ``fxopt.conv_algorithms``); the
executors in ``fxopt.backends`` may replace them with faster kernels, but never
change what they compute. This module imports nothing from ``fxopt.backends``.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

#: activation name -> (function(x, params), number of float params)
ACTIVATIONS = {
    "none": (lambda x, p: x, 0),
    "relu": (lambda x, p: F.relu(x), 0),
    "hardtanh": (lambda x, p: F.hardtanh(x, p[0], p[1]), 2),
    "leaky_relu": (lambda x, p: F.leaky_relu(x, p[0]), 1),
    "silu": (lambda x, p: F.silu(x), 0),
    "gelu": (lambda x, p: F.gelu(x), 0),
    "gelu_tanh": (lambda x, p: F.gelu(x, approximate="tanh"), 0),
    "hardswish": (lambda x, p: F.hardswish(x), 0),
    "hardsigmoid": (lambda x, p: F.hardsigmoid(x), 0),
    "sigmoid": (lambda x, p: torch.sigmoid(x), 0),
    "tanh": (lambda x, p: torch.tanh(x), 0),
}


def apply_activation(y: Tensor, activation: str, act_params: Sequence[float]) -> Tensor:
    fn, nparams = ACTIVATIONS[activation]
    if len(act_params) != nparams:
        raise ValueError(f"activation {activation!r} takes {nparams} params, got {list(act_params)}")
    return fn(y, act_params)


def direct_conv(x, weight, bias, stride, padding, dilation, groups):
    from fxopt.conv_algorithms import library_conv  # cuDNN's search for grouped convs (see there)

    return library_conv(x, weight, bias, stride, padding, dilation, groups)


def conv_by_algorithm(x, weight, bias, stride, padding, dilation, groups, algorithm, prepacked):
    """The convolution part of fused_conv (no epilogue), by the chosen algorithm."""
    if algorithm == "direct":
        return direct_conv(x, weight, bias, stride, padding, dilation, groups)
    from fxopt.conv_algorithms import get_algorithm

    algo = get_algorithm(algorithm)
    sig = conv_sig_of(x, weight, stride, padding, dilation, groups)
    y = algo.run(x, weight, prepacked, bias, sig)
    # the memory format the fake implementation promises: the direct convolution's (a Winograd or
    # FFT result comes out contiguous where PyTorch's convolution gives channels_last, e.g. for a
    # channels_last weight; GPU fuzz eaa5b52212: an output of other strides than the graph's)
    want = _direct_strides(tuple(x.shape), tuple(x.stride()), tuple(weight.shape), tuple(weight.stride()),
                           x.dtype, x.device.type, tuple(stride), tuple(padding), tuple(dilation), int(groups))
    if not all(n == 1 or a == b for n, a, b in zip(y.shape, y.stride(), want)):
        y = torch.empty_strided(y.shape, want, dtype=y.dtype, device=y.device).copy_(y)
    return y


@functools.lru_cache(maxsize=4096)
def _direct_strides(x_shape, x_strides, w_shape, w_strides, dtype, device_type, stride, padding, dilation, groups):
    """The strides of PyTorch's convolution of such operands (its output's memory format), from a
    run on fake tensors of the device's type; once per signature."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    with unset_fake_temporarily(), FakeTensorMode():
        x = torch.empty_strided(x_shape, x_strides, dtype=dtype, device=device_type)
        w = torch.empty_strided(w_shape, w_strides, dtype=dtype, device=device_type)
        return tuple(direct_conv(x, w, None, list(stride), list(padding), list(dilation), groups).stride())


def conv_sig_of(x: Tensor, weight: Tensor, stride, padding, dilation, groups, batch_symbolic=False):
    """The ConvSig of a convolution, from its (real or fake) operands."""
    from fxopt.conv_algorithms import ConvSig

    def _int(v):
        if isinstance(v, torch.SymInt) and v.node.maybe_as_int() is None:
            return None  # symbolic: int() would specialize it
        try:
            return int(v)
        except Exception:  # unbacked / symbolic size
            return None

    xs = tuple(_int(s) for s in x.shape)
    if batch_symbolic:
        xs = (None,) + xs[1:]
    cl = x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    return ConvSig(
        x_shape=xs,
        w_shape=tuple(int(s) for s in weight.shape),
        stride=tuple(stride),
        padding=tuple(padding),
        dilation=tuple(dilation),
        groups=int(groups),
        dtype=x.dtype,
        device_type=x.device.type,
        channels_last=cl,
    )


def fused_conv_ref(x, weight, bias, residual, stride, padding, dilation, groups,
                   activation, act_params, algorithm="direct", prepacked=None):
    y = conv_by_algorithm(x, weight, bias, stride, padding, dilation, groups, algorithm, prepacked)
    if residual is not None:
        y = y + residual
    return apply_activation(y, activation, act_params)


def conv_epilogue_ref(y, bias, residual, activation, act_params):
    """The epilogue of ``fused_conv`` on its own: ``act(y + bias[c] (+ residual))``. The cuda
    executor splits a fused conv into the convolution and this where every consumer of its output
    is a generated kernel, which then computes the epilogue where it reads the value."""
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * (y.dim() - 2))
    if residual is not None:
        y = y + residual
    return apply_activation(y, activation, act_params)


def fused_linear_ref(x, weight, bias, activation, act_params):
    return apply_activation(F.linear(x, weight, bias), activation, act_params)


@torch.library.custom_op("fxopt::fused_conv", mutates_args=())
def fused_conv(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    residual: Optional[Tensor],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    activation: str,
    act_params: list[float],
    algorithm: str,
    prepacked: Optional[Tensor],
) -> Tensor:
    return fused_conv_ref(x, weight, bias, residual, stride, padding, dilation, groups,
                          activation, act_params, algorithm, prepacked)


@fused_conv.register_fake
def _fused_conv_fake(x, weight, bias, residual, stride, padding, dilation, groups,
                     activation, act_params, algorithm, prepacked):
    # Shapes, dtype and memory format are those of the direct convolution.
    y = direct_conv(x, weight, bias, stride, padding, dilation, groups)
    if residual is not None:
        y = y + residual
    return apply_activation(y, activation, act_params)


@torch.library.custom_op("fxopt::fused_linear", mutates_args=())
def fused_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, act_params: list[float]
) -> Tensor:
    return fused_linear_ref(x, weight, bias, activation, act_params)


@fused_linear.register_fake
def _fused_linear_fake(x, weight, bias, activation, act_params):
    return fused_linear_ref(x, weight, bias, activation, act_params)


@torch.library.custom_op("fxopt::prepack_conv_weight", mutates_args=())
def prepack_conv_weight(
    weight: Tensor,
    algorithm: str,
    x_shape: list[int],
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    x_dtype: torch.dtype,
    channels_last: bool,
) -> Tensor:
    from fxopt.conv_algorithms import ConvSig, get_algorithm

    sig = ConvSig(tuple(None if s < 0 else s for s in x_shape), tuple(weight.shape), tuple(stride),
                  tuple(padding), tuple(dilation), groups, x_dtype, weight.device.type, channels_last)
    out = get_algorithm(algorithm).prepare(weight, sig)
    if out is None:
        raise ValueError(f"algorithm {algorithm!r} has nothing to prepack")
    if out.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        out = out.clone()  # a custom op's output may not alias its input
    return out


@prepack_conv_weight.register_fake
def _prepack_fake(weight, algorithm, x_shape, stride, padding, dilation, groups, x_dtype, channels_last):
    # Run the real transform on a zero weight on the meta device to learn the shape/dtype.
    from fxopt.conv_algorithms import ConvSig, get_algorithm

    sig = ConvSig(tuple(None if s < 0 else s for s in x_shape), tuple(weight.shape), tuple(stride),
                  tuple(padding), tuple(dilation), groups, x_dtype, "cpu", channels_last)
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        probe = get_algorithm(algorithm).prepare(torch.zeros(weight.shape, dtype=weight.dtype, device="meta"), sig)
    return weight.new_empty_strided(probe.shape, probe.stride(), dtype=probe.dtype)


FUSED_CONV = torch.ops.fxopt.fused_conv.default
FUSED_LINEAR = torch.ops.fxopt.fused_linear.default
PREPACK = torch.ops.fxopt.prepack_conv_weight.default


def _channels_last(t: Tensor) -> Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t.contiguous()


def _no_kernel(backend: str, op: str):
    return RuntimeError(f"fxopt::{op} with backend={backend!r} has no kernel for these inputs: the executor that "
                        f"provides it registers it when its target is built (fxopt.backends.cuda_entry)")


def batch_norm_relu_native(x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes):
    """``batch_norm_relu`` with PyTorch's native BatchNorm kernels and separate ops."""
    out, mean, invstd, new_mean, new_var = torch.ops.aten._native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    y = torch.relu(out + z if z is not None else out)
    return (_channels_last(y), mean, invstd, x.new_empty(reserve_bytes, dtype=torch.uint8), new_mean, new_var)


@torch.library.custom_op("fxopt::batch_norm_relu", mutates_args=())
def batch_norm_relu(
    x: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor, z: Optional[Tensor],
    momentum: float, eps: float, reserve_bytes: int, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(y, save_mean, save_invstd, reserve, new_running_mean, new_running_var)."""
    if backend != "native":
        raise _no_kernel(backend, "batch_norm_relu")
    return batch_norm_relu_native(x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes)


#: backend -> the in-place form of batch_norm_relu (``batch_norm_relu_update``) for that backend,
#: registered by the executor that provides the backend's kernels
_UPDATE_KERNELS: dict[str, Callable] = {}


def register_batch_norm_relu_update(backend: str, fn: Callable) -> None:
    """``fn(x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes)`` runs
    ``batch_norm_relu_update`` for ``backend`` (called by the executor that provides it)."""
    _UPDATE_KERNELS[backend] = fn


def batch_norm_relu_update(x: Tensor, weight: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
                           z: Optional[Tensor], momentum: float, eps: float, reserve_bytes: int,
                           backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``batch_norm_relu`` updating ``running_mean`` and ``running_var`` in place, as eager does:
    (y, save_mean, save_invstd, reserve). Not an op of traced graphs (they stay functional): the
    cuda executor's last step puts it in place of ``batch_norm_relu`` and the copies of its new
    statistics into the buffers (``backends/cuda/runtime/running_stats.py``)."""
    if backend != "native":
        if backend not in _UPDATE_KERNELS:
            raise _no_kernel(backend, "batch_norm_relu (in place)")
        return _UPDATE_KERNELS[backend](x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes)
    out, mean, invstd = torch.ops.aten._native_batch_norm_legit(x, weight, bias, running_mean, running_var, True,
                                                                momentum, eps)
    y = torch.relu(out + z if z is not None else out)
    return _channels_last(y), mean, invstd, x.new_empty(reserve_bytes, dtype=torch.uint8)


@batch_norm_relu.register_fake
def _batch_norm_relu_fake(x, weight, bias, running_mean, running_var, z, momentum, eps, reserve_bytes, backend):
    c = x.shape[1]
    stat = x.new_empty(c, dtype=torch.float32)
    return (torch.empty_like(x, memory_format=torch.channels_last), stat, torch.empty_like(stat),
            x.new_empty(reserve_bytes, dtype=torch.uint8), torch.empty_like(running_mean), torch.empty_like(running_var))


def batch_norm_relu_backward_native(grad, x, y, weight, bias, save_mean, save_invstd, eps, with_add):
    """``batch_norm_relu_backward`` with PyTorch's native kernels."""
    g = torch.ops.aten.threshold_backward(grad, y, 0)
    dx, dw, db = torch.ops.aten.native_batch_norm_backward(g, x, weight, None, None, save_mean, save_invstd,
                                                           True, eps, [True, True, True])
    return _channels_last(dx), dw, db, (_channels_last(g) if with_add else x.new_empty(0))


@torch.library.custom_op("fxopt::batch_norm_relu_backward", mutates_args=())
def batch_norm_relu_backward(
    grad: Tensor, x: Tensor, y: Tensor, weight: Tensor, bias: Tensor, save_mean: Tensor, save_invstd: Tensor,
    reserve: Tensor, eps: float, with_add: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad of x, of weight, of bias, of z (empty without the add))."""
    if backend != "native":
        raise _no_kernel(backend, "batch_norm_relu_backward")
    return batch_norm_relu_backward_native(grad, x, y, weight, bias, save_mean, save_invstd, eps, with_add)


@batch_norm_relu_backward.register_fake
def _batch_norm_relu_backward_fake(grad, x, y, weight, bias, save_mean, save_invstd, reserve, eps, with_add,
                                   backend):
    dx = torch.empty_like(x, memory_format=torch.channels_last)
    dz = torch.empty_like(x, memory_format=torch.channels_last) if with_add else x.new_empty(0)
    return dx, torch.empty_like(weight), torch.empty_like(bias), dz


BATCH_NORM_RELU = torch.ops.fxopt.batch_norm_relu.default
BATCH_NORM_RELU_BACKWARD = torch.ops.fxopt.batch_norm_relu_backward.default
