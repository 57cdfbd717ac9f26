"""Linear layers over few rows (a classifier head at small batch), epilogue fused.

Why: at batch 1..16 a ``fused_linear`` (``act(x @ w.T + bias)``) is a matrix-vector product: the
time is reading the weight once. cuBLAS runs it as a GEMM or GEMV kernel and the bias/activation
as another kernel (ReLU after ``addmm``), so a three-layer head is five or six launches, each a
few microseconds of latency that a CUDA graph still pays on the GPU. One generated kernel per
layer reads each weight row with 16-byte loads, accumulates every row of ``x`` in fp32, sums
the lanes of a warp with shuffles and applies bias and activation before its only store.

- ``generate_linear``: the kernel source (fp32/fp16/bf16, fp32 accumulation, any activation of
  the epilogue vocabulary, K a multiple of the vector width chosen from K).
- ``LinearRows`` / ``plan_linear``: a candidate for a ``fused_linear`` node whose input is 2-D
  with at most ``MAX_ROWS`` static rows, weight (N, K) in the input's dtype. Larger batches are
  GEMMs that cuBLAS runs better, and each candidate costs an NVRTC compilation and a measurement.

Which implementation runs is measured by the executor like every other candidate. The
candidate returns ``None`` (the reference runs) when the tensors it gets at run time are not
what it was generated for: other sizes, dtypes, non-contiguous or misaligned memory.
"""
from __future__ import annotations

from string import Template
from typing import Optional

import torch
import torch.fx as fx

from fxopt.ops import fused_linear_ref

from .codegen import Epilogue, KernelSource, _uname
from .templates import ctype, load, prelude

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MAX_ROWS = 16
_MAX_GRID = 2 ** 31 - 1


def vector_width(k: int, dtype: torch.dtype) -> int:
    """Elements per load: the widest of 16/8/4/2 bytes (or one element) that divides K."""
    size = torch.empty((), dtype=dtype).element_size()
    return max(v for v in (8, 4, 2, 1) if v * size <= 16 and k % v == 0)


def row_capacity(m: int) -> int:
    """Rows a kernel is generated for: the next power of two >= m (so batch 3 and 4 share one)."""
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"linear: {m} rows, the template takes 1..{MAX_ROWS}")
    return 1 << (int(m) - 1).bit_length()


def generate_linear(k: int, n: int, rows: int, dtype: torch.dtype = torch.float32,
                    epilogue: Epilogue | None = None, features_per_warp: int = 1,
                    block: int = 128) -> KernelSource:
    """Launch args: x, w, [bias], y, M (M <= rows). Grid: ceil(N / (block / 32 * features_per_warp))."""
    K, N, MR, NW = int(k), int(n), int(rows), int(features_per_warp)
    if min(K, N) < 1:
        raise ValueError("linear: K and N must be positive")
    if MR < 1 or MR > MAX_ROWS or MR * NW > 32 or NW < 1:
        raise ValueError(f"linear: rows {MR} x features per warp {NW} must fit one warp's lanes")
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError("linear: block must be a multiple of 32, at most 1024")
    epi = epilogue or Epilogue()
    if epi.residual:
        raise ValueError("linear: no residual input")
    ct, vec = ctype(dtype), vector_width(K, dtype)
    name = _uname(f"fx_linear_k{K}_n{N}_r{MR}_{_SHORT[dtype]}", K, N, MR, NW, epi, block, vec)
    src = Template(load("linear_rows.cu").template).substitute(
        prelude=prelude({dtype}), K=K, N=N, MR=MR, NW=NW, VEC=vec, T=ct, block=block, name=name,
        extra_params=epi.params(ct), epi_desc=epi.describe(),
        epilogue=epi.code(" " * 8, "fx_to_f32(bias[n])", ""))
    params = [("x", f"const {ct}*"), ("w", f"const {ct}*")] + [("bias", f"const {ct}*")] * epi.bias
    params += [("y", f"{ct}*"), ("M", "long long")]
    meta = {"k": K, "n": N, "rows": MR, "features_per_warp": NW, "vec": vec, "epilogue": epi, "dtype": dtype}
    return KernelSource(name, src, tuple(params), "linear_rows", meta, (block, 1, 1), False)


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


def launch_linear(ks: KernelSource, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  bias: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """``out`` (M, N) = act(x @ w.T + bias); checks sizes, dtypes, contiguity and alignment."""
    from .launch import _kernel

    m = ks.meta
    K, N, dt = m["k"], m["n"], m["dtype"]
    if x.dim() != 2 or x.shape[1] != K or tuple(w.shape) != (N, K) or tuple(out.shape) != (x.shape[0], N):
        raise ValueError(f"{ks.name}: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} "
                         f"do not match K={K}, N={N}")
    if x.shape[0] > m["rows"]:
        raise ValueError(f"{ks.name}: {x.shape[0]} rows, generated for at most {m['rows']}")
    if (bias is not None) != m["epilogue"].bias:
        raise ValueError(f"{ks.name}: bias {'missing' if bias is None else 'unexpected'}")
    tensors = [("x", x), ("w", w), ("out", out)] + ([("bias", bias)] if bias is not None else [])
    for what, t in tensors:
        if t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"{ks.name}: {what} must be a contiguous {dt} tensor")
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{ks.name}: bias of shape {tuple(bias.shape)}, expected ({N},)")
    vbytes = m["vec"] * x.element_size()
    if not (_aligned(x, vbytes) and _aligned(w, vbytes)):
        raise ValueError(f"{ks.name}: x and w must be {vbytes}-byte aligned")
    if out.numel() == 0:
        return out
    per_block = ks.block[0] // 32 * m["features_per_warp"]
    grid = (min(-(-N // per_block), _MAX_GRID), 1, 1)
    args = [x, w] + ([bias] if bias is not None else []) + [out, int(x.shape[0])]
    _kernel(ks, kernel).launch(grid, ks.block, args)
    return out


class LinearRows:
    """Candidate for a fused_linear node (same signature)."""

    def __init__(self, name: str, spec: dict):
        self.name, self.spec, self.label = name, spec, "linear"
        self.sources = {0: generate_linear(spec["k"], spec["n"], spec["rows"], spec["dtype"], spec["epilogue"])}
        self.kernels: dict = {}

    def __call__(self, x, weight, bias, activation, act_params):
        s, ks, kernel = self.spec, self.sources[0], self.kernels.get(0)
        if kernel is None or not x.is_cuda or x.dim() != 2 or x.shape[0] > s["rows"] or x.shape[1] != s["k"]:
            return None
        if x.dtype != s["dtype"] or weight.dtype != x.dtype or tuple(weight.shape) != (s["n"], s["k"]):
            return None
        if not (x.is_contiguous() and weight.is_contiguous()):
            return None
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            return None
        vbytes = ks.meta["vec"] * x.element_size()
        if not (_aligned(x, vbytes) and _aligned(weight, vbytes)):
            return None
        out = torch.empty((x.shape[0], s["n"]), dtype=x.dtype, device=x.device)
        return launch_linear(ks, x, weight, out, bias, kernel)


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def plan_linear(node: fx.Node) -> Optional[LinearRows]:
    """A candidate for a fused_linear node over at most MAX_ROWS rows; None where none applies."""
    if node.op != "call_function" or node.target is not fused_linear_ref or len(node.args) != 5:
        return None
    x, w, out = _val(node.args[0]), _val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 2 or w.dim() != 2 or x.dtype not in _DTYPES:
        return None  # batched (3-D) inputs, or another dtype
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return None  # symbolic sizes
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return None  # a real GEMM: cuBLAS
    if w.dtype != x.dtype or out.dtype != x.dtype or not x.is_contiguous() or not w.is_contiguous():
        return None
    bias, act, act_params = node.args[2], node.args[3], node.args[4]
    if bias is not None and (_val(bias) is None or _val(bias).dtype != x.dtype or _val(bias).dim() != 1):
        return None
    spec = {"k": int(x.shape[1]), "n": int(w.shape[0]), "rows": row_capacity(int(x.shape[0])), "dtype": x.dtype,
            "epilogue": Epilogue(bias is not None, False, None if act == "none" else (act, tuple(act_params)))}
    return LinearRows(f"linear_{node.name}", spec)
