"""The vector loops of the generated C's convolutions and linear layers (``backends/c_emit.py``).

Written with the GNU vector extension (``vf``: 16 floats, a zmm register on AVX-512, two ymm on
AVX2; gcc and clang both have it), so the accumulators stay in registers and the code says which
dimension fills the lanes:

- ``conv_rows``: 16 neighbouring outputs of a row, ``ocb`` output channels at once (one input
  vector read per tap for all of them); taps that fall in the padding read zeros.
- ``conv_channels``: 16 output channels of one pixel, a few pixels at once, the weights laid out
  per call as [group][channel tile][ic][kh][kw][16] in the workspace; for small images with many
  channels (a 10x10 output fills 10 of 16 lanes along a row, 16 of 16 along the channels).
- ``linear_rows``: ``y = x W^T``, four rows of ``W`` by four rows of ``x`` at once as 16-wide dot
  products along the inputs, for every row of ``x`` while those rows of ``W`` are in the cache.

``choose_conv`` picks the layout whose lanes hold more real outputs; ``unary_expr`` writes an
activation as a C expression.
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

aten = torch.ops.aten

VL = 16  # floats per vf
TYPES = """static inline float from_bf16(unsigned short h) {
  unsigned int u = (unsigned int)h << 16; float f; memcpy(&f, &u, 4); return f;
}
/* round to nearest even, NaN to the quiet NaN 0x7fc0: torch's c10::BFloat16 */
static inline unsigned short to_bf16(float f) {
  unsigned int u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4), may_alias));  /* unaligned loads */
#ifdef __AVX512F__
#include <immintrin.h>
/* the lanes of p set in mask, zeros elsewhere; the others are not read (no fault past a row's end) */
static inline vf load_lanes(const float* p, unsigned short mask) { return (vf)_mm512_maskz_loadu_ps(mask, p); }
#else
static inline vf load_lanes(const float* p, unsigned short mask) {
  vf v = {0};
  for (int l = 0; l < 16; l++) if (mask >> l & 1) v[l] = p[l];
  return v;
}
#endif
"""


class Declined(Exception):
    """The graph has something the generated C does not handle (the message says what)."""


def flit(x) -> str:
    """A float literal in C (inf and nan spelled out)."""
    x = float(x)
    if math.isnan(x):
        return "NAN"
    if math.isinf(x):
        return "INFINITY" if x > 0 else "-INFINITY"
    return f"{x!r}f"


def activation_of(node: fx.Node) -> tuple:
    """(name, params) of an aten activation node, as ``fxopt.ops.ACTIVATIONS`` names them."""
    t, args, kw = node.target, node.args, node.kwargs
    if t is aten.hardtanh.default:
        return "hardtanh", (args[1] if len(args) > 1 else kw.get("min_val", -1.0),
                            args[2] if len(args) > 2 else kw.get("max_val", 1.0))
    if t is aten.leaky_relu.default:
        return "leaky_relu", (args[1] if len(args) > 1 else kw.get("negative_slope", 0.01),)
    if t is aten.gelu.default:
        return ("gelu_tanh" if (args[1] if len(args) > 1 else kw.get("approximate", "none")) == "tanh"
                else "gelu"), ()
    return t.__name__.split(".")[0], ()


def unary_expr(name: str, params, v: str) -> str:
    """The C expression of activation ``name`` on value ``v``. NaN stays NaN as in eager: every
    clamp is written so that a comparison with NaN is false and ``v`` passes."""
    exprs = {
        "none": "{v}",
        "relu": "({v} < 0.f ? 0.f : {v})",
        "hardtanh": "({v} < {p0} ? {p0} : ({v} > {p1} ? {p1} : {v}))",
        "leaky_relu": "({v} < 0.f ? {v} * {p0} : {v})",
        "sigmoid": "(1.f / (1.f + expf(-{v})))",
        "silu": "({v} / (1.f + expf(-{v})))",
        "tanh": "tanhf({v})",
        "hardswish": "({v} <= -3.f ? 0.f : ({v} >= 3.f ? {v} : {v} * ({v} + 3.f) / 6.f))",
        "hardsigmoid": "({v} <= -3.f ? 0.f : ({v} >= 3.f ? 1.f : {v} / 6.f + 0.5f))",
        "gelu": "(0.5f * {v} * (1.f + erff({v} * 0.7071067811865476f)))",
        "gelu_tanh": "(0.5f * {v} * (1.f + tanhf(0.7978845608028654f * ({v} + 0.044715f * {v} * {v} * {v}))))",
    }
    if name not in exprs:
        raise Declined(f"activation {name!r}")
    ps = {f"p{k}": flit(x) for k, x in enumerate(params)}
    return exprs[name].format(v=v, **ps)


PIXELS = 4  # pixels per step of conv_channels
ROWS = 4  # weight rows per step of linear_rows
BROWS = 4  # rows of its input per step


def lanes_used(n: int) -> float:
    return n / (math.ceil(n / VL) * VL)


def choose_conv(p: dict) -> str:
    """"rows" or "channels": the layout whose vectors hold more real outputs (a strided row reads its
    inputs lane by lane, so it counts half)."""
    rows = lanes_used(p["ow"]) * (1.0 if p["sw"] == 1 else 0.5)
    return "channels" if lanes_used(p["ocg"]) > rows else "rows"


def conv_rows(p: dict, X, Wt, bias: str, Y, epi, ocb: int, paired=None) -> list:
    """``epi(v, idx)``: the epilogue's lines on float ``v`` at index expressions ``idx``.

    A contiguous row read at stride 1 is read in place, each tap a masked vector load (lanes in the
    padding or past the row's end are zeros and never read), and two output rows are computed at
    once, each weight read once for both. Other rows are first copied into a zero-padded row
    buffer, so every tap reads its lanes without a bounds check.

    ``paired``: (input, weights) C pointers of ``c_bf16``'s channel pairs (stride 1 only): each
    tap reads 16 pixels' pairs and adds both products of a pair with ``vdpbf16ps``."""
    xs, ws = X.strides, Wt.strides
    tiles = math.ceil(p["ow"] / VL)
    masked = p["sw"] == 1 and (xs[3] == 1 or paired is not None)
    icn, fma = p["icg"], "a{o}_{r}[tt] += w{o} * xv{r};"
    if paired is not None:
        assert p["sw"] == 1, "channel pairs are read along a row at stride 1"
        icn, xq = (p["icg"] + 1) // 2, paired[0]
        fma = "a{o}_{r}[tt] = (vf)_mm512_dpbf16_ps((__m512)a{o}_{r}[tt], xv{r}, w{o});"
    rows = 2 if masked and p["oh"] > 1 and ocb * tiles * 2 <= 16 else 1
    lines, accs = [], [[f"a{o}_{r}" for o in range(ocb)] for r in range(rows)]
    if masked:
        masks = [[sum(1 << l for l in range(VL) if p["lo"][j] <= t * VL + l < min(p["hi"][j], p["ow"]))
                  for j in range(p["kw"])] for t in range(tiles)]
        lines.append(f"static const unsigned short mk[{tiles}][{p['kw']}] = "
                     f"{{{', '.join('{' + ', '.join(map(str, m)) + '}' for m in masks)}}};")
        read = [f"const float* restrict x{r} = {X.base} + n * {xs[0]} + (g * {p['icg']} + ic) * {xs[1]}"
                f" + (ih + {r * p['sh']}) * {xs[2]} + kw * {p['dw']} - {p['pw']};" for r in range(rows)]
        ok = [f"const int ok{r} = ih + {r * p['sh']} >= 0 && ih + {r * p['sh']} < {p['h']};" for r in range(rows)]
        taps = [f"const vf xv{r} = load_lanes(x{r} + tt * {VL}, ok{r} ? mk[tt][kw] : 0);" for r in range(rows)]
        if paired is not None:
            plane = p["h"] * p["w"]
            read = [f"const unsigned int* restrict x{r} = (const unsigned int*){xq} + ((long)(n * {p['groups']} + g)"
                    f" * {icn} + ic) * {plane} + (ih + {r * p['sh']}) * {p['w']} + kw * {p['dw']} - {p['pw']};"
                    for r in range(rows)]
            taps = [f"const __m512bh xv{r} = (__m512bh)_mm512_maskz_loadu_epi32(ok{r} ? mk[tt][kw] : 0,"
                    f" x{r} + tt * {VL});" for r in range(rows)]
    else:
        rw = (tiles * VL - 1) * p["sw"] + (p["kw"] - 1) * p["dw"] + 1  # row buffer: input columns -pw ..
        ncopy = max(0, min(p["w"], rw - p["pw"]))
        lines += [f"float xp[{rw}] __attribute__((aligned(64)));", "memset(xp, 0, sizeof xp);"]
        copy = f"memcpy(xp + {p['pw']}, xr, {ncopy} * sizeof(float));" if xs[3] == 1 else \
            f"for (int j = 0; j < {ncopy}; j++) xp[{p['pw']} + j] = xr[j * {xs[3]}];"
        read, ok = [], [f"const int ok0 = ih >= 0 && ih < {p['h']};",
                        f"if (!ok0) continue;",
                        f"const float* restrict xr = {X.base} + n * {xs[0]} + (g * {p['icg']} + ic) * {xs[1]}"
                        f" + ih * {xs[2]};", copy]
        taps = [f"vf xv0; for (int l = 0; l < {VL}; l++) xv0[l] = xp[(tt * {VL} + l) * {p['sw']} + kw * {p['dw']}];"]
    lines += [
        *split_range("oh", p["oh"], rows),
        f"for (int n = 0; n < {p['n']}; n++) for (int g = 0; g < {p['groups']}; g++)",
        f"for (int ob = 0; ob < {p['ocg']}; ob += {ocb}) for (int oh = oh_0; oh < oh_1; oh += {rows}) {{",
        "  " + " ".join(f"vf {a}[{tiles}];" for r in accs for a in r),
        f"  for (int t = 0; t < {tiles}; t++) {{ {' '.join(f'{a}[t] = (vf){{0}};' for r in accs for a in r)} }}",
        f"  for (int ic = 0; ic < {icn}; ic++) for (int kh = 0; kh < {p['kh']}; kh++) {{",
        f"    const int ih = oh * {p['sh']} - {p['ph']} + kh * {p['dh']};",
        *["    " + ln for ln in ok],
        *(["    " + ln for ln in _weights(p, Wt, ocb, paired)]),
        *["      " + ln for ln in read],
        f"      for (int tt = 0; tt < {tiles}; tt++) {{",
        *["        " + ln for ln in taps],
        *["        " + " ".join(fma.format(o=o, r=r) for o in range(ocb)) for r in range(rows)],
        "      }", "    }", "  }",
        f"  for (int tt = 0; tt < {tiles}; tt++) {{",
        f"  const int t0 = tt * {VL}, L = {p['ow']} - t0 < {VL} ? {p['ow']} - t0 : {VL};"]
    for r in range(rows):
        lines.append(f"  if (oh + {r} < {p['oh']}) {{" if r else "  {")
        for o in range(ocb):
            store = [f"      float v = a{o}_{r}[tt][l]{bias};",
                     *["      " + ln for ln in epi("v", ["n", "oc", "ohr", "t0 + l"])], "      yr[l] = v;"]
            lines += [f"  {{ const int oc = g * {p['ocg']} + ob + {o}, ohr = oh + {r};",
                      f"    float* restrict yr = {Y.base} + ((n * {p['oc']} + oc) * {p['oh']} + ohr) * {p['ow']} + t0;",
                      *_lanes("L", store), "  }"]
        lines.append("  }")
    return lines + ["  }", "}"]


def _weights(p: dict, Wt, ocb: int, paired) -> list:
    """conv_rows' weights of ``ocb`` output channels at one (ic, kh) and each kw: floats, or a pair
    of bfloat16 broadcast to every lane."""
    if paired is None:
        ws = Wt.strides
        return [f"const float* restrict wr = {Wt.base} + (g * {p['ocg']} + ob) * {ws[0]} + ic * {ws[1]}"
                f" + kh * {ws[2]};", f"for (int kw = 0; kw < {p['kw']}; kw++) {{",
                "  " + " ".join(f"const float w{o} = wr[{o * ws[0]} + kw * {ws[3]}];" for o in range(ocb))]
    taps, icn = p["kh"] * p["kw"], (p["icg"] + 1) // 2
    return [f"const unsigned int* restrict wr = (const unsigned int*){paired[1]} + ((long)(g * {p['ocg']} + ob)"
            f" * {icn} + ic) * {taps} + kh * {p['kw']};", f"for (int kw = 0; kw < {p['kw']}; kw++) {{",
            "  " + " ".join(f"const __m512bh w{o} = (__m512bh)_mm512_set1_epi32((int)wr[{o * icn * taps} + kw]);"
                            for o in range(ocb))]


def conv_channels(p: dict, X, Wt, bias: str, Y, epi, wp: str) -> list:
    """``wp``: the C pointer of the workspace that holds the weights laid out per call."""
    xs, ws = X.strides, Wt.strides
    tiles = math.ceil(p["ocg"] / VL)
    taps = p["icg"] * p["kh"] * p["kw"]
    pix = next((d for d in (4, 5, 6, 3) if p["ow"] % d == 0), min(PIXELS, p["ow"]))
    lines = [
        f"float* restrict wp = {wp};",
        f"for (int g = 0; g < {p['groups']}; g++) for (int t = 0; t < {tiles}; t++)",
        f"for (int ic = 0; ic < {p['icg']}; ic++) for (int kh = 0; kh < {p['kh']}; kh++)",
        f"for (int kw = 0; kw < {p['kw']}; kw++) for (int l = 0; l < {VL}; l++) {{",
        f"  const int o = t * {VL} + l;",
        f"  wp[((((g * {tiles} + t) * {p['icg']} + ic) * {p['kh']} + kh) * {p['kw']} + kw) * {VL} + l] = o < {p['ocg']}"
        f" ? {Wt.base}[(g * {p['ocg']} + o) * {ws[0]} + ic * {ws[1]} + kh * {ws[2]} + kw * {ws[3]}] : 0.f;",
        "}"]
    loops = [
        f"const float* restrict wp = {wp};",
        *split_range("oh", p["oh"], 1),
        f"for (int n = 0; n < {p['n']}; n++) for (int g = 0; g < {p['groups']}; g++) for (int t = 0; t < {tiles}; t++)",
        f"for (int oh = oh_0; oh < oh_1; oh++) for (int q0 = 0; q0 < {p['ow']}; q0 += {pix}) {{",
        "  " + " ".join(f"vf a{k} = {{0}};" for k in range(pix)),
        f"  for (int ic = 0; ic < {p['icg']}; ic++) for (int kh = 0; kh < {p['kh']}; kh++) {{",
        f"    const int ih = oh * {p['sh']} - {p['ph']} + kh * {p['dh']};",
        f"    if (ih < 0 || ih >= {p['h']}) continue;",
        f"    const float* restrict xr = {X.base} + n * {xs[0]} + (g * {p['icg']} + ic) * {xs[1]} + ih * {xs[2]};",
        f"    const float* restrict wk = wp + ((g * {tiles} + t) * {taps} + ic * {p['kh'] * p['kw']} + kh * {p['kw']})"
        f" * {VL};",
        f"    for (int kw = 0; kw < {p['kw']}; kw++) {{",
        "      const vf wv = *(const vfu*)(wk + kw * %d);" % VL]
    for k in range(pix):
        loops += [f"      {{ const int q = q0 + {k}, iw = q * {p['sw']} - {p['pw']} + kw * {p['dw']};",
                  f"        a{k} += (q < {p['ow']} && iw >= 0 && iw < {p['w']} ? xr[iw * {xs[3]}] : 0.f) * wv; }}"]
    loops += ["    }", "  }",
              f"  const int L = {p['ocg']} - t * {VL} < {VL} ? {p['ocg']} - t * {VL} : {VL};"]
    for k in range(pix):
        loops += [f"  if (q0 + {k} < {p['ow']}) for (int l = 0; l < L; l++) {{",
                  f"    const int oc = g * {p['ocg']} + t * {VL} + l;",
                  f"    float v = a{k}[l]{bias};",
                  *["    " + ln for ln in epi("v", ["n", "oc", "oh", f"q0 + {k}"])],
                  f"    {Y.base}[((n * {p['oc']} + oc) * {p['oh']} + oh) * {p['ow']} + q0 + {k}] = v;", "  }"]
    return lines, loops + ["}"]


def padded(k: int) -> int:
    """``k`` rounded up to a multiple of 32 (bfloat16 in a 64-byte vector): ``c_bf16``'s rows."""
    return -(-k // 32) * 32


def split_range(name: str, n: int, step: int) -> list:
    """C of ``{name}_0`` .. ``{name}_1``: this thread's (``part`` of ``parts``) share of 0..n in
    multiples of ``step``."""
    return [f"const int {name}_per = (({n} + {step} - 1) / {step} + parts - 1) / parts * {step};",
            f"const int {name}_0 = part * {name}_per < {n} ? part * {name}_per : {n};",
            f"const int {name}_1 = {name}_0 + {name}_per < {n} ? {name}_0 + {name}_per : {n};"]


def _lanes(count: str, body: list) -> list:
    """``body`` for lanes ``l`` < ``count``: a loop of constant trip count (vectorized) for a full
    vector, a plain loop for a tail."""
    return [f"    if ({count} == {VL}) {{", "      #pragma omp simd", f"      for (int l = 0; l < {VL}; l++) {{",
            *["  " + ln for ln in body], "      }",
            f"    }} else for (int l = 0; l < {count}; l++) {{", *body, "    }"]


def conv_workspace(p: dict) -> int:
    """Bytes of the weights laid out by ``conv_channels``."""
    return 4 * p["groups"] * math.ceil(p["ocg"] / VL) * p["icg"] * p["kh"] * p["kw"] * VL


def linear_rows(nb: int, k: int, no: int, M1, M2, bias: str, scale: str, Y, epi, paired=None) -> list:
    """``y[b, o] = sum_i m1[b, i] m2[i, o]`` for ``m1`` dense along ``i`` and ``m2``'s columns dense
    (a transposed weight): ``ROWS`` weight rows by ``BROWS`` rows of ``m1`` at once (each vector read
    serves four sums), every row of ``m1`` while those weight rows are in the cache. ``paired``:
    (rows, weights) C pointers of ``c_bf16``'s bfloat16 rows padded to a multiple of 32, summed 32
    at a time with ``vdpbf16ps``."""
    rows, brows = min(ROWS, no), min(BROWS, nb)
    kp = padded(k)
    lines = [*split_range("o", no, rows),
             f"for (int o0 = o_0; o0 < o_1; o0 += {rows}) {{"]  # a block of weight rows, then every row of m1
    kind, base, step = ("float", M2.base, M2.strides[1]) if paired is None else \
        ("unsigned short", f"(const unsigned short*){paired[1]}", kp)
    for j in range(rows):
        row = f"(long)(o0 + {j} < {no} ? o0 + {j} : {no - 1})"
        lines.append(f"  const {kind}* restrict w{j} = {base} + {row} * {step};")
    lines.append("  int b0 = 0;")
    loops = [(brows, f"for (; b0 + {brows} <= {nb}; b0 += {brows})")] + \
        ([(1, f"for (; b0 < {nb}; b0++)")] if nb % brows else [])
    for br, loop in loops:
        lines += [f"  {loop} {{", *["    " + ln for ln in _dots(br, rows, k, kp, M1, paired)]]
        for q in range(br):
            for j in range(rows):
                lines += [f"    if (o0 + {j} < {no}) {{", f"      const int b = b0 + {q}, o = o0 + {j};",
                          f"      float v = r{j}_{q}{scale}{bias};", *["      " + ln for ln in epi("v", ["b", "o"])],
                          f"      {Y.base}[b * {no} + o] = v;", "    }"]
        lines.append("  }")
    return lines + ["}"]


def _dots(br: int, rows: int, k: int, kp: int, M1, paired) -> list:
    """``r{j}_{q}``: the sums of weight row ``j`` with row ``b0 + q`` of ``m1``."""
    acc = [(j, q) for q in range(br) for j in range(rows)]
    lines = [" ".join(f"vf s{j}_{q} = {{0}};" for j, q in acc)]
    if paired is None:
        lines += [f"const float* restrict x{q} = {M1.base} + (long)(b0 + {q}) * {M1.strides[0]};" for q in range(br)]
        lines += ["int i = 0;", f"for (; i + {VL} <= {k}; i += {VL}) {{",
                  *[f"  const vf wv{j} = *(const vfu*)(w{j} + i);" for j in range(rows)],
                  *[f"  const vf xv{q} = *(const vfu*)(x{q} + i);" for q in range(br)],
                  *[f"  s{j}_{q} += xv{q} * wv{j};" for j, q in acc], "}"]
    else:
        lines += [f"const unsigned short* restrict x{q} = (const unsigned short*){paired[0]} + (long)(b0 + {q}) * {kp};"
                  for q in range(br)]
        lines += [f"for (int i = 0; i < {kp}; i += 32) {{",
                  *[f"  const __m512bh wv{j} = (__m512bh)_mm512_loadu_si512(w{j} + i);" for j in range(rows)],
                  *[f"  const __m512bh xv{q} = (__m512bh)_mm512_loadu_si512(x{q} + i);" for q in range(br)],
                  *[f"  s{j}_{q} = (vf)_mm512_dpbf16_ps((__m512)s{j}_{q}, xv{q}, wv{j});" for j, q in acc], "}"]
    lines += [" ".join(f"float r{j}_{q} = 0.f;" for j, q in acc),
              f"for (int l = 0; l < {VL}; l++) {{ {' '.join(f'r{j}_{q} += s{j}_{q}[l];' for j, q in acc)} }}"]
    if paired is None:
        lines.append(f"for (; i < {k}; i++) {{ {' '.join(f'r{j}_{q} += x{q}[i] * w{j}[i];' for j, q in acc)} }}")
    return lines
