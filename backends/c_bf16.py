"""bfloat16 dot products for a bfloat16 graph's convolutions and linear layers in the generated C
(``backends/c_emit.py``), on CPUs with AVX-512 BF16.

Why: the generated C computes in float32; a bfloat16 model gained nothing from its dtype. AVX-512
BF16's ``vdpbf16ps`` multiplies 16 pairs of bfloat16 and adds both products of each pair into a
float32 lane: twice the multiply-adds of a float32 FMA per instruction, half the bytes read.

What it computes: what torch computes for a bfloat16 convolution or linear layer: its inputs
rounded to bfloat16 (nearest even; a bfloat16 model's values are bfloat16 already, the C's float32
intermediates are rounded where they enter), products summed in float32 (the instruction treats
denormal inputs as zero, as oneDNN's bfloat16 kernels on the same instruction do). Within the
bfloat16 tolerance of ``fxopt.tolerances``.

How, in pairs along the reduction:
- ``pack_channels``: a convolution's input as 32-bit units, each two neighbouring input channels of
  a group at one pixel, [n][g][pair][h][w] (an odd group's last unit has a zero high half), so the
  masked row loads of ``c_kernels.conv_rows`` read 16 pixels' pairs as one vector;
- ``pair_weights``: the weights as pairs of the same channels, [oc][pair][kh][kw], laid out once;
- ``pack_rows`` / ``row_weights``: a linear layer's input rows and weight rows as bfloat16 padded
  to 32 with zeros, so a 64-byte load is 32 of the inputs.

Every block is under ``#ifdef GUARD``: where the compiler's target has no AVX-512 BF16 the same
source computes in float32 as before (``c_kernels``' loops in the ``#else``).
"""
from __future__ import annotations

from fxopt.backends.c_kernels import padded, split_range

GUARD = "__AVX512BF16__"


def pairs(icg: int) -> int:
    return (icg + 1) // 2


def guarded(bf16: list, f32: list) -> list:
    """``bf16`` where the target has AVX-512 BF16, else ``f32``."""
    return [f"#ifdef {GUARD}", *bf16, "#else", *f32, "#endif"]


def channels_bytes(p: dict) -> int:
    return 4 * p["n"] * p["groups"] * pairs(p["icg"]) * p["h"] * p["w"]


def weights_bytes(p: dict) -> int:
    return 4 * p["oc"] * pairs(p["icg"]) * p["kh"] * p["kw"]


def pack_channels(p: dict, X, dst: str) -> list:
    """A layer's lines: ``X`` (float, [n][c][h][w] at its strides) into ``dst`` as channel pairs,
    the rows of (n, g, pair) shared out over the threads."""
    xs, icg, g = X.strides, p["icg"], p["groups"]
    n2 = pairs(icg)
    return [*split_range("r", p["n"] * g * n2, 1),
            f"unsigned int* restrict xq = (unsigned int*){dst};",
            "for (int r = r_0; r < r_1; r++) {",
            f"  const int n = r / {g * n2}, g = r / {n2} % {g}, c2 = r % {n2}, two = 2 * c2 + 1 < {icg};",
            f"  const float* restrict x0 = {X.base} + n * {xs[0]} + (g * {icg} + 2 * c2) * {xs[1]};",
            f"  const float* restrict x1 = two ? x0 + {xs[1]} : x0;",
            f"  unsigned int* restrict o = xq + (long)r * {p['h'] * p['w']};",
            f"  for (int i = 0; i < {p['h']}; i++) for (int j = 0; j < {p['w']}; j++) {{",
            f"    const long at = i * {xs[2]} + j * {xs[3]};",
            f"    o[i * {p['w']} + j] = (unsigned int)to_bf16(x0[at]) | (two ? (unsigned int)to_bf16(x1[at]) << 16"
            " : 0u);",
            "  }", "}"]


def pair_weights(p: dict, Wt, dst: str) -> list:
    """Prepare lines: the weights ``Wt`` ([oc][icg][kh][kw]) as channel pairs in ``dst``."""
    ws, icg = Wt.strides, p["icg"]
    n2 = pairs(icg)
    return [f"unsigned int* restrict wq = (unsigned int*){dst};",
            f"for (int oc = 0; oc < {p['oc']}; oc++) for (int c2 = 0; c2 < {n2}; c2++)",
            f"for (int i = 0; i < {p['kh']}; i++) for (int j = 0; j < {p['kw']}; j++) {{",
            f"  const float* restrict w0 = {Wt.base} + oc * {ws[0]} + 2 * c2 * {ws[1]} + i * {ws[2]} + j * {ws[3]};",
            f"  wq[((oc * {n2} + c2) * {p['kh']} + i) * {p['kw']} + j] = (unsigned int)to_bf16(w0[0])"
            f" | (2 * c2 + 1 < {icg} ? (unsigned int)to_bf16(w0[{ws[1]}]) << 16 : 0u);",
            "}"]


def pack_rows(nb: int, k: int, M1, dst: str) -> list:
    """A layer's lines: the rows of ``M1`` ([nb][k]) as bfloat16 padded to ``padded(k)`` in ``dst``."""
    kp, s = padded(k), M1.strides
    return [*split_range("b", nb, 1),
            f"unsigned short* restrict xq = (unsigned short*){dst};",
            "for (int b = b_0; b < b_1; b++) {",
            f"  for (int i = 0; i < {k}; i++) xq[(long)b * {kp} + i] = to_bf16({M1.base}[b * {s[0]} + i * {s[1]}]);",
            f"  for (int i = {k}; i < {kp}; i++) xq[(long)b * {kp} + i] = 0;",
            "}"]


def row_weights(k: int, no: int, M2, dst: str) -> list:
    """Prepare lines: ``M2`` ([k][no], a transposed weight) as rows [no][padded(k)] of bfloat16."""
    kp, s = padded(k), M2.strides
    return [f"unsigned short* restrict wq = (unsigned short*){dst};",
            f"for (int o = 0; o < {no}; o++) for (int i = 0; i < {kp}; i++)",
            f"  wq[(long)o * {kp} + i] = i < {k} ? to_bf16({M2.base}[i * {s[0]} + o * {s[1]}]) : 0;"]
