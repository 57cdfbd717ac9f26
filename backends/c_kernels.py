"""The vector loops of the generated C's convolutions and linear layers (``backends/c_emit.py``).

Written with the GNU vector extension (``vf``: 16 floats, a zmm register on AVX-512, two ymm on
AVX2; gcc and clang both have it), so the accumulators stay in registers and the code says which
dimension fills the lanes:

- ``conv_rows``: 16 neighbouring outputs of a row, ``ocb`` output channels at once (one input
  vector read per tap for all of them); taps that fall in the padding read zeros.
- ``conv_channels``: 16 output channels of one pixel, a few pixels at once, the weights laid out
  per call as [group][channel tile][ic][kh][kw][16] in the workspace; for small images with many
  channels (a 10x10 output fills 10 of 16 lanes along a row, 16 of 16 along the channels).
- ``linear_rows``: ``y = x W^T``, four outputs at once as 16-wide dot products along the inputs,
  for every row of ``x`` while those four rows of ``W`` are in the L1.

``choose_conv`` picks the layout whose lanes hold more real outputs.
"""
from __future__ import annotations

import math

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
PIXELS = 4  # pixels per step of conv_channels
ROWS = 4  # outputs per step of linear_rows


def lanes_used(n: int) -> float:
    return n / (math.ceil(n / VL) * VL)


def choose_conv(p: dict) -> str:
    """"rows" or "channels": the layout whose vectors hold more real outputs (a strided row reads its
    inputs lane by lane, so it counts half)."""
    rows = lanes_used(p["ow"]) * (1.0 if p["sw"] == 1 else 0.5)
    return "channels" if lanes_used(p["ocg"]) > rows else "rows"


def conv_rows(p: dict, X, Wt, bias: str, Y, epi, ocb: int) -> list:
    """``epi(v, idx)``: the epilogue's lines on float ``v`` at index expressions ``idx``.

    A contiguous row read at stride 1 is read in place, each tap a masked vector load (lanes in the
    padding or past the row's end are zeros and never read), and two output rows are computed at
    once, each weight read once for both. Other rows are first copied into a zero-padded row
    buffer, so every tap reads its lanes without a bounds check."""
    xs, ws = X.strides, Wt.strides
    tiles = math.ceil(p["ow"] / VL)
    masked = p["sw"] == 1 and xs[3] == 1
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
        f"  for (int ic = 0; ic < {p['icg']}; ic++) for (int kh = 0; kh < {p['kh']}; kh++) {{",
        f"    const int ih = oh * {p['sh']} - {p['ph']} + kh * {p['dh']};",
        *["    " + ln for ln in ok],
        f"    const float* restrict wr = {Wt.base} + (g * {p['ocg']} + ob) * {ws[0]} + ic * {ws[1]} + kh * {ws[2]};",
        f"    for (int kw = 0; kw < {p['kw']}; kw++) {{",
        "      " + " ".join(f"const float w{o} = wr[{o * ws[0]} + kw * {ws[3]}];" for o in range(ocb)),
        *["      " + ln for ln in read],
        f"      for (int tt = 0; tt < {tiles}; tt++) {{",
        *["        " + ln for ln in taps],
        *["        " + " ".join(f"a{o}_{r}[tt] += w{o} * xv{r};" for o in range(ocb)) for r in range(rows)],
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


def linear_rows(nb: int, k: int, no: int, M1, M2, bias: str, scale: str, Y, epi) -> list:
    """``y[b, o] = sum_i m1[b, i] m2[i, o]`` for ``m1`` dense along ``i`` and ``m2``'s columns dense
    (a transposed weight)."""
    m1s, m2s = M1.strides[0], M2.strides[1]
    rows = min(ROWS, no)
    lines = [*split_range("o", no, rows),
             f"for (int o0 = o_0; o0 < o_1; o0 += {rows}) {{"]  # a block of weight rows, then every row of m1
    for j in range(rows):
        lines.append(f"  const float* restrict w{j} = {M2.base} + (o0 + {j} < {no} ? o0 + {j} : {no - 1}) * {m2s};")
    lines += [f"  for (int b = 0; b < {nb}; b++) {{", f"  const float* restrict xr = {M1.base} + b * {m1s};"]
    lines += ["  " + " ".join(f"vf s{j} = {{0}};" for j in range(rows)),
              "  int i = 0;",
              f"  for (; i + {VL} <= {k}; i += {VL}) {{",
              "    const vf xv = *(const vfu*)(xr + i);",
              *[f"    s{j} += xv * *(const vfu*)(w{j} + i);" for j in range(rows)],
              "  }",
              "  " + " ".join(f"float r{j} = 0.f;" for j in range(rows)),
              f"  for (int l = 0; l < {VL}; l++) {{ {' '.join(f'r{j} += s{j}[l];' for j in range(rows))} }}",
              f"  for (; i < {k}; i++) {{ {' '.join(f'r{j} += xr[i] * w{j}[i];' for j in range(rows))} }}"]
    for j in range(rows):
        lines += [f"  if (o0 + {j} < {no}) {{", f"    const int o = o0 + {j};", f"    float v = r{j}{scale}{bias};",
                  *["    " + ln for ln in epi("v", ["b", "o"])],
                  f"    {Y.base}[b * {no} + o] = v;", "  }"]
    return lines + ["  }", "}"]
