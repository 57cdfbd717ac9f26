"""The Winograd F(2x2, 3x3) family: a stride-1 3x3 conv as an input transform kernel
(V = B^T d B per 4x4 tile), a batched matrix product (torch.bmm) and an output transform kernel
(Y = A^T m A per tile, then bias + residual + activation). The transforms' C is generated from the
matrices (``winograd_transform_code``); ``winograd_conv2d_reference`` emulates the pipeline in torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fxopt.backends.cuda.codegen.c import ctype as _ctype, lit, prelude as _prelude
from fxopt.backends.cuda.codegen.epilogue import (NO_EPILOGUE, epilogue_code, epilogue_desc, epilogue_key,
                                                  epilogue_params, has_bias, has_residual)
from fxopt.backends.cuda.codegen.source import KernelSource, DTYPE_SHORT, index_type, checked_layout, unique_name
from fxopt.backends.cuda.kernels.common import check_layout, compiled_kernel, load


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


def winograd_conv2d_reference(x: torch.Tensor, w: torch.Tensor, padding: int = 1) -> torch.Tensor:
    """Torch emulation of the F(2x2,3x3) pipeline (same matrices, tiles, zero padding)."""
    N, C, H, W = x.shape
    OH, OW, TH, TW = winograd_tiles(H, W, padding)
    xp = F.pad(x, (padding, padding + 2 * TW - OW, padding, padding + 2 * TH - OH))
    tiles = xp.unfold(2, 4, 2).unfold(3, 4, 2)  # N, C, TH, TW, 4, 4
    BT, AT = _mat(WINO_BT, x), _mat(WINO_AT, x)
    V = BT @ tiles @ BT.T
    U = winograd_filter_transform(w).to(x.dtype).reshape(4, 4, *w.shape[:2]).permute(2, 3, 0, 1)
    M = torch.einsum("nchwij,kcij->nkhwij", V, U)
    Y = AT @ M @ AT.T  # N, K, TH, TW, 2, 2
    return Y.permute(0, 1, 2, 4, 3, 5).reshape(N, -1, 2 * TH, 2 * TW)[:, :, :OH, :OW]
