"""The tolerances fxopt promises, per dtype, against eager PyTorch.

Rewrites change the order of floating-point operations (BatchNorm folded into
weights, fused epilogues, other convolution algorithms), so results are equal
up to rounding. These are the bounds the tests and ``verify=True`` hold every
rewrite to; algorithm-specific bounds (Winograd, FFT) are in docs/NUMERICS.md
and ``fxopt.conv_algorithms``.

| dtype    | rtol  | atol  |
|----------|-------|-------|
| float64  | 1e-7  | 1e-9  |
| float32  | 1e-4  | 1e-5  |
| float16  | 1e-2  | 1e-3  |
| bfloat16 | 5e-2  | 1e-2  |

On CUDA, float32 convolutions and matrix products run in TF32 exactly as eager does
(``torch.backends.cudnn.allow_tf32``, on by default), so eager itself is only ~1e-3 from the
float64 result there; GPU comparisons of float32 graphs use rtol 1e-3. Algorithm choices
are judged against a float64 convolution instead (``fxopt.autotune``).

The cuda executor's generated Winograd candidate (``backends/cuda/kernels/winograd.py``: F(2x2, 3x3)
with transforms, product and accumulation in fp32 for every dtype) has the numerics of
``winograd_2x2_3x3`` computed in fp32 (docs/NUMERICS.md: 1.8e-6 max abs error in fp32, at the
output's rounding in fp16/bf16) and is held to that algorithm's bound of the conv's dtype
(``kernels.winograd.tolerance``: fp32 (1e-3, 3e-3), fp16 (1e-2, 1e-2), bf16 (4e-2, 8e-2)); the
executor's measuring keeps it only where its relative error is within 1e-3 (fp32) / 1e-2 (16-bit).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

TOLERANCES = {
    torch.float64: (1e-7, 1e-9),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES.get(dtype, (0.0, 0.0))


def _flatten(x: Any) -> list:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    return [x]


def max_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| in float64 (``ref`` moved to ``a``'s device; NaN where both are NaN counts 0, a
    NaN on one side inf): a result's error against an exact one. Where fxopt's result is off eager's
    by more than the tolerance, fxopt passes if its error is at most twice eager's plus the absolute
    tolerance (the fuzzer, the region check and the training check all judge so)."""
    ref = ref.detach().to(a.device)
    d = (a.detach().double() - ref.double()).abs()
    d = torch.where(torch.isnan(a.detach().double()) & torch.isnan(ref.double()), 0.0, d)
    return float(d.nan_to_num(float("inf")).max()) if d.numel() else 0.0


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (0 when both are empty)."""
    if ref.numel() == 0:
        return 0.0
    ref64, got64 = ref.detach().double(), got.detach().double()
    scale = ref64.abs().max().item() or 1.0
    return (got64 - ref64).abs().max().item() / scale


def tensor_pairs(got: Any, ref: Any):
    """(index, got tensor, ref tensor) for every output of ``ref`` that is a tensor, after checking
    that the outputs agree in number, that non-tensor outputs are equal and that tensors have
    ``ref``'s shape and dtype; a string (what differs) instead where they do not."""
    g, r = _flatten(got), _flatten(ref)
    if len(g) != len(r):
        return f"{len(g)} outputs instead of {len(r)}"
    pairs = []
    for i, (a, b) in enumerate(zip(g, r)):
        if not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {i}: {a!r} != {b!r}"
            continue
        if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {getattr(a, 'shape', a)}/{getattr(a, 'dtype', '')} vs {b.shape}/{b.dtype}"
        pairs.append((i, a, b))
    return pairs


def whole_tensors_differ(got: Any, ref: Any, rtol_of) -> Optional[str]:
    """None where every output agrees as ``tensor_pairs`` checks, NaNs stand where ``ref``'s do and
    the max-norm relative error of the finite values (``relative_error``) is within ``rtol_of(ref
    tensor)``; else what differs. Integer and bool outputs must be equal."""
    pairs = tensor_pairs(got, ref)
    if isinstance(pairs, str):
        return pairs
    for i, a, b in pairs:
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return f"output {i}: values differ"
            continue
        if not torch.equal(a.isnan(), b.isnan()):
            return f"output {i}: NaNs differ"
        finite = b.isfinite()
        err = relative_error(torch.where(finite, a, 0), torch.where(finite, b, 0))
        rtol = rtol_of(b)
        if not err <= rtol:
            return f"output {i}: relative error {err:.3g} > {rtol:g}"
    return None


def outputs_close(got: Any, ref: Any) -> Optional[str]:
    """None when every tensor in `got` matches `ref` within tolerance, else a description."""
    pairs = tensor_pairs(got, ref)
    if isinstance(pairs, str):
        return pairs
    for i, a, b in pairs:
        rtol, atol = tolerance(b.dtype)
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError:
            return f"output {i}: relative error {relative_error(a, b):.3g} (rtol {rtol}, atol {atol})"
    return None
