"""The vector loops of the generated C's convolutions and linear layers (``backends/c_emit.py``).

Written with the GNU vector extension (``vf``: 16 floats, a zmm register on AVX-512, two ymm on
AVX2; gcc and clang both have it), so the accumulators stay in registers and the code says which
dimension fills the lanes:

- ``conv_rows``: 16 neighbouring outputs of a row, ``ocb`` output channels at once (one input
  vector read per tap for all of them); taps that fall in the padding read zeros.
- ``conv_channels``: 16 output channels of one pixel, a few pixels at once, the weights laid out
  per call as [group][channel tile][ic][kh][kw][16] in the workspace; for small images with many
  channels (a 10x10 output fills 10 of 16 lanes along a row, 16 of 16 along the channels).
- ``linear_rows``: ``y = x W^T``, four outputs at once as 16-wide dot products along the inputs.

``choose_conv`` picks the layout whose lanes hold more real outputs.
"""
from __future__ import annotations

import math

VL = 16  # floats per vf
TYPES = ("typedef float vf __attribute__((vector_size(64)));\n"
         "typedef float vfu __attribute__((vector_size(64), aligned(4), may_alias));  /* unaligned loads */\n")
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
    """``epi(v, idx)``: the epilogue's lines on float ``v`` at index expressions ``idx``. Each input
    row is first copied into a zero-padded row buffer, so every tap reads a whole vector without a
    bounds check (the padding's zeros, and lanes past the row's end that are never stored)."""
    xs, ws = X.strides, Wt.strides
    accs = [f"a{o}" for o in range(ocb)]
    tiles = math.ceil(p["ow"] / VL)
    rw = (tiles * VL - 1) * p["sw"] + (p["kw"] - 1) * p["dw"] + 1  # row buffer: input columns -pw ..
    ncopy = max(0, min(p["w"], rw - p["pw"]))
    copy = f"memcpy(xp + {p['pw']}, xr, {ncopy} * sizeof(float));" if xs[3] == 1 else \
        f"for (int j = 0; j < {ncopy}; j++) xp[{p['pw']} + j] = xr[j * {xs[3]}];"
    tap = "xv = *(const vfu*)(xp + t0 + kw * %d);" % p["dw"] if p["sw"] == 1 else \
        f"for (int l = 0; l < {VL}; l++) xv[l] = xp[(t0 + l) * {p['sw']} + kw * {p['dw']}];"
    lines = [
        f"float xp[{rw}] __attribute__((aligned(64)));",
        f"memset(xp, 0, sizeof xp);",
        f"for (int n = 0; n < {p['n']}; n++) for (int g = 0; g < {p['groups']}; g++)",
        f"for (int ob = 0; ob < {p['ocg']}; ob += {ocb}) for (int oh = 0; oh < {p['oh']}; oh++) {{",
        f"  {' '.join(f'vf {a}[{tiles}];' for a in accs)}",
        f"  for (int t = 0; t < {tiles}; t++) {{ {' '.join(f'{a}[t] = (vf){{0}};' for a in accs)} }}",
        f"  for (int ic = 0; ic < {p['icg']}; ic++) for (int kh = 0; kh < {p['kh']}; kh++) {{",
        f"    const int ih = oh * {p['sh']} - {p['ph']} + kh * {p['dh']};",
        f"    if (ih < 0 || ih >= {p['h']}) continue;",
        f"    const float* restrict xr = {X.base} + n * {xs[0]} + (g * {p['icg']} + ic) * {xs[1]} + ih * {xs[2]};",
        f"    {copy}",
        f"    const float* restrict wr = {Wt.base} + (g * {p['ocg']} + ob) * {ws[0]} + ic * {ws[1]} + kh * {ws[2]};",
        f"    for (int kw = 0; kw < {p['kw']}; kw++) {{",
        "      " + " ".join(f"const float w{o} = wr[{o * ws[0]} + kw * {ws[3]}];" for o in range(ocb)),
        f"      for (int tt = 0; tt < {tiles}; tt++) {{",
        f"        const int t0 = tt * {VL}; vf xv;",
        f"        {tap}",
        "        " + " ".join(f"a{o}[tt] += w{o} * xv;" for o in range(ocb)),
        "      }", "    }", "  }",
        f"  for (int tt = 0; tt < {tiles}; tt++) {{",
        f"  const int t0 = tt * {VL}, L = {p['ow']} - t0 < {VL} ? {p['ow']} - t0 : {VL};"]
    for o in range(ocb):
        lines += [f"  {{ const int oc = g * {p['ocg']} + ob + {o};",
                  f"    float* restrict yr = {Y.base} + ((n * {p['oc']} + oc) * {p['oh']} + oh) * {p['ow']} + t0;",
                  "    for (int l = 0; l < L; l++) {",
                  f"      float v = a{o}[tt][l]{bias};",
                  *["      " + ln for ln in epi("v", ["n", "oc", "oh", "t0 + l"])],
                  "      yr[l] = v;", "    }", "  }"]
    return lines + ["  }", "}"]


def conv_channels(p: dict, X, Wt, bias: str, Y, epi, wp: str) -> list:
    """``wp``: the C pointer of the workspace that holds the weights laid out per call."""
    xs, ws = X.strides, Wt.strides
    tiles = math.ceil(p["ocg"] / VL)
    taps = p["icg"] * p["kh"] * p["kw"]
    pix = next((d for d in (4, 5, 6, 3) if p["ow"] % d == 0), min(PIXELS, p["ow"]))
    lines = [
        f"float* restrict wp = {wp};",
        f"if (P) for (int g = 0; g < {p['groups']}; g++) for (int t = 0; t < {tiles}; t++)",
        f"for (int ic = 0; ic < {p['icg']}; ic++) for (int kh = 0; kh < {p['kh']}; kh++)",
        f"for (int kw = 0; kw < {p['kw']}; kw++) for (int l = 0; l < {VL}; l++) {{",
        f"  const int o = t * {VL} + l;",
        f"  wp[((((g * {tiles} + t) * {p['icg']} + ic) * {p['kh']} + kh) * {p['kw']} + kw) * {VL} + l] = o < {p['ocg']}"
        f" ? {Wt.base}[(g * {p['ocg']} + o) * {ws[0]} + ic * {ws[1]} + kh * {ws[2]} + kw * {ws[3]}] : 0.f;",
        "}",
        f"for (int n = 0; n < {p['n']}; n++) for (int g = 0; g < {p['groups']}; g++) for (int t = 0; t < {tiles}; t++)",
        f"for (int oh = 0; oh < {p['oh']}; oh++) for (int q0 = 0; q0 < {p['ow']}; q0 += {pix}) {{",
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
        lines += [f"      {{ const int q = q0 + {k}, iw = q * {p['sw']} - {p['pw']} + kw * {p['dw']};",
                  f"        a{k} += (q < {p['ow']} && iw >= 0 && iw < {p['w']} ? xr[iw * {xs[3]}] : 0.f) * wv; }}"]
    lines += ["    }", "  }",
              f"  const int L = {p['ocg']} - t * {VL} < {VL} ? {p['ocg']} - t * {VL} : {VL};"]
    for k in range(pix):
        lines += [f"  if (q0 + {k} < {p['ow']}) for (int l = 0; l < L; l++) {{",
                  f"    const int oc = g * {p['ocg']} + t * {VL} + l;",
                  f"    float v = a{k}[l]{bias};",
                  *["    " + ln for ln in epi("v", ["n", "oc", "oh", f"q0 + {k}"])],
                  f"    {Y.base}[((n * {p['oc']} + oc) * {p['oh']} + oh) * {p['ow']} + q0 + {k}] = v;", "  }"]
    return lines + ["}"]


def conv_workspace(p: dict) -> int:
    """Bytes of the weights laid out by ``conv_channels``."""
    return 4 * p["groups"] * math.ceil(p["ocg"] / VL) * p["icg"] * p["kh"] * p["kw"] * VL


def linear_rows(nb: int, k: int, no: int, M1, M2, bias: str, scale: str, Y, epi) -> list:
    """``y[b, o] = sum_i m1[b, i] m2[i, o]`` for ``m1`` dense along ``i`` and ``m2``'s columns dense
    (a transposed weight)."""
    m1s, m2s = M1.strides[0], M2.strides[1]
    rows = min(ROWS, no)
    lines = [f"for (int b = 0; b < {nb}; b++) for (int o0 = 0; o0 < {no}; o0 += {rows}) {{",
             f"  const float* restrict xr = {M1.base} + b * {m1s};"]
    for j in range(rows):
        lines.append(f"  const float* restrict w{j} = {M2.base} + (o0 + {j} < {no} ? o0 + {j} : {no - 1}) * {m2s};")
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
    return lines + ["}"]
