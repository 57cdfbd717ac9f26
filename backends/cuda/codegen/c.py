"""C snippets every kernel generator splices in: C types, the prelude (``templates/*.cuh``, package
data), pointwise/activation expressions, float literals and index decomposition per layout. The
kernel families' own skeletons live beside them (``kernels/templates/*.cu``, ``kernels.common.load``).

Conventions shared by every kernel:
* math is in ``float``: ``fx_to_f32(x)`` widens an element, ``fx_from<T>(v)`` narrows
  (round to nearest even) on store;
* ``fx_half`` / ``fx_bf16`` are ``__half`` / ``__nv_bfloat16`` from cuda_fp16.h /
  cuda_bf16.h when compiler.py found an include directory for them; otherwise it defines
  ``FXOPT_NO_CUDA_HEADERS`` and a header-free bit-level definition is used;
* ``idx_t`` is ``int`` or ``long long`` (64-bit indexing for >= 2**31 elements);
* sizes arrive as ``long long`` parameters; every kernel runs a grid-stride loop.
"""
from __future__ import annotations

import functools
import math
from importlib import resources
from string import Template

import torch

CTYPE = {torch.float32: "float", torch.float16: "fx_half", torch.bfloat16: "fx_bf16"}
# unary op -> (min params, max params)
UNARY_OPS = {"identity": (0, 0), "neg": (0, 0), "relu": (0, 0), "hardtanh": (0, 2),
             "leaky_relu": (0, 1), "silu": (0, 0), "gelu": (0, 0), "gelu_tanh": (0, 0),
             "hardswish": (0, 0), "hardsigmoid": (0, 0), "sigmoid": (0, 0), "tanh": (0, 0),
             "exp": (0, 0), "abs": (0, 0), "clamp": (0, 2), "cast": (1, 1)}
_UNARY_C = {
    "identity": "{a}", "neg": "(-{a})", "relu": "({a} < 0.f ? 0.f : {a})",
    "silu": "fx_div({a}, 1.f + fx_exp(-{a}))",
    "gelu": "(0.5f * {a} * (1.f + erff({a} * 0.70710678118654752f)))",
    "gelu_tanh": "(0.5f * {a} * (1.f + tanhf(0.79788456080286536f * ({a} + 0.044715f * {a} * {a} * {a}))))",
    "hardswish": "fx_div({a} * fx_clamp({a} + 3.f, 0.f, 6.f), 6.f)",
    "hardsigmoid": "fx_div(fx_clamp({a} + 3.f, 0.f, 6.f), 6.f)",
    "sigmoid": "fx_div(1.f, 1.f + fx_exp(-{a}))", "tanh": "tanhf({a})", "exp": "fx_exp({a})", "abs": "fabsf({a})",
}


#: the unary ops whose C above goes through fx_exp / fx_div (approximate under FXOPT_FAST_MATH)
FAST_MATH_OPS = frozenset({"silu", "sigmoid", "hardswish", "hardsigmoid", "exp"})


def fast_math_prefix(fast_math: bool, op_names) -> str:
    """What option ``fast_math`` puts in front of a kernel's source: ``#define FXOPT_FAST_MATH``
    where the kernel computes one of ``FAST_MATH_OPS`` (their exp and quotient approximate, relative
    error below 1.3e-5 by CUDA's documented bounds: under the float32 tolerance's 1e-4 and a 16-bit
    result's rounding; docs/NUMERICS.md); else nothing."""
    if not fast_math:
        return ""
    return "#define FXOPT_FAST_MATH 1\n" if any(op in FAST_MATH_OPS for op in op_names) else ""


@functools.lru_cache(maxsize=None)
def load(name: str) -> Template:
    """The template ``templates/<name>`` shipped with the package."""
    return Template(resources.files(__package__).joinpath("templates", name).read_text())


def ctype(dt: torch.dtype) -> str:
    if dt not in CTYPE:
        raise NotImplementedError(f"fxopt CUDA codegen supports {tuple(CTYPE)}, not {dt}")
    return CTYPE[dt]


def prelude(dtypes) -> str:
    """Common definitions; the fp16/bf16 part only when a 16-bit type is used."""
    half = any(d != torch.float32 for d in dtypes)
    parts = ["prelude.cuh"] + ["prelude_half.cuh"] * half + ["prelude_tail.cuh"]
    return "".join(load(p).template for p in parts)


def lit(v) -> str:
    """A C float literal (exactly the float32 rounding of ``v``)."""
    v = float(v)
    if math.isnan(v):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(v):
        return "__int_as_float(0x7f800000)" if v > 0 else "(-__int_as_float(0x7f800000))"
    return f"{v!r}f"


def bounds(op: str, p) -> tuple:
    """(lo, hi) of hardtanh (defaults -1, 1) / clamp (None = unbounded)."""
    lo, hi = (tuple(p) + (None, None))[:2]
    if op == "hardtanh":
        return (-1.0 if lo is None else lo), (1.0 if hi is None else hi)
    return lo, hi


def c_unary(op: str, a: str, p: tuple = ()) -> str:
    """C expression of unary ``op`` applied to the float variable ``a``."""
    if op in _UNARY_C:
        return _UNARY_C[op].format(a=a)
    if op in ("hardtanh", "clamp"):
        lo, hi = bounds(op, p)
        if lo is not None and hi is not None:
            return f"fx_clamp({a}, {lit(lo)}, {lit(hi)})"
        if lo is not None:
            return f"({a} < {lit(lo)} ? {lit(lo)} : {a})"
        return a if hi is None else f"({a} > {lit(hi)} ? {lit(hi)} : {a})"
    if op == "leaky_relu":
        return f"({a} > 0.f ? {a} : {a} * {lit(p[0] if p else 0.01)})"
    if op == "cast":  # round through the dtype, keep computing in float
        return a if p[0] == torch.float32 else f"fx_to_f32(fx_from<{ctype(p[0])}>({a}))"
    raise NotImplementedError(f"unknown pointwise op {op!r}")


def norm_acts(act) -> list[tuple[str, tuple]]:
    """None | 'relu' | ('hardtanh', (0, 6)) | an object with .op/.params | a list of those ->
    [(op, params)], validated as unary ops."""
    if act is None:
        out = []
    elif isinstance(act, str):
        out = [(act, ())]
    elif hasattr(act, "op") and hasattr(act, "params"):
        out = [(act.op, tuple(act.params))]
    elif isinstance(act, tuple) and len(act) == 2 and isinstance(act[0], str):
        out = [(act[0], tuple(act[1]))]
    else:
        out = [x for a in act for x in norm_acts(a)]
    for op, p in out:
        if op not in UNARY_OPS or not UNARY_OPS[op][0] <= len(p) <= UNARY_OPS[op][1]:
            raise ValueError(f"bad activation {op}{p}")
    return out


def act_lines(act, var: str, indent: str) -> str:
    """Statements applying the activation chain ``act`` to ``var`` in place."""
    return "\n".join(f"{indent}{var} = {c_unary(op, var, p)};  // {op}" for op, p in norm_acts(act))


def decompose(layout: str, C: str = "C") -> tuple[str, str]:
    """Split the output index ``o`` of a 2-D window op into oh, ow, c and the input offset
    ``base``; returns (code, expression of the input index at (ih, iw))."""
    if layout == "nchw":
        code = ("    const int ow = (int)(o % OW);\n    idx_t t = o / OW;\n"
                "    const int oh = (int)(t % OH);\n    t /= OH;\n"
                f"    const idx_t c = t % {C}; (void)c;\n    const idx_t base = t * H * W;")
        return code, "base + (idx_t)ih * W + iw"
    code = (f"    const idx_t c = o % {C};\n    idx_t t = o / {C};\n"
            "    const int ow = (int)(t % OW);\n    t /= OW;\n"
            f"    const int oh = (int)(t % OH);\n    const idx_t base = (t / OH) * H * W * {C} + c;")
    return code, f"base + ((idx_t)ih * W + iw) * {C}"



