"""Sources of the linear-layer kernels over few rows (a classifier head at small batch).

- ``generate_linear``: one layer, ``act(x @ w.T + bias)``: each weight row read with 16-byte loads,
  every row of ``x`` accumulated in fp32, the lanes of a warp summed with shuffles, bias and
  activation applied before the only store.
- ``generate_linear_chain``: a chain of such layers as ONE kernel of one thread block: every warp
  takes output features of a layer in turn, the activations between layers stay in shared memory
  and ``__syncthreads()`` separates the layers.

Which nodes get them: ``schedule/linear.py``; launching them: ``runtime/launch.py``.
"""
from __future__ import annotations

from string import Template

import torch

from . import Epilogue, KernelSource, _uname
from .templates import ctype, load, prelude

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MAX_ROWS = 16


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


_SMEM_FLOATS = 6144          # two activation buffers of MR x N floats: 48 KiB static shared memory
BLOCK = 1024
MAX_LAYERS = 8


def generate_linear_chain(layers: list, rows: int, dtype: torch.dtype = torch.float32,
                          block: int = BLOCK) -> KernelSource:
    """layers: [(K, N, Epilogue)], each K the previous N. Launch args: x, (w_i, [b_i]) per layer,
    y, M (M <= rows). Grid: one block."""
    if not 2 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"linear chain: {len(layers)} layers, the template takes 2..{MAX_LAYERS}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"linear chain: {rows} rows, at most {MAX_ROWS}")
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError("linear chain: block must be a multiple of 32, at most 1024")
    for i, (k, n, epi) in enumerate(layers):
        if min(k, n) < 1 or epi.residual:
            raise ValueError(f"linear chain: layer {i} (K={k}, N={n}) must be positive and take no residual")
        if i and k != layers[i - 1][1]:
            raise ValueError(f"linear chain: layer {i} takes K={k}, the previous layer gives {layers[i - 1][1]}")
    nmax = max(n for _, n, _ in layers[:-1])
    if 2 * rows * nmax > _SMEM_FLOATS:
        raise ValueError(f"linear chain: {rows} x {nmax} activations exceed the shared-memory budget")
    ct, last = ctype(dtype), len(layers) - 1
    layer_t = load("linear_chain_layer.cu")
    body, params = [], []
    for i, (k, n, epi) in enumerate(layers):
        vec = vector_width(k, dtype)
        if i == 0:  # the input from global memory, a vector load per row
            acc = (f"          const fx_vec<{ct}, {vec}> xv = *reinterpret_cast<const fx_vec<{ct}, {vec}>*>"
                   f"(x + (long long)m * {k} + k);\n"
                   f"#pragma unroll\n          for (int e = 0; e < {vec}; ++e) "
                   f"part[m] += fx_to_f32(xv.v[e]) * fx_to_f32(wv.v[e]);")
        else:
            acc = (f"#pragma unroll\n          for (int e = 0; e < {vec}; ++e) "
                   f"part[m] += act_[{(i - 1) % 2}][m * {k} + k + e] * fx_to_f32(wv.v[e]);")
        store = (f"        y[(long long)m * {n} + n] = fx_from<{ct}>(acc);" if i == last else
                 f"        act_[{i % 2}][m * {n} + n] = fx_to_f32(fx_from<{ct}>(acc));  // stored as {ct}")
        body.append(layer_t.substitute(
            l=i, K=k, N=n, MR=rows, VEC=vec, T=ct, WARPS=block // 32, epi_desc=epi.describe(),
            accumulate=acc, store=store, epilogue=epi.code(" " * 8, f"fx_to_f32(b{i}[n])", "")))
        params += [(f"w{i}", f"const {ct}*")] + [(f"b{i}", f"const {ct}*")] * epi.bias
    desc = "; ".join(f"{k}->{n} {epi.describe()}" for k, n, epi in layers)
    name = _uname(f"fx_linear_chain{len(layers)}_r{rows}_{_SHORT[dtype]}", tuple(layers), rows, dtype, block)
    src = Template(load("linear_chain.cu").template).substitute(
        prelude=prelude({dtype}), L=len(layers), last=last, K0=layers[0][0], NLAST=layers[-1][1], MR=rows,
        NMAX=nmax, block=block, name=name, T=ct, desc=desc,
        params="".join(f", {t} __restrict__ {p}" for p, t in params), layers="\n".join(body))
    params = [("x", f"const {ct}*")] + params + [("y", f"{ct}*"), ("M", "long long")]
    meta = {"layers": tuple(layers), "rows": rows, "dtype": dtype, "vec0": vector_width(layers[0][0], dtype)}
    return KernelSource(name, src, tuple(params), "linear_chain", meta, (block, 1, 1), False)
