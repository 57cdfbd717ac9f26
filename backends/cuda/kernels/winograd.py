"""The Winograd F(2x2, 3x3) family: a stride-1 3x3 conv as an input transform kernel
(V = B^T d B per 4x4 tile), a batched matrix product (torch.bmm) and an output transform kernel
(Y = A^T m A per tile, then bias + residual + activation). The transforms' C is generated from the
matrices (``winograd_transform_code``); ``winograd_conv2d_reference`` emulates the pipeline in torch.

As a per-node candidate of the cuda executor (``plan_winograd`` -> ``WinogradConv``, offered as
``generated_winograd2x2``): a filter transform kernel (U = G g G^T, per call, so that a weight
updated in place or a CUDA graph replay never sees a stale transform), the input transform, the
product and the output transform with the conv's epilogue fused. Transforms, product and
accumulation are fp32 for every dtype (the product without TF32 unless torch's matmul allows it), so
its error is that of ``winograd_2x2_3x3`` in fp32; it is held to ``tolerance(dtype)``, the
``winograd_2x2_3x3`` bound of the conv's dtype (``fxopt.conv_algorithms``, docs/NUMERICS.md), and
measured against the reference like every candidate (the measuring's check is within that bound).
Where it declines, ``decline_reason`` says why in one line.
"""
from __future__ import annotations

from string import Template
from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxopt.backends.cuda.codegen.c import ctype as _ctype, lit, prelude as _prelude
from fxopt.backends.cuda.codegen.epilogue import (NO_EPILOGUE, epilogue_code, epilogue_desc, epilogue_key,
                                                  epilogue_params, has_bias, has_residual)
from fxopt.backends.cuda.codegen.source import (KernelSource, made_once, DTYPE_SHORT, index_type, checked_layout,
                                                layout_name, needs_index64, unique_name)
from fxopt.backends.cuda.kernels.common import (check_layout, compiled_kernel, dense_strides, load, memory_layout_ok,
                                                node_val, weight_fits, weight_layout_of)
from fxopt.backends.cuda.kernels.conv import conv_args


WINO_BT = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))
WINO_G = ((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1))
WINO_AT = ((1, 1, 1, 0), (0, 1, -1, -1))


def lincomb(coeffs, terms) -> str:
    parts = [("-" if c == -1 else "+", t if abs(c) == 1 else f"{lit(c)} * {t}")
             for c, t in zip(coeffs, terms) if c != 0]
    if not parts:
        return "0.f"
    s = ("-" if parts[0][0] == "-" else "") + parts[0][1]
    return "(" + s + "".join(f" {sg} {t}" for sg, t in parts[1:]) + ")"


def winograd_transform_code(L, X, out: str) -> list[tuple[str, str]]:
    """Assignments computing ``out = L X L^T`` element-wise (result names out{i}_{j};
    temporaries out t{i}_{j}). With 0/±1 matrices the expressions are valid Python too."""
    m, r = len(L), len(L[0])
    code = [(f"{out}t{i}_{j}", lincomb(L[i], [X[k][j] for k in range(r)]))
            for i in range(m) for j in range(r)]
    code += [(f"{out}{i}_{j}", lincomb(L[j], [f"{out}t{i}_{k}" for k in range(r)]))
             for i in range(m) for j in range(m)]
    return code


def wino_decompose(layout: str, C: str) -> str:
    """Work item ``o`` -> (channel c, tile p): o = c * P + p (nchw), o = p * C + c (nhwc)."""
    if layout == "nchw":
        return "    const idx_t p = o % P;\n    const idx_t c = o / P;"
    return f"    const idx_t c = o % {C};\n    const idx_t p = o / {C};"


def winograd_tiles(H: int, W: int, padding: int = 1) -> tuple[int, int, int, int]:
    """(OH, OW, TH, TW) of a stride-1 3x3 conv computed with 2x2 output tiles."""
    OH, OW = H + 2 * padding - 2, W + 2 * padding - 2
    return OH, OW, -(-OH // 2), -(-OW // 2)


@made_once
def generate_winograd_input_transform(dtype: torch.dtype = torch.float32, layout: str = "nchw",
                                      padding: int = 1, transform_dtype: torch.dtype | None = None,
                                      index64: bool = False, block: int = 256) -> KernelSource:
    """V = B^T d B for every 4x4 input tile. V is (16, C, P) for nchw, (16, P, C) for nhwc.
    Launch args: x, V, N, C, H, W, TH, TW; ``grid_block(P * C)``."""
    lay, ct, vt = checked_layout(layout), _ctype(dtype), _ctype(transform_dtype or dtype)
    name = unique_name(f"fx_wino_in_{DTYPE_SHORT[dtype]}_{lay}", padding, transform_dtype, index64, block)
    at = ("((n * C + c) * H + (h0 + {i})) * W + (w0 + {j})" if lay == "nchw"
          else "((n * H + (h0 + {i})) * W + (w0 + {j})) * C + c")
    loads = [f"    const bool rv{i} = h0 + {i} >= 0 && h0 + {i} < H, cv{i} = w0 + {i} >= 0 && w0 + {i} < W;"
             for i in range(4)]
    loads += [f"    const float d{i}_{j} = rv{i} && cv{j} ? fx_to_f32(x[{at.format(i=i, j=j)}]) : 0.f;"
              for i in range(4) for j in range(4)]
    code = winograd_transform_code(WINO_BT, [[f"d{i}_{j}" for j in range(4)] for i in range(4)], "v")
    tr = [f"    const float {n} = {e};" for n, e in code]
    tr += [f"    V[(idx_t){i * 4 + j} * total + o] = fx_from<{vt}>(v{i}_{j});" for i in range(4) for j in range(4)]
    src = load("winograd_input.cu").substitute(
        prelude=_prelude({dtype, transform_dtype or dtype}), PAD=int(padding), layout=lay,
        v_layout="C][P" if lay == "nchw" else "P][C", block=block, name=name, T=ct, VT=vt,
        idx=index_type(index64), decompose=wino_decompose(lay, "C"),
        loads="\n".join(loads), transform="\n".join(tr))
    params = (("x", f"const {ct}*"), ("V", f"{vt}*")) + tuple((n, "long long") for n in
                                                              ("N", "C", "H", "W", "TH", "TW"))
    return KernelSource(name, src, params, "winograd_input", {"layout": lay, "padding": int(padding)},
                        (block, 1, 1), index64)


@made_once
def generate_winograd_output_transform(dtype: torch.dtype = torch.float32, layout: str = "nchw",
                                       epilogue=None,
                                       transform_dtype: torch.dtype | None = None,
                                       index64: bool = False, block: int = 256) -> KernelSource:
    """Y = A^T m A per tile, then bias + residual + activation. M is (16, K, P) for nchw,
    (16, P, K) for nhwc. Launch args: M, [bias], [res], y, N, K, OH, OW, TH, TW;
    ``grid_block(P * K)``."""
    lay, ct, mt = checked_layout(layout), _ctype(dtype), _ctype(transform_dtype or dtype)
    epi = NO_EPILOGUE if epilogue is None else epilogue
    name = unique_name(f"fx_wino_out_{DTYPE_SHORT[dtype]}_{lay}", epilogue_key(epi), transform_dtype, index64, block)
    loads = [f"    const float m{i}_{j} = fx_to_f32(M[(idx_t){i * 4 + j} * total + o]);"
             for i in range(4) for j in range(4)]
    if has_bias(epi):
        loads.append("    const float bk = fx_to_f32(bias[c]);")
    code = winograd_transform_code(WINO_AT, [[f"m{i}_{j}" for j in range(4)] for i in range(4)], "r")
    at = "((n * K + c) * OH + oh) * OW + ow" if lay == "nchw" else "((n * OH + oh) * OW + ow) * K + c"
    stores = []
    for i in range(2):
        for j in range(2):
            stores.append(f"    {{\n      const int oh = th * 2 + {i}, ow = tw * 2 + {j};\n"
                          f"      if (oh < OH && ow < OW) {{\n        const idx_t oi = {at};\n"
                          f"        float acc = r{i}_{j};\n{epilogue_code(epi, ' ' * 8, 'bk', 'fx_to_f32(res[oi])')}\n"
                          f"        y[oi] = fx_from<{ct}>(acc);\n      }}\n    }}")
    src = load("winograd_output.cu").substitute(
        prelude=_prelude({dtype, transform_dtype or dtype}), layout=lay,
        m_layout="K][P" if lay == "nchw" else "P][K", epi_desc=epilogue_desc(epi), block=block,
        name=name, MT=mt, T=ct, extra_params=epilogue_params(epi, ct), idx=index_type(index64),
        decompose=wino_decompose(lay, "K"), loads="\n".join(loads),
        transform="\n".join(f"    const float {n} = {e};" for n, e in code), stores="\n".join(stores))
    params = [("M", f"const {mt}*")] + [("bias", f"const {ct}*")] * has_bias(epi)
    params += [("res", f"const {ct}*")] * has_residual(epi) + [("y", f"{ct}*")]
    params += [(n, "long long") for n in ("N", "K", "OH", "OW", "TH", "TW")]
    return KernelSource(name, src, tuple(params), "winograd_output", {"layout": lay, "epilogue": epi},
                        (block, 1, 1), index64)


def _mat(rows, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(rows, dtype=like.dtype, device=like.device)


def winograd_filter_transform(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """U = G g G^T of a (K, C, 3, 3) weight, as a (16, K, C) tensor (index i*4+j)."""
    K, C = w.shape[:2]
    g = w.to(torch.float64)
    G = _mat(WINO_G, g)
    U = G @ g @ G.T  # K, C, 4, 4
    return U.permute(2, 3, 0, 1).reshape(16, K, C).to(dtype or w.dtype).contiguous()


def launch_winograd_input(ks: KernelSource, x: torch.Tensor, V: torch.Tensor | None = None,
                          dtype: torch.dtype | None = None, kernel=None) -> torch.Tensor:
    """V: (16, C, P) for nchw, (16, P, C) for nhwc, P = N * TH * TW."""
    lay = ks.meta["layout"]
    check_layout(x, lay, f"{ks.name}: x")
    N, C, H, W = x.shape
    _, _, TH, TW = winograd_tiles(H, W, ks.meta["padding"])
    P = N * TH * TW
    if V is None:
        shape = (16, C, P) if lay == "nchw" else (16, P, C)
        V = torch.empty(shape, dtype=dtype or x.dtype, device=x.device)
    if V.numel() == 0:
        return V
    grid, block = ks.grid_block(P * C, extent=max(x.numel(), V.numel()))
    compiled_kernel(ks, kernel).launch(grid, block, [x, V, N, C, H, W, TH, TW])
    return V


def winograd_gemm(U: torch.Tensor, V: torch.Tensor, layout: str) -> torch.Tensor:
    """M[xi] = U[xi] @ V[xi]: (16, K, P) for nchw; (16, P, K) for nhwc."""
    return torch.bmm(U, V) if layout == "nchw" else torch.bmm(V, U.transpose(1, 2))


def launch_winograd_output(ks: KernelSource, M: torch.Tensor, out: torch.Tensor,
                           bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                           kernel=None) -> torch.Tensor:
    lay, epi = ks.meta["layout"], ks.meta["epilogue"]
    check_layout(out, lay, f"{ks.name}: out")
    if (bias is not None) != has_bias(epi) or (residual is not None) != has_residual(epi):
        raise ValueError(f"{ks.name}: bias/residual do not match the kernel's epilogue {epi}")
    if residual is not None:
        check_layout(residual, lay, f"{ks.name}: residual", out.dtype)
    N, K, OH, OW = out.shape
    TH, TW = -(-OH // 2), -(-OW // 2)
    if out.numel() == 0:
        return out
    M = M.contiguous()
    args = [M] + [t for t in (bias, residual) if t is not None] + [out, N, K, OH, OW, TH, TW]
    grid, block = ks.grid_block(N * TH * TW * K, extent=max(M.numel(), out.numel()))
    compiled_kernel(ks, kernel).launch(grid, block, args)
    return out


def winograd_conv2d(ks_in: KernelSource, ks_out: KernelSource, x: torch.Tensor, U: torch.Tensor,
                    bias=None, residual=None, out=None) -> torch.Tensor:
    """Full stride-1 3x3 conv: input transform kernel, torch.bmm, output transform kernel.
    ``U`` from winograd_filter_transform (in the transform dtype)."""
    N, C, H, W = x.shape
    OH, OW, _, _ = winograd_tiles(H, W, ks_in.meta["padding"])
    K = U.shape[1]
    if out is None:
        fmt = torch.channels_last if ks_out.meta["layout"] == "nhwc" else torch.contiguous_format
        out = torch.empty((N, K, OH, OW), dtype=x.dtype, device=x.device, memory_format=fmt)
    V = launch_winograd_input(ks_in, x, dtype=U.dtype)
    return launch_winograd_output(ks_out, winograd_gemm(U, V, ks_in.meta["layout"]), out, bias, residual)


def winograd_conv2d_reference(x: torch.Tensor, w: torch.Tensor, padding: int = 1, bias=None, residual=None,
                              activation: str = "none", act_params=(), compute_dtype=None) -> torch.Tensor:
    """Torch emulation of the F(2x2,3x3) pipeline (same matrices, tiles, zero padding), with the
    output kernel's epilogue act(acc + bias (+ residual)): computed in ``compute_dtype`` (default
    x's; the candidate's is fp32), rounded to x's dtype once at the end, as the kernels do."""
    from fxopt.ops import apply_activation

    cd = compute_dtype or x.dtype
    xc = x.to(cd)
    N, C, H, W = x.shape
    OH, OW, TH, TW = winograd_tiles(H, W, padding)
    xp = F.pad(xc, (padding, padding + 2 * TW - OW, padding, padding + 2 * TH - OH))
    tiles = xp.unfold(2, 4, 2).unfold(3, 4, 2)  # N, C, TH, TW, 4, 4
    BT, AT = _mat(WINO_BT, xc), _mat(WINO_AT, xc)
    V = BT @ tiles @ BT.T
    U = winograd_filter_transform(w).to(cd).reshape(4, 4, *w.shape[:2]).permute(2, 3, 0, 1)
    M = torch.einsum("nchwij,kcij->nkhwij", V, U)
    Y = AT @ M @ AT.T  # N, K, TH, TW, 2, 2
    y = Y.permute(0, 1, 2, 4, 3, 5).reshape(N, -1, 2 * TH, 2 * TW)[:, :, :OH, :OW]
    if bias is not None:
        y = y + bias.to(cd).reshape(1, -1, 1, 1)
    if residual is not None:
        y = y + residual.to(cd)
    return apply_activation(y, activation, act_params).to(x.dtype)


# -- the per-node candidate ------------------------------------------------------------------------
#: most bytes of fp32 workspace (U, V and M together) a conv may take
WORKSPACE_BYTES = 1 << 30

_FILTER = Template("""$prelude
// Winograd F(2x2,3x3) filter transform U = G g G^T of a (K, C, 3, 3) weight ($weight_layout), in fp32
// U: [16][$u_layout]
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ w, float* __restrict__ U, long long K_, long long C_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  const idx_t K = (idx_t)K_, C = (idx_t)C_;
  const idx_t total = K * C;
  const idx_t stride = (idx_t)gridDim.x * blockDim.x;
  for (idx_t o = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride) {
    const idx_t k = o / C, c = o % C;
$loads
$transform
$stores
  }
}
""")


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol) the candidate is held to: ``winograd_2x2_3x3``'s bound of ``dtype``."""
    from fxopt.conv_algorithms import get_algorithm

    return get_algorithm("winograd_2x2_3x3").tolerance(dtype)


@made_once
def generate_winograd_filter_transform(dtype: torch.dtype = torch.float32, weight_layout: str = "oihw",
                                       layout: str = "nchw", index64: bool = False,
                                       block: int = 256) -> KernelSource:
    """U = G g G^T of every (k, c) filter, in fp32: (16, K, C) for an nchw product (U @ V), (16, C, K)
    for nhwc (V @ U). ``weight_layout``: "oihw" (contiguous) or "ohwi" (channels_last).
    Launch args: w, U, K, C; ``grid_block(K * C)``."""
    lay, ct = checked_layout(layout), _ctype(dtype)
    if weight_layout not in ("oihw", "ohwi"):
        raise ValueError(f"winograd filter: weight_layout must be 'oihw' or 'ohwi', not {weight_layout!r}")
    name = unique_name(f"fx_wino_filter_{DTYPE_SHORT[dtype]}_{lay}", weight_layout, index64, block)
    at = "(k * C + c) * 9 + {t}" if weight_layout == "oihw" else "(k * 9 + {t}) * C + c"
    loads = [f"    const float g{i}_{j} = fx_to_f32(w[{at.format(t=i * 3 + j)}]);" for i in range(3) for j in range(3)]
    code = winograd_transform_code(WINO_G, [[f"g{i}_{j}" for j in range(3)] for i in range(3)], "u")
    dst = "k * C + c" if lay == "nchw" else "c * K + k"
    stores = [f"    U[(idx_t){i * 4 + j} * total + {dst}] = u{i}_{j};" for i in range(4) for j in range(4)]
    src = _FILTER.substitute(prelude=_prelude({dtype}), weight_layout=weight_layout,
                             u_layout="K][C" if lay == "nchw" else "C][K", block=block, name=name, T=ct,
                             idx=index_type(index64), loads="\n".join(loads), stores="\n".join(stores),
                             transform="\n".join(f"    const float {n} = {e};" for n, e in code))
    params = (("w", f"const {ct}*"), ("U", "float*"), ("K", "long long"), ("C", "long long"))
    return KernelSource(name, src, params, "winograd_filter", {"layout": lay, "weight_layout": weight_layout},
                        (block, 1, 1), index64)


def winograd_spec(node: fx.Node) -> tuple[Optional[dict], Optional[str]]:
    """(what ``WinogradConv`` needs of a fused_conv node, None) or (None, why it declines)."""
    c = conv_args(node)
    if c is None:
        return None, "not a static fp32/fp16/bf16 2-D conv run by direct or an algorithm chosen automatically"
    x, w, out = c["x"], c["w"], c["out"]
    if c["groups"] != 1:
        return None, f"groups={c['groups']}: the product is one dense matrix product per tile position"
    if c["k"] != (3, 3) or c["stride"] != (1, 1) or c["dilation"] != (1, 1):
        return None, f"F(2x2, 3x3) needs a 3x3 kernel, stride 1, dilation 1 (got {c['k']}, {c['stride']}, " \
                     f"{c['dilation']})"
    if c["padding"][0] != c["padding"][1]:
        return None, f"padding {c['padding']}: the transforms take one padding for both dimensions"
    # (a tensor with one channel or one pixel is dense in both layouts: the one both share)
    layout = next((lay for lay in (layout_name(out), layout_name(x))
                   if lay is not None and memory_layout_ok(x, lay) and memory_layout_ok(out, lay)), None)
    wl, res = weight_layout_of(w), node_val(node.args[3])
    if layout is None:
        return None, "input and output not dense in one layout (nchw or nhwc)"
    if res is not None and (tuple(res.shape) != tuple(out.shape) or not memory_layout_ok(res, layout)):
        return None, f"the residual is not dense in the output's layout ({layout})"
    if wl is None:
        return None, "the weight is neither contiguous nor channels_last"
    n, cin, h, wd = (int(d) for d in x.shape)
    k, pad = int(w.shape[0]), c["padding"][0]
    _, _, th, tw = winograd_tiles(h, wd, pad)
    p = n * th * tw
    floats = 16 * (k * cin + p * cin + p * k)
    if 4 * floats > WORKSPACE_BYTES:
        return None, f"its fp32 workspace ({4 * floats >> 20} MiB) exceeds {WORKSPACE_BYTES >> 20} MiB"
    return {"x_shape": (n, cin, h, wd), "w_shape": tuple(int(d) for d in w.shape), "out_shape": tuple(
        int(d) for d in out.shape), "padding": pad, "layout": layout, "weight_layout": wl, "dtype": out.dtype,
        "epilogue": c["epilogue"], "index64": needs_index64(max(floats, x.numel(), out.numel()))}, None


def decline_reason(node: fx.Node) -> Optional[str]:
    """Why ``plan_winograd`` offers nothing for ``node`` (one line), or None where it offers the candidate."""
    return winograd_spec(node)[1]


class WinogradConv:
    """The F(2x2, 3x3) pipeline as a fused_conv candidate (the node's signature; None where the
    run-time tensors are not what it was generated for)."""

    label = "winograd2x2"
    #: the device whose tensors it takes (the kernels' launches run there)
    device_type = "cuda"

    def __init__(self, node: fx.Node, spec: dict):
        self.name, self.spec = f"wino_{node.name}", spec
        lay, dt, i64 = spec["layout"], spec["dtype"], spec["index64"]
        self.sources = {
            "filter": generate_winograd_filter_transform(dt, spec["weight_layout"], lay, i64),
            "in": generate_winograd_input_transform(dt, lay, spec["padding"], torch.float32, i64),
            "out": generate_winograd_output_transform(dt, lay, spec["epilogue"], torch.float32, i64)}
        self.kernels: dict = {}

    def __call__(self, x, weight, bias, residual, stride, padding, dilation, groups, activation, act_params,
                 algorithm="direct", prepacked=None):
        s, epi = self.spec, self.spec["epilogue"]
        if len(self.kernels) != len(self.sources) or x.device.type != self.device_type:
            return None
        if tuple(x.shape) != s["x_shape"]:
            return None
        if x.dtype != s["dtype"] or weight.dtype != x.dtype or tuple(weight.shape) != s["w_shape"]:
            return None
        if not memory_layout_ok(x, s["layout"]) or not weight_fits(weight, s["weight_layout"]):
            return None
        if (bias is not None) != has_bias(epi) or (residual is not None) != has_residual(epi):
            return None
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
            return None
        if residual is not None and (residual.dtype != x.dtype or tuple(residual.shape) != s["out_shape"]
                                     or not memory_layout_ok(residual, s["layout"])):
            return None
        shape = s["out_shape"]
        out = torch.empty_strided(shape, dense_strides(s["layout"], shape), dtype=x.dtype, device=x.device)
        if out.numel() == 0:
            return out
        k, c = s["w_shape"][:2]
        ks_f = self.sources["filter"]
        u = torch.empty((16, k, c) if s["layout"] == "nchw" else (16, c, k), dtype=torch.float32, device=x.device)
        grid, block = ks_f.grid_block(k * c, extent=u.numel())
        self.kernels["filter"].launch(grid, block, [weight, u, k, c])
        v = launch_winograd_input(self.sources["in"], x, dtype=torch.float32, kernel=self.kernels["in"])
        m = torch.bmm(u, v) if s["layout"] == "nchw" else torch.bmm(v, u)
        return launch_winograd_output(self.sources["out"], m, out, bias, residual, kernel=self.kernels["out"])


def plan_winograd(node: fx.Node) -> list:
    """The F(2x2, 3x3) candidate of a fused_conv node, [] where it declines (``decline_reason``)."""
    spec, _ = winograd_spec(node)
    return [] if spec is None else [WinogradConv(node, spec)]
