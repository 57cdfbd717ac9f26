"""The linear family: generated kernels for ``fxopt::fused_linear`` nodes over few rows (a classifier head
at small batch).

Why: at batch 1..16 a ``fused_linear`` (``act(x @ w.T + bias)``) is a matrix-vector product: the
time is reading the weight once. cuBLAS runs it as a GEMM or GEMV kernel and the bias/activation
as another kernel, so a three-layer head is five or six launches, each a few microseconds of
latency that a CUDA graph still pays on the GPU.

- ``plan_linear`` -> ``LinearRows``: a ``fused_linear`` whose input is 2-D with at most
  ``MAX_ROWS`` static rows, weight (N, K) in the input's dtype: one generated kernel per layer
  (``generate_linear``). Larger batches are GEMMs that cuBLAS runs better, and each candidate
  costs an NVRTC compilation and a measurement.
- ``plan_conv_as_linear`` -> ``ConvAsLinear``: a ``fused_conv`` that is a linear layer in disguise: a
  1x1 conv (groups 1, no padding) on a 1x1 image over at most ``MAX_ROWS`` images, without residual
  (the fully connected layers of a squeeze-excite gate at small batch): the same kernel over the
  (N, C) views of input and weight, bias and activation fused. cuDNN runs such a conv as a GEMM
  and, with a bias or activation, one more kernel.
- ``plan_linear_chains`` -> ``LinearChain``: two or more such layers, each the only user of the
  previous one's output and taking it as its input (not as weight or bias), same static rows and
  dtype: the whole head as one kernel of one thread block. One SM reads all the weights, so this
  only pays for small heads: chains whose weights exceed ``MAX_WEIGHT_BYTES`` or whose activations
  would not fit shared memory are declined. ``linear_chain_of`` is the reference with the same
  flattened signature ``(x, w0, b0, act0, params0, w1, ...)`` (the chosen implementation of each
  layer, in order); ``runtime/groups.py`` measures the chain against it.

Candidates return ``None`` (the reference runs) when run-time tensors differ from what they were
generated for: other sizes, dtypes, non-contiguous or misaligned memory.
"""
from __future__ import annotations

from string import Template
from typing import Callable, Optional

import torch
import torch.fx as fx

from fxopt.backends.cuda.codegen.c import ctype, prelude
from fxopt.backends.cuda.codegen.epilogue import (NO_EPILOGUE, epilogue_code, epilogue_desc, epilogue_key,
                                                  epilogue_params, has_bias, has_residual, template_epilogue)
from fxopt.backends.cuda.codegen.source import KernelSource, unique_name
from fxopt.backends.cuda.kernels.common import NodeGroup, compiled_kernel, load
from fxopt.backends.cuda.kernels.conv import conv_args
from fxopt.ops import fused_linear_ref


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
                    epilogue=None, features_per_warp: int = 1,
                    block: int = 128) -> KernelSource:
    """Launch args: x, w, [bias], y, M (M <= rows). Grid: ceil(N / (block / 32 * features_per_warp))."""
    K, N, MR, NW = int(k), int(n), int(rows), int(features_per_warp)
    if min(K, N) < 1:
        raise ValueError("linear: K and N must be positive")
    if MR < 1 or MR > MAX_ROWS or MR * NW > 32 or NW < 1:
        raise ValueError(f"linear: rows {MR} x features per warp {NW} must fit one warp's lanes")
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError("linear: block must be a multiple of 32, at most 1024")
    epi = NO_EPILOGUE if epilogue is None else epilogue
    if has_residual(epi):
        raise ValueError("linear: no residual input")
    ct, vec = ctype(dtype), vector_width(K, dtype)
    name = unique_name(f"fx_linear_k{K}_n{N}_r{MR}_{_SHORT[dtype]}", K, N, MR, NW, epilogue_key(epi), block, vec)
    src = Template(load("linear_rows.cu").template).substitute(
        prelude=prelude({dtype}), K=K, N=N, MR=MR, NW=NW, VEC=vec, T=ct, block=block, name=name,
        extra_params=epilogue_params(epi, ct), epi_desc=epilogue_desc(epi),
        epilogue=epilogue_code(epi, " " * 8, "fx_to_f32(bias[n])", ""))
    params = [("x", f"const {ct}*"), ("w", f"const {ct}*")] + [("bias", f"const {ct}*")] * has_bias(epi)
    params += [("y", f"{ct}*"), ("M", "long long")]
    meta = {"k": K, "n": N, "rows": MR, "features_per_warp": NW, "vec": vec, "epilogue": epi, "dtype": dtype}
    return KernelSource(name, src, tuple(params), "linear_rows", meta, (block, 1, 1), False)


_SMEM_FLOATS = 6144          # two activation buffers of MR x N floats: 48 KiB static shared memory
BLOCK = 1024
MAX_LAYERS = 8


def generate_linear_chain(layers: list, rows: int, dtype: torch.dtype = torch.float32,
                          block: int = BLOCK) -> KernelSource:
    """layers: [(K, N, epilogue)] (epilogues from ``template_epilogue``), each K the previous N. Launch args: x, (w_i, [b_i]) per layer,
    y, M (M <= rows). Grid: one block."""
    if not 2 <= len(layers) <= MAX_LAYERS:
        raise ValueError(f"linear chain: {len(layers)} layers, the template takes 2..{MAX_LAYERS}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"linear chain: {rows} rows, at most {MAX_ROWS}")
    if block % 32 or not 32 <= block <= 1024:
        raise ValueError("linear chain: block must be a multiple of 32, at most 1024")
    for i, (k, n, epi) in enumerate(layers):
        if min(k, n) < 1 or has_residual(epi):
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
            l=i, K=k, N=n, MR=rows, VEC=vec, T=ct, WARPS=block // 32, epi_desc=epilogue_desc(epi),
            accumulate=acc, store=store, epilogue=epilogue_code(epi, " " * 8, f"fx_to_f32(b{i}[n])", "")))
        params += [(f"w{i}", f"const {ct}*")] + [(f"b{i}", f"const {ct}*")] * has_bias(epi)
    desc = "; ".join(f"{k}->{n} {epilogue_desc(epi)}" for k, n, epi in layers)
    name = unique_name(f"fx_linear_chain{len(layers)}_r{rows}_{_SHORT[dtype]}",
                       tuple((k, n, epilogue_key(e)) for k, n, e in layers), rows, dtype, block)
    src = Template(load("linear_chain.cu").template).substitute(
        prelude=prelude({dtype}), L=len(layers), last=last, K0=layers[0][0], NLAST=layers[-1][1], MR=rows,
        NMAX=nmax, block=block, name=name, T=ct, desc=desc,
        params="".join(f", {t} __restrict__ {p}" for p, t in params), layers="\n".join(body))
    params = [("x", f"const {ct}*")] + params + [("y", f"{ct}*"), ("M", "long long")]
    meta = {"layers": tuple(layers), "rows": rows, "dtype": dtype, "vec0": vector_width(layers[0][0], dtype)}
    return KernelSource(name, src, tuple(params), "linear_chain", meta, (block, 1, 1), False)


_MAX_GRID = 2 ** 31 - 1


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


def launch_linear(ks: KernelSource, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                  bias: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """``out`` (M, N) = act(x @ w.T + bias); checks sizes, dtypes, contiguity and alignment."""
    m = ks.meta
    K, N, dt = m["k"], m["n"], m["dtype"]
    if x.dim() != 2 or x.shape[1] != K or tuple(w.shape) != (N, K) or tuple(out.shape) != (x.shape[0], N):
        raise ValueError(f"{ks.name}: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)} "
                         f"do not match K={K}, N={N}")
    if x.shape[0] > m["rows"]:
        raise ValueError(f"{ks.name}: {x.shape[0]} rows, generated for at most {m['rows']}")
    if (bias is not None) != has_bias(m["epilogue"]):
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
    compiled_kernel(ks, kernel).launch(grid, ks.block, args)
    return out


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else None


class LinearRows:
    """Candidate for a fused_linear node (same signature)."""

    def __init__(self, name: str, spec: dict):
        self.name, self.spec, self.label = name, spec, "linear"
        self.sources = {0: generate_linear(spec["k"], spec["n"], spec["rows"], spec["dtype"], spec["epilogue"])}
        self.kernels: dict = {}

    def __call__(self, x, weight, bias, activation, act_params):
        s = self.spec
        if x.dim() != 2 or x.shape[0] > s["rows"] or x.shape[1] != s["k"] or tuple(weight.shape) != (s["n"], s["k"]):
            return None
        return self._launch(x, weight, bias)

    def _launch(self, x, weight, bias) -> Optional[torch.Tensor]:
        """act(x @ weight.T + bias) for x (M, K), weight (N, K) of the generated sizes, into a new (M, N)
        tensor; None where the tensors are not what the kernel was compiled for (device, dtype,
        contiguity, alignment)."""
        s, ks, kernel = self.spec, self.sources[0], self.kernels.get(0)
        if kernel is None or not x.is_cuda or x.dtype != s["dtype"] or weight.dtype != x.dtype:
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
            "epilogue": template_epilogue(bias is not None, False, act, act_params)}
    return LinearRows(f"linear_{node.name}", spec)


class ConvAsLinear(LinearRows):
    """Candidate for a fused_conv node that ``plan_conv_as_linear`` takes (the conv's signature)."""

    def __init__(self, name: str, spec: dict, out_strides: tuple):
        super().__init__(name, spec)
        self.out_strides = out_strides

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        s = self.spec
        if residual is not None or x.dim() != 4 or tuple(x.shape[1:]) != (s["k"], 1, 1):
            return None
        if tuple(weight.shape) != (s["n"], s["k"], 1, 1) or not 1 <= x.shape[0] <= s["rows"]:
            return None
        if not (_dense(x) and _dense(weight)):
            return None  # a (N, C) view would need a copy
        n = int(x.shape[0])
        y = self._launch(x.view(n, s["k"]), weight.view(s["n"], s["k"]), bias)
        return None if y is None else y.as_strided((n, s["n"], 1, 1), self.out_strides)


def _dense(t: torch.Tensor) -> bool:
    """A (A, B, 1, 1) tensor whose (A, B) view is contiguous (either memory format)."""
    return t.stride(1) == 1 and (t.shape[0] == 1 or t.stride(0) == t.shape[1])


def plan_conv_as_linear(node: fx.Node) -> Optional[ConvAsLinear]:
    """A candidate for a fused_conv node that is a linear layer over at most MAX_ROWS rows (see the
    module docstring); None where none applies."""
    c = conv_args(node)
    if c is None or c["groups"] != 1 or c["k"] != (1, 1) or c["padding"] != (0, 0) or has_residual(c["epilogue"]):
        return None  # not a 1x1 dense conv without padding and residual (see conv_args for the rest)
    x, w, out = c["x"], c["w"], c["out"]
    if tuple(x.shape[2:]) != (1, 1) or tuple(out.shape[2:]) != (1, 1) or not 1 <= x.shape[0] <= MAX_ROWS:
        return None  # an image larger than one pixel, or a batch that is a real GEMM
    if x.dtype not in _DTYPES:
        return None
    spec = {"k": int(w.shape[1]), "n": int(w.shape[0]), "rows": row_capacity(int(x.shape[0])), "dtype": x.dtype,
            "epilogue": c["epilogue"]}
    return ConvAsLinear(f"conv_linear_{node.name}", spec, tuple(int(d) for d in out.stride()))


# One SM reads every weight: on the H100 (fxopt 3a90c74, batch 1, graphed medians) the chain won
# for heads of 9-41 KiB of weights (2.67 vs 2.82 us, 3.26 vs 3.88) and lost from 66 KiB on (3.80 vs
# 3.04; the seed CNN's 192 KiB head 8.98 vs 4.36 for three kernels)
MAX_WEIGHT_BYTES = 64 << 10


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
            if not _aligned(w, vector_width(k, dt) * w.element_size()) or (b is not None) != has_bias(epi):
                return None
            if b is not None and (b.dtype != dt or tuple(b.shape) != (n,) or not b.is_contiguous()):
                return None
            args += [w] + ([b] if b is not None else [])
        if not _aligned(x, ks.meta["vec0"] * x.element_size()):
            return None
        y = torch.empty((x.shape[0], layers[-1][1]), dtype=dt, device=x.device)
        compiled_kernel(ks, kernel).launch((1, 1, 1), ks.block, args + [y, int(x.shape[0])])
        return y


def _layer(node: fx.Node, rows: Optional[int], dtype) -> Optional[tuple]:
    """(K, N, epilogue) of an eligible fused_linear node, else None."""
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
    return int(x.shape[1]), int(w.shape[0]), template_epilogue(bias is not None, False, act, act_params)


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


class LinearChainGroup(NodeGroup):
    """A chain of linear layers measured as one ``LinearChain`` against the layers as chosen
    (``linear_chain_of``); only the last layer's output is used."""

    kind = "linear_chain"

    def reference(self):
        return linear_chain_of([n.target for n in self.nodes])

    def args(self) -> tuple:
        return (self.nodes[0].args[0],) + tuple(a for n in self.nodes for a in n.args[1:5])

    def meta(self) -> dict:
        return dict(self.nodes[-1].meta)

    def replace(self, gm: fx.GraphModule, node: fx.Node) -> None:
        self.nodes[-1].replace_all_uses_with(node)
        for n in reversed(self.nodes):
            gm.graph.erase_node(n)


def plan_linear_chain_groups(graph: fx.Graph) -> list[LinearChainGroup]:
    """``plan_linear_chains`` as measured groups."""
    return [LinearChainGroup(chain, [cand]) for chain, cand in plan_linear_chains(graph)]
