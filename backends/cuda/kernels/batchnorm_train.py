"""cuDNN's fused training BatchNorm: normalization + (residual add +) ReLU in one kernel, and its
backward with the ReLU's (and the add's) gradient in one kernel.

Why: PyTorch calls cuDNN's batch normalization without its activation, so a training step runs
BatchNorm, then a ReLU over the whole activation (and an add before it in a residual block), and
in the backward the ReLU's gradient before BatchNorm's. cuDNN's extended BatchNorm
(``cudnnBatchNormalizationForwardTrainingEx`` / ``BackwardEx`` with ``CUDNN_BATCHNORM_OPS_BN_ACTIVATION``
or ``..._BN_ADD_ACTIVATION``) does the add and the ReLU inside its NHWC kernels: one read and one
write of the activation less in each direction. PyTorch exposes neither call, so this module calls
the cuDNN library PyTorch itself loaded, through ctypes; PyTorch's allocator provides every buffer
and its current stream orders the calls (CUDA-graph capture included).

Requirements (checked by ``probe``, which runs both calls once on the real shapes): a CUDA
device, a 4-D float16/bfloat16 input stored channels_last, float32 weight, bias and running
statistics (autocast's mixed precision), and a configuration cuDNN's persistent NHWC mode accepts.

Semantics: the outputs of ``_batch_norm_with_update_functional`` followed by the add and the ReLU,
with cuDNN's statistics (what eager computes on the same device): the batch mean, the inverse
standard deviation, and running statistics updated with ``momentum`` and the unbiased variance.
"""
from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Optional

import torch

# cuDNN enums (cudnn_graph.h, cudnn_ops.h)
_DATA = {torch.float16: 2, torch.bfloat16: 9, torch.float32: 0}
_SPATIAL_PERSISTENT = 2
OPS_BN_ACTIVATION, OPS_BN_ADD_ACTIVATION = 1, 2
_ACTIVATION_RELU, _NOT_PROPAGATE_NAN = 1, 0
_P, _I, _D, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_double, ctypes.c_size_t


class CudnnError(RuntimeError):
    """A cuDNN call failed (its status code and name are in the message)."""


_SIGNATURES = {
    "cudnnCreate": [_P],
    "cudnnSetStream": [_P, _P],
    "cudnnGetErrorString": [_I],
    "cudnnCreateTensorDescriptor": [_P],
    "cudnnSetTensor4dDescriptorEx": [_P, _I, _I, _I, _I, _I, _I, _I, _I, _I],
    "cudnnDeriveBNTensorDescriptor": [_P, _P, _I],
    "cudnnCreateActivationDescriptor": [_P],
    "cudnnSetActivationDescriptor": [_P, _I, _I, _D],
    "cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize": [_P, _I, _I, _P, _P, _P, _P, _P, _P],
    "cudnnGetBatchNormalizationBackwardExWorkspaceSize": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P],
    "cudnnGetBatchNormalizationTrainingExReserveSpaceSize": [_P, _I, _I, _P, _P, _P],
    "cudnnBatchNormalizationForwardTrainingEx": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _D,
                                                 _P, _P, _D, _P, _P, _P, _P, _S, _P, _S],
    "cudnnBatchNormalizationBackwardEx": [_P, _I, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,
                                          _P, _P, _P, _P, _P, _D, _P, _P, _P, _P, _S, _P, _S],
}


@functools.lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    """The cuDNN library this process's PyTorch loaded (the one its own kernels use), with the
    signatures of the functions used here. Loading needs no device; every call but the error
    strings does."""
    if not torch.backends.cudnn.is_available():
        raise CudnnError("this PyTorch has no cuDNN")
    torch.backends.cudnn.version()  # makes PyTorch load it
    lib = None
    with open("/proc/self/maps") as maps:
        paths = [line.split()[-1] for line in maps if "libcudnn.so" in line]
    for name in [p for p in paths if os.path.basename(p).startswith("libcudnn.so")] + ["libcudnn.so.9"]:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise CudnnError("libcudnn.so not found in this process")
    for fn, args in _SIGNATURES.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = ctypes.c_int
    lib.cudnnGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CudnnError(f"{what}: cuDNN status {status} ({_lib().cudnnGetErrorString(status).decode()})")


_handles = threading.local()


def _handle(device: torch.device) -> ctypes.c_void_p:
    """This thread's cuDNN handle for ``device``, bound to PyTorch's current stream."""
    if not torch.cuda.is_available():
        raise CudnnError("cuDNN needs a CUDA device")
    cache = getattr(_handles, "by_device", None)
    if cache is None:
        cache = _handles.by_device = {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    h = cache.get(index)
    if h is None:
        h = ctypes.c_void_p()
        with torch.cuda.device(index):
            _check(_lib().cudnnCreate(ctypes.byref(h)), "cudnnCreate")
        cache[index] = h
    _check(_lib().cudnnSetStream(h, ctypes.c_void_p(torch.cuda.current_stream(index).cuda_stream)),
           "cudnnSetStream")
    return h


@functools.lru_cache(maxsize=1024)
def _tensor_desc(dtype: torch.dtype, shape: tuple, strides: tuple) -> ctypes.c_void_p:
    d = ctypes.c_void_p()
    _check(_lib().cudnnCreateTensorDescriptor(ctypes.byref(d)), "cudnnCreateTensorDescriptor")
    _check(_lib().cudnnSetTensor4dDescriptorEx(d, _DATA[dtype], *shape, *strides), "cudnnSetTensor4dDescriptorEx")
    return d


@functools.lru_cache(maxsize=1024)
def _bn_desc(x_desc_key: tuple) -> ctypes.c_void_p:
    d = ctypes.c_void_p()
    _check(_lib().cudnnCreateTensorDescriptor(ctypes.byref(d)), "cudnnCreateTensorDescriptor")
    _check(_lib().cudnnDeriveBNTensorDescriptor(d, _tensor_desc(*x_desc_key), _SPATIAL_PERSISTENT),
           "cudnnDeriveBNTensorDescriptor")
    return d


@functools.lru_cache(maxsize=1)
def _relu_desc() -> ctypes.c_void_p:
    d = ctypes.c_void_p()
    _check(_lib().cudnnCreateActivationDescriptor(ctypes.byref(d)), "cudnnCreateActivationDescriptor")
    _check(_lib().cudnnSetActivationDescriptor(d, _ACTIVATION_RELU, _NOT_PROPAGATE_NAN, 0.0),
           "cudnnSetActivationDescriptor")
    return d


def _key(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), tuple(t.stride()))


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _ptr(t: Optional[torch.Tensor]) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None and t.numel() else None)


_ONE, _ZERO = ctypes.c_float(1.0), ctypes.c_float(0.0)


@functools.lru_cache(maxsize=1024)
def _sizes(ops: int, xk: tuple, device_index: int) -> tuple:
    """(forward workspace, backward workspace, reserve) bytes for an input of key ``xk`` (dtype,
    shape, strides): asked once per shape, not per call."""
    h = _handle(torch.device("cuda", device_index))
    xd, bd, act = _tensor_desc(*xk), _bn_desc(xk), _relu_desc()
    zd = xd if ops == OPS_BN_ADD_ACTIVATION else None
    fw, bw, rs = _S(), _S(), _S()
    lib = _lib()
    _check(lib.cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize(
        h, _SPATIAL_PERSISTENT, ops, xd, zd, xd, bd, act, ctypes.byref(fw)), "forward workspace size")
    _check(lib.cudnnGetBatchNormalizationBackwardExWorkspaceSize(
        h, _SPATIAL_PERSISTENT, ops, xd, xd, xd, zd, xd, bd, act, ctypes.byref(bw)), "backward workspace size")
    _check(lib.cudnnGetBatchNormalizationTrainingExReserveSpaceSize(
        h, _SPATIAL_PERSISTENT, ops, act, xd, ctypes.byref(rs)), "reserve space size")
    return fw.value, bw.value, rs.value


def forward(x, z, weight, bias, running_mean, running_var, momentum: float, eps: float, in_place: bool = False):
    """relu(batch_norm(x) (+ z)): (y, save_mean, save_invstd, reserve, new_running_mean,
    new_running_var); ``y`` channels_last, the running statistics new tensors, or with
    ``in_place`` ``running_mean`` and ``running_var`` themselves, updated (as eager updates them)."""
    ops = OPS_BN_ADD_ACTIVATION if z is not None else OPS_BN_ACTIVATION
    x = _nhwc(x)
    z = _nhwc(z) if z is not None else None
    h = _handle(x.device)
    xk = _key(x)
    fw, _, rs = _sizes(ops, xk, x.device.index)
    xd, bd = _tensor_desc(*xk), _bn_desc(xk)
    c = x.shape[1]
    y = torch.empty_like(x, memory_format=torch.channels_last)
    save_mean = torch.empty(c, device=x.device, dtype=torch.float32)
    save_invstd = torch.empty_like(save_mean)
    new_mean, new_var = (running_mean, running_var) if in_place else (running_mean.clone(), running_var.clone())
    work = torch.empty(fw, device=x.device, dtype=torch.uint8)
    reserve = torch.empty(rs, device=x.device, dtype=torch.uint8)
    _check(_lib().cudnnBatchNormalizationForwardTrainingEx(
        h, _SPATIAL_PERSISTENT, ops, ctypes.byref(_ONE), ctypes.byref(_ZERO),
        xd, _ptr(x), xd if z is not None else None, _ptr(z), xd, _ptr(y),
        bd, _ptr(weight), _ptr(bias), momentum, _ptr(new_mean), _ptr(new_var), eps,
        _ptr(save_mean), _ptr(save_invstd), _relu_desc(), _ptr(work), fw, _ptr(reserve), rs),
        "cudnnBatchNormalizationForwardTrainingEx")
    return y, save_mean, save_invstd, reserve, new_mean, new_var


def backward(dy, x, y, weight, bias, save_mean, save_invstd, reserve, eps: float, with_add: bool):
    """(dx, dweight, dbias, dz): the gradients of ``forward``'s inputs (``dz`` empty without the add)."""
    ops = OPS_BN_ADD_ACTIVATION if with_add else OPS_BN_ACTIVATION
    x, y, dy = _nhwc(x), _nhwc(y), _nhwc(dy)
    h = _handle(x.device)
    xk = _key(x)
    _, bw, rs = _sizes(ops, xk, x.device.index)
    if reserve.numel() != rs:
        raise CudnnError(f"reserve space of {reserve.numel()} bytes, cuDNN needs {rs}")
    xd, bd = _tensor_desc(*xk), _bn_desc(xk)
    dx = torch.empty_like(x, memory_format=torch.channels_last)
    dz = torch.empty_like(x, memory_format=torch.channels_last) if with_add else x.new_empty(0)
    dw, db = torch.empty_like(weight), torch.empty_like(bias)
    work = torch.empty(bw, device=x.device, dtype=torch.uint8)
    _check(_lib().cudnnBatchNormalizationBackwardEx(
        h, _SPATIAL_PERSISTENT, ops, ctypes.byref(_ONE), ctypes.byref(_ZERO), ctypes.byref(_ONE),
        ctypes.byref(_ZERO), xd, _ptr(x), xd, _ptr(y), xd, _ptr(dy), xd if with_add else None, _ptr(dz),
        xd, _ptr(dx), bd, _ptr(weight), _ptr(bias), _ptr(dw), _ptr(db), eps, _ptr(save_mean),
        _ptr(save_invstd), _relu_desc(), _ptr(work), bw, _ptr(reserve), rs),
        "cudnnBatchNormalizationBackwardEx")
    return dx, dw, db, dz


@functools.lru_cache(maxsize=256)
def probe(shape: tuple, dtype: torch.dtype, with_add: bool, device_index: int = 0) -> tuple:
    """(reserve bytes, None) where cuDNN runs the fused forward and backward for this input shape
    and dtype (both run once on random data; the forward's output is checked against PyTorch's
    unfused ops), or (None, why not)."""
    if dtype not in (torch.float16, torch.bfloat16) or len(shape) != 4:
        return None, f"cuDNN fuses the activation for 4-D float16/bfloat16 inputs, not {len(shape)}-D {dtype}"
    if not torch.cuda.is_available():
        return None, "cuDNN needs a CUDA device"
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.no_grad():
            return _probe(shape, dtype, with_add, torch.device("cuda", device_index))
    except (CudnnError, RuntimeError, OSError) as e:
        return None, f"cuDNN declines: {str(e).splitlines()[0][:160]}"


def _probe(shape: tuple, dtype: torch.dtype, with_add: bool, dev: torch.device) -> tuple:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = _nhwc(torch.randn(shape, device=dev, generator=gen).to(dtype))
    z = _nhwc(torch.randn(shape, device=dev, generator=gen).to(dtype)) if with_add else None
    c = shape[1]
    w, b = torch.rand(c, device=dev) + 0.5, torch.randn(c, device=dev)
    rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
    y, sm, sr, reserve, _, _ = forward(x, z, w, b, rm, rv, 0.1, 1e-5)
    dy = torch.randn(shape, device=dev, generator=gen).to(dtype)
    backward(dy, x, y, w, b, sm, sr, reserve, 1e-5, with_add)
    ref = torch.nn.functional.batch_norm(x.float(), None, None, w, b, True, 0.1, 1e-5)
    ref = torch.relu(ref + z.float() if z is not None else ref)
    if not torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2):
        return None, "cuDNN's fused result differs from PyTorch's"
    torch.cuda.synchronize(dev)
    return reserve.numel(), None
