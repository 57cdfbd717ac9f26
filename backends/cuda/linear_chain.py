"""A chain of linear layers over few rows as ONE kernel of one thread block (a classifier head).

Why: at batch 1 each ``fused_linear`` of a head (400 -> 120 -> 84 -> 10 in a small CNN) is a
matrix-vector product of a microsecond or two, and in a CUDA graph each kernel boundary still
costs the GPU a launch and a drain. One block can run the whole head: every warp takes output
features of a layer in turn, the activations between layers stay in shared memory, and
``__syncthreads()`` separates the layers. One SM reads all the weights, so this only pays for
small heads (tens of KiB of weights); the executor measures it against the layers as already
chosen and keeps it only where it is faster.

Matches (``plan_linear_chains``): two or more ``fused_linear`` nodes, each the only user of the
previous one's output and taking it as its input (not as weight or bias); 2-D inputs of the same
static 1..``MAX_ROWS`` rows; one dtype (fp32/fp16/bf16, fp32 accumulation); weights (N, K) and
biases (N,) in that dtype; any activation of the epilogue vocabulary. Declines chains whose
weights exceed ``MAX_WEIGHT_BYTES`` (one SM would read them all) or whose activations would not
fit the shared memory budget.

Produces: a ``LinearChain`` candidate over the flattened arguments
``(x, w0, b0, act0, params0, w1, b1, ...)``; ``linear_chain_of`` is the reference with the same
signature (the chosen implementation of each layer, in order). The candidate returns ``None``
(the reference runs) when run-time tensors differ from what it was generated for.
"""
from __future__ import annotations

from string import Template
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.ops import fused_linear_ref

from .codegen import Epilogue, KernelSource, _uname
from .linear import _DTYPES, _SHORT, MAX_ROWS, _aligned, row_capacity, vector_width
from .templates import ctype, load, prelude

# One SM reads every weight: on the H100 (fxopt 3a90c74, batch 1, graphed medians) the chain won
# for heads of 9-41 KiB of weights (2.67 vs 2.82 us, 3.26 vs 3.88) and lost from 66 KiB on (3.80 vs
# 3.04; the seed CNN's 192 KiB head 8.98 vs 4.36 for three kernels)
MAX_WEIGHT_BYTES = 64 << 10
MAX_LAYERS = 8
_SMEM_FLOATS = 6144          # two activation buffers of MR x N floats: 48 KiB static shared memory
BLOCK = 1024


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


def linear_chain_of(targets: list) -> Callable:
    """The reference: each layer's chosen implementation in turn, over the flattened arguments."""
    def linear_chain(x, *flat):
        for i, t in enumerate(targets):
            w, b, act, p = flat[4 * i: 4 * i + 4]
            x = t(x, w, b, act, p)
        return x

    linear_chain.weight_arg_indices = tuple(1 + 4 * i for i in range(len(targets)))
    return linear_chain


class LinearChain:
    """Candidate for a linear chain node (the flattened signature of ``linear_chain_of``)."""

    def __init__(self, name: str, spec: dict):
        self.name, self.spec, self.label = name, spec, "linear_chain"
        self.sources = {0: generate_linear_chain(spec["layers"], spec["rows"], spec["dtype"])}
        self.kernels: dict = {}

    def __call__(self, x, *flat):
        from .launch import _kernel

        s, ks, kernel = self.spec, self.sources[0], self.kernels.get(0)
        layers, dt = s["layers"], s["dtype"]
        if kernel is None or not x.is_cuda or x.dim() != 2 or not 1 <= x.shape[0] <= s["rows"]:
            return None
        if x.shape[1] != layers[0][0] or x.dtype != dt or not x.is_contiguous():
            return None
        args = [x]
        for i, (k, n, epi) in enumerate(layers):
            w, b = flat[4 * i], flat[4 * i + 1]
            if w.dtype != dt or tuple(w.shape) != (n, k) or not w.is_contiguous():
                return None
            if not _aligned(w, vector_width(k, dt) * w.element_size()) or (b is not None) != epi.bias:
                return None
            if b is not None and (b.dtype != dt or tuple(b.shape) != (n,) or not b.is_contiguous()):
                return None
            args += [w] + ([b] if b is not None else [])
        if not _aligned(x, ks.meta["vec0"] * x.element_size()):
            return None
        y = torch.empty((x.shape[0], layers[-1][1]), dtype=dt, device=x.device)
        _kernel(ks, kernel).launch((1, 1, 1), ks.block, args + [y, int(x.shape[0])])
        return y


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _layer(node: fx.Node, rows: Optional[int], dtype) -> Optional[tuple]:
    """(K, N, Epilogue) of an eligible fused_linear node, else None."""
    if node.op != "call_function" or node.target is not fused_linear_ref or len(node.args) != 5:
        return None
    x, w, out = _val(node.args[0]), _val(node.args[1]), node.meta.get("val")
    if x is None or w is None or out is None or x.dim() != 2 or w.dim() != 2 or x.dtype not in _DTYPES:
        return None
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)) or not 1 <= x.shape[0] <= MAX_ROWS:
        return None  # symbolic sizes, or a real GEMM
    if (rows is not None and x.shape[0] != rows) or (dtype is not None and x.dtype != dtype):
        return None
    if w.dtype != x.dtype or out.dtype != x.dtype or not x.is_contiguous() or not w.is_contiguous():
        return None
    bias, act, act_params = node.args[2], node.args[3], node.args[4]
    if bias is not None and (_val(bias) is None or _val(bias).dtype != x.dtype or _val(bias).dim() != 1):
        return None
    return int(x.shape[1]), int(w.shape[0]), Epilogue(bias is not None, False,
                                                        None if act == "none" else (act, tuple(act_params)))


def plan_linear_chains(graph: fx.Graph) -> list[tuple[list[fx.Node], LinearChain]]:
    """Maximal chains of eligible fused_linear nodes (each the only user of the previous output,
    taking it as input), with their candidate."""
    out, taken = [], set()
    for head in graph.nodes:
        first = _layer(head, None, None) if head not in taken else None
        if first is None:
            continue
        x = _val(head.args[0])
        chain, layers = [head], [first]
        while len(chain) < MAX_LAYERS and len(chain[-1].users) == 1:
            nxt = next(iter(chain[-1].users))
            if nxt.args[0] is not chain[-1] or chain[-1] in nxt.args[1:]:
                break  # used as a weight or bias, not as the input
            layer = _layer(nxt, int(x.shape[0]), x.dtype)
            if layer is None:
                break
            chain.append(nxt)
            layers.append(layer)
        taken.update(chain)
        if len(chain) < 2:
            continue
        weight_bytes = sum(k * n for k, n, _ in layers) * x.element_size()
        rows = row_capacity(int(x.shape[0]))
        if weight_bytes > MAX_WEIGHT_BYTES or 2 * rows * max(n for _, n, _ in layers[:-1]) > _SMEM_FLOATS:
            continue  # one SM would read too much, or the activations do not fit shared memory
        out.append((chain, LinearChain(f"linear_chain_{chain[0].name}",
                                       {"layers": layers, "rows": rows, "dtype": x.dtype})))
    return out
