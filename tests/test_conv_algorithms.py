"""Convolution algorithm library: every algorithm == F.conv{n}d within its tolerance (CPU)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fxopt.conv_algorithms import (
    ALGORITHMS, ConvAlgorithm, ConvSig, compute_dtype, get_algorithm, legal_algorithms)
from fxopt.fft_conv import next_fast_len

NAMES = ["direct", "winograd_2x2_3x3", "winograd_4x4_3x3", "fft", "gemm"]
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _examples(n: int) -> int:
    """At most n examples, unless a profile asks for a long search (e.g. "thorough")."""
    cur = settings.default.max_examples
    return cur if cur > 100 else min(n, cur)


def make(x_shape, w_shape, dtype=torch.float64, seed=0, bias=True, channels_last=False):
    """Unit-scale activations and fan-in-scaled weights (the regime tolerances assume)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64)
    w = torch.randn(w_shape, generator=g, dtype=torch.float64) / math.sqrt(math.prod(w_shape[1:]))
    b = torch.randn(w_shape[0], generator=g, dtype=torch.float64) if bias else None
    x, w, b = x.to(dtype), w.to(dtype), (b.to(dtype) if bias else None)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    return x, w, b


def check(name, x, w, b, stride=1, padding=0, dilation=1, groups=1, prepack=True):
    sig = ConvSig.from_tensors(x, w, stride, padding, dilation, groups)
    algo = get_algorithm(name)
    assert algo.legal(sig) is None, algo.legal(sig)
    ref = CONV[sig.ndim](x, w, b, sig.stride, sig.padding, sig.dilation, groups)
    y = algo.run(x, w, algo.prepare(w, sig) if prepack else None, b, sig)
    assert y.shape == ref.shape and y.dtype == x.dtype and y.device == x.device
    rtol, atol = algo.tolerance(x.dtype)
    torch.testing.assert_close(y, ref, rtol=rtol, atol=atol, msg=lambda m: f"{name} {sig.key()}: {m}")
    return y


# ------------------------------------------------------------------ registry / signature
def test_registry():
    assert list(ALGORITHMS) == NAMES + ["blockdiag"]  # blockdiag: CUDA only (tests below)
    for name, algo in ALGORITHMS.items():
        assert algo.name == name and isinstance(algo, ConvAlgorithm)
        assert get_algorithm(name) is algo


def test_unknown_algorithm_lists_valid_names():
    with pytest.raises(KeyError) as e:
        get_algorithm("winograd_6x6_3x3")
    assert all(n in str(e.value) for n in NAMES)


def test_sig_key_is_stable_readable_and_hashable():
    sig = ConvSig((None, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1, torch.float32, "cuda", True)
    assert sig.key() == "conv2d|x=?x64x56x56|w=64x64x3x3|s=1,1|p=1,1|d=1,1|g=1|f32|cuda|cl"
    same = ConvSig([None, 64, 56, 56], [64, 64, 3, 3], 1, 1, 1, 1, torch.float32, "cuda", True)
    assert same == sig and hash(same) == hash(sig) and same.key() == sig.key()
    assert sig.ndim == 2 and sig.out_spatial == (56, 56)
    assert ConvSig((2, 4, 9), (4, 4, 3), 1, 0, 1, 1, torch.bfloat16, "cpu").key() == \
        "conv1d|x=2x4x9|w=4x4x3|s=1|p=0|d=1|g=1|bf16|cpu|cf"


def test_sig_from_tensors():
    x, w, _ = make((2, 4, 10, 12), (8, 2, 5, 3), channels_last=True)
    sig = ConvSig.from_tensors(x, w, 2, "same", (1, 2), 2, dynamic_batch=True)
    assert sig.x_shape == (None, 4, 10, 12) and sig.padding == (2, 2) and sig.dilation == (1, 2)
    assert sig.channels_last and sig.dtype == torch.float64 and sig.device_type == "cpu"
    with pytest.raises(ValueError):
        ConvSig.from_tensors(x, torch.zeros(8, 2, 4, 4, dtype=x.dtype), 1, "same", 1, 2)


def test_compute_dtype():
    assert compute_dtype(torch.float16, "cpu") == torch.float32
    assert compute_dtype(torch.bfloat16, "cpu") == torch.float32
    assert compute_dtype(torch.float16, "cuda") == torch.float16
    assert compute_dtype(torch.float64, "cpu") == torch.float64


def test_next_fast_len():
    assert [next_fast_len(n) for n in (1, 11, 13, 17, 97, 1031, 2177)] == [1, 12, 14, 18, 98, 1050, 2187]
    for n in range(1, 300):
        m = next_fast_len(n)
        r = m
        for p in (2, 3, 5, 7):
            while r % p == 0:
                r //= p
        assert m >= n and r == 1


# ------------------------------------------------------------------ legality
def _sig(x, w, s=1, p=0, d=1, g=1, dtype=torch.float32, dev="cpu"):
    return ConvSig(x, w, s, p, d, g, dtype, dev)


@pytest.mark.parametrize("name, sig", [
    ("winograd_2x2_3x3", _sig((1, 4, 8, 8), (4, 4, 5, 5))),
    ("winograd_2x2_3x3", _sig((1, 4, 8, 8), (4, 4, 3, 3), s=2)),
    ("winograd_4x4_3x3", _sig((1, 4, 8, 8), (4, 4, 3, 3), d=2)),
    ("winograd_4x4_3x3", _sig((1, 4, 8), (4, 4, 3))),
    ("fft", _sig((1, 4, 8, 8), (4, 4, 3, 3), s=2)),
    ("fft", _sig((1, 4, 16), (4, 4, 3), d=3)),
    ("fft", _sig((1, 2048, 128, 128), (2048, 2048, 3, 3))),  # kernel spectrum too large
    ("direct", _sig((1, 4, 8, 8), (4, 3, 3, 3))),  # channel mismatch
    ("gemm", _sig((1, 4, 2, 2), (4, 4, 3, 3))),  # empty output
    ("direct", _sig((1, 6, 8, 8), (4, 2, 3, 3), g=3)),  # OC % groups
])
def test_illegal_cases_give_a_one_line_reason(name, sig):
    reason = get_algorithm(name).legal(sig)
    assert isinstance(reason, str) and reason and "\n" not in reason
    assert name not in legal_algorithms(sig)
    assert math.isinf(get_algorithm(name).estimate_ms(sig, 1))


def test_legal_algorithms():
    assert legal_algorithms(_sig((None, 8, 9, 9), (8, 8, 3, 3), p=1)) == NAMES
    assert legal_algorithms(_sig((None, 8, 9, 9), (8, 8, 3, 3), s=2, p=1)) == ["direct", "gemm"]
    assert legal_algorithms(_sig((None, 8, 9, 9), (16, 1, 3, 3), p=2, g=8)) == NAMES
    assert legal_algorithms(_sig((None, 8, 64), (8, 8, 17), p=8)) == ["direct", "fft", "gemm"]
    assert legal_algorithms(_sig((None, 8, 5, 6, 7), (8, 4, 3, 3, 3), p=1, g=2)) == ["direct", "fft", "gemm"]


# ------------------------------------------------------------------ hand-picked shapes
CASES_3X3 = [  # (x_shape, w_shape, padding, groups): tails, padding 0/1/2/3, grouped, depthwise
    ((2, 4, 7, 9), (6, 4, 3, 3), 1, 1),
    ((2, 4, 11, 5), (6, 4, 3, 3), 0, 1),
    ((1, 3, 3, 3), (5, 3, 3, 3), 0, 1),  # a single output pixel
    ((1, 3, 1, 2), (2, 3, 3, 3), 1, 1),  # input smaller than the tile
    ((2, 4, 13, 14), (6, 4, 3, 3), 2, 1),
    ((1, 2, 6, 10), (4, 2, 3, 3), 3, 1),
    ((2, 6, 9, 8), (9, 2, 3, 3), 1, 3),  # grouped
    ((2, 8, 10, 7), (8, 1, 3, 3), 1, 8),  # depthwise
    ((1, 4, 6, 11), (12, 1, 3, 3), 2, 4),  # depthwise, channel multiplier 3
]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", CASES_3X3, ids=lambda c: f"{c[0]}-{c[1]}-p{c[2]}-g{c[3]}")
def test_3x3_cases(name, case):
    xs, ws, p, g = case
    for dtype in (torch.float64, torch.float32):
        x, w, b = make(xs, ws, dtype)
        check(name, x, w, b, padding=p, groups=g)
    check(name, x, w, None, padding=p, groups=g, prepack=False)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("groups", [1, 4])
def test_channels_last_input(name, groups):
    x, w, b = make((2, 4, 9, 10), (8, 4 // groups, 3, 3), torch.float32, channels_last=True)
    y = check(name, x, w, b, padding=1, groups=groups)
    if name != "direct":
        assert y.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("stride, groups, cl", [(1, 1, True), (1, 1, False), (2, 1, True), (3, 2, False),
                                                (1, 4, True), (2, 4, False)])
def test_gemm_1x1(stride, groups, cl):
    x, w, b = make((2, 8, 7, 9), (12, 8 // groups, 1, 1), torch.float32, channels_last=cl)
    y = check("gemm", x, w, b, stride=stride, groups=groups)
    assert y.is_contiguous(memory_format=torch.channels_last if cl else torch.contiguous_format)


@pytest.mark.parametrize("xs, ws, s, p, d, g", [
    ((2, 4, 17), (6, 4, 5), 1, 2, 1, 1),
    ((2, 4, 17), (6, 2, 5), 2, 3, 2, 2),
    ((1, 3, 20), (3, 1, 9), 1, 10, 1, 3),
    ((2, 3, 11, 13), (5, 3, 3, 5), (2, 1), (1, 2), (2, 1), 1),
    ((1, 4, 9, 9), (4, 1, 7, 7), 1, 3, 1, 4),
    ((1, 4, 6, 7, 5), (6, 2, 3, 2, 3), 1, (1, 0, 2), 1, 2),
    ((1, 2, 5, 6, 7), (4, 2, 1, 1, 1), 2, 0, 1, 1),
    ((1, 4, 8, 8), (4, 4, 1, 1), 1, 1, 1, 1),  # 1x1 with padding -> im2col path
])
def test_gemm_general(xs, ws, s, p, d, g):
    for dtype in (torch.float64, torch.float32):
        x, w, b = make(xs, ws, dtype)
        check("gemm", x, w, b, stride=s, padding=p, dilation=d, groups=g)


@pytest.mark.parametrize("xs, ws, p, g", [
    ((1, 4, 2048), (4, 4, 257), 128, 1),  # long 1-D kernel, dense
    ((2, 4, 2048), (8, 1, 257), 0, 4),  # long 1-D kernel, depthwise x2
    ((1, 2, 2048), (2, 2, 1024), 512, 1),  # 1024 taps
    ((1, 8, 40, 40), (8, 1, 31, 31), 15, 8),  # 31x31 depthwise, small batch
    ((1, 4, 56, 56), (4, 1, 51, 51), 25, 4),  # 51x51 depthwise
    ((2, 6, 12, 10), (4, 3, 7, 5), (3, 2), 2),  # grouped, odd kernel shape
    ((1, 3, 5), (3, 1, 3), 4, 3),  # padding > kernel: output longer than the input
    ((1, 2, 4, 3), (2, 2, 5, 5), 4, 1),  # kernel larger than the input
    ((1, 4, 6, 5, 7), (4, 4, 3, 3, 3), 1, 1),  # 3-D
])
def test_fft_large_and_odd_kernels(xs, ws, p, g):
    for dtype in (torch.float64, torch.float32):
        x, w, b = make(xs, ws, dtype)
        check("fft", x, w, b, padding=p, groups=g)


def test_prepare_is_a_single_weight_only_tensor():
    x, w, _ = make((2, 4, 9, 9), (6, 2, 3, 3), torch.float32)
    sig = ConvSig.from_tensors(x, w, 1, 1, 1, 2)
    assert ALGORITHMS["direct"].prepare(w, sig) is None
    for name in NAMES[1:]:
        pp = ALGORITHMS[name].prepare(w, sig)
        assert isinstance(pp, torch.Tensor), name
    assert ALGORITHMS["fft"].prepare(w, sig).is_complex()
    assert ALGORITHMS["winograd_4x4_3x3"].prepare(w, sig).shape == (36, 2, 3, 2)
    # a prepacked tensor is reusable across batch sizes (symbolic N)
    dyn = ConvSig.from_tensors(x, w, 1, 1, 1, 2, dynamic_batch=True)
    for name in NAMES:
        pp = ALGORITHMS[name].prepare(w, dyn)
        for n in (1, 3):
            xn = torch.randn(n, 4, 9, 9)
            torch.testing.assert_close(ALGORITHMS[name].run(xn, w, pp, None, dyn),
                                       F.conv2d(xn, w, None, 1, 1, 1, 2), rtol=1e-3, atol=3e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_half_precision_fixed_cases(name, dtype):
    for xs, ws, p, g in [((2, 8, 10, 11), (8, 8, 3, 3), 1, 1), ((1, 8, 9, 7), (8, 1, 3, 3), 2, 8)]:
        x, w, b = make(xs, ws, dtype, seed=3)
        check(name, x, w, b, padding=p, groups=g)
    if name in ("fft", "gemm", "direct"):
        x, w, b = make((1, 4, 512), (4, 4, 65), dtype, seed=4)
        check(name, x, w, b, padding=32)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("groups,cg,stride,padding,dilation", [(2, 16, 1, 1, 1), (3, 24, 2, 1, 1), (4, 16, 1, 2, 2),
                                                            (8, 16, 1, 0, 1)])
def test_blockdiag_is_the_grouped_conv(groups, cg, stride, padding, dilation, channels_last):
    """The dense conv over the block-diagonal weight gives the grouped conv (float64: exact up to
    the order of the sums); its prepacked weight keeps the input's layout, and the fake
    ``prepack_conv_weight`` gives the real one's shape, dtype and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxopt.ops import PREPACK

    algo = get_algorithm("blockdiag")
    x, w, b = make((2, groups * cg, 9, 9), (groups * 8, cg, 3, 3), channels_last=channels_last)
    sig = ConvSig.from_tensors(x, w, stride, padding, dilation, groups)
    assert "CUDA only" in algo.legal(sig)
    sig = ConvSig(sig.x_shape, sig.w_shape, sig.stride, sig.padding, sig.dilation, groups, sig.dtype, "cuda",
                  sig.channels_last)
    assert algo.legal(sig) is None and "blockdiag" in legal_algorithms(sig)
    packed = algo.prepare(w, sig)
    assert packed.shape == (groups * 8, groups * cg, 3, 3) and packed.dtype == w.dtype
    assert packed.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    for i in range(groups):  # zeros off the diagonal blocks
        off = packed[i * 8:(i + 1) * 8].clone()
        off[:, i * cg:(i + 1) * cg] = 0
        assert not off.any()
    ref = F.conv2d(x, w, b, stride, padding, dilation, groups)
    for pp in (packed, None):
        y = algo.run(x, w, pp, b, sig)
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
        assert y.stride() == ref.stride()
    args = (list(sig.x_shape), list(sig.stride), list(sig.padding), list(sig.dilation), groups, x.dtype, channels_last)
    real = PREPACK(w, "blockdiag", *args)
    with FakeTensorMode() as mode:
        fake = PREPACK(mode.from_tensor(w), "blockdiag", *args)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


@pytest.mark.parametrize("sig,why", [
    (_sig((1, 32, 8, 8), (32, 32, 3, 3), dev="cuda"), "groups"),          # one group
    (_sig((1, 160, 8, 8), (160, 16, 3, 3), g=10, dev="cuda"), "groups"),  # more than 8
    (_sig((1, 32, 8, 8), (32, 8, 3, 3), g=4, dev="cuda"), "input channels"),  # narrow groups
    (_sig((1, 32, 8, 8), (32, 16, 3, 3), g=2), "CUDA"),                   # the CPU
])
def test_blockdiag_only_for_few_wide_groups_on_cuda(sig, why):
    reason = get_algorithm("blockdiag").legal(sig)
    assert reason and why in reason and "\n" not in reason
    assert math.isinf(get_algorithm("blockdiag").estimate_ms(sig, 1))


def test_blockdiag_estimate_prunes_it_where_the_arithmetic_dominates():
    """At batch 1 a few-group conv is launch-bound and blockdiag stays a candidate; at a large batch
    its ``groups`` times the multiply-adds price it out for 8 groups."""
    sig = _sig((None, 512, 14, 14), (512, 64, 3, 3), p=1, g=8, dtype=torch.float16, dev="cuda")
    direct, dense = ALGORITHMS["direct"], ALGORITHMS["blockdiag"]
    assert dense.estimate_ms(sig, 1) < 4 * direct.estimate_ms(sig, 1)
    assert dense.estimate_ms(sig, 256) > 4 * direct.estimate_ms(sig, 256)


def test_tolerances_are_ordered():
    for name, algo in ALGORITHMS.items():
        tols = [algo.tolerance(dt) for dt in (torch.float64, torch.float32, torch.float16)]
        assert tols == sorted(tols), name
    assert ALGORITHMS["winograd_4x4_3x3"].tolerance(torch.float16) > ALGORITHMS["fft"].tolerance(torch.float16)


# ------------------------------------------------------------------ cost model
def _best(sig, batch=16):
    est = {n: ALGORITHMS[n].estimate_ms(sig, batch) for n in legal_algorithms(sig)}
    assert all(0 < v for v in est.values()), est
    return min(est, key=est.get)


@pytest.mark.parametrize("dev", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cost_model_preferences(dev, dtype):
    dw = lambda k: ConvSig((None, 64, 56, 56), (64, 1, k, k), 1, k // 2, 1, 64, dtype, dev)  # noqa: E731
    assert _best(dw(3)) == "direct" and _best(dw(7)) == "direct"
    assert _best(dw(31)) == "fft" and _best(dw(51)) == "fft"
    assert _best(ConvSig((None, 16, 8192), (16, 1, 1024), 1, 512, 1, 16, dtype, dev)) == "fft"
    assert _best(ConvSig((None, 16, 8192), (16, 16, 1024), 1, 512, 1, 1, dtype, dev)) == "fft"
    assert _best(ConvSig((None, 16, 8192), (16, 16, 3), 1, 1, 1, 1, dtype, dev)) == "direct"
    for c, h in ((64, 56), (256, 14), (512, 7)):
        sig = ConvSig((None, c, h, h), (c, c, 3, 3), 1, 1, 1, 1, dtype, dev)
        assert _best(sig) != "fft"
        if dtype != torch.float32:
            assert math.isinf(ALGORITHMS["winograd_4x4_3x3"].estimate_ms(sig, 16))
            assert _best(sig, 1) != "winograd_4x4_3x3" and _best(sig, 256) != "winograd_4x4_3x3"


def test_cost_model_scales_with_batch():
    sig = ConvSig((None, 64, 56, 56), (64, 64, 3, 3), 1, 1, 1, 1, torch.float32, "cpu")
    for name in legal_algorithms(sig):
        a = ALGORITHMS[name]
        assert a.estimate_ms(sig, 1) < a.estimate_ms(sig, 8) < math.inf, name


# ------------------------------------------------------------------ property tests
@st.composite
def conv_cases(draw, max_ndim=3):
    nd = draw(st.integers(1, max_ndim))
    g = draw(st.integers(1, 3))
    cg, ocg = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    k = [draw(st.integers(1, 4)) for _ in range(nd)]
    s = [draw(st.integers(1, 3)) for _ in range(nd)]
    d = [draw(st.integers(1, 2)) for _ in range(nd)]
    p = [draw(st.integers(0, 2)) for _ in range(nd)]
    lo = [max(1, di * (ki - 1) + 1 - 2 * pi) for ki, di, pi in zip(k, d, p)]  # output >= 1
    sp = [draw(st.integers(lo_i, lo_i + 9 - 3 * (nd == 3))) for lo_i in lo]
    x_shape = (draw(st.integers(1, 2)), g * cg, *sp)
    return x_shape, (g * ocg, cg, *k), tuple(s), tuple(p), tuple(d), g


@settings(max_examples=_examples(40), deadline=None)
@given(case=conv_cases(), dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 99))
def test_property_every_legal_algorithm_matches_direct(case, dtype, seed):
    xs, ws, s, p, d, g = case
    x, w, b = make(xs, ws, dtype, seed)
    sig = ConvSig.from_tensors(x, w, s, p, d, g)
    for name in legal_algorithms(sig):
        check(name, x, w, b, s, p, d, g)


@settings(max_examples=_examples(40), deadline=None)
@given(h=st.integers(1, 14), w_=st.integers(1, 14), p=st.integers(0, 3), g=st.integers(1, 3),
       cg=st.integers(1, 3), ocg=st.integers(1, 3), n=st.integers(1, 2), cl=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]), name=st.sampled_from(NAMES[1:3]))
def test_property_winograd(h, w_, p, g, cg, ocg, n, cl, dtype, name):
    h, w_ = max(h, 3 - 2 * p), max(w_, 3 - 2 * p)
    x, w, b = make((n, g * cg, h, w_), (g * ocg, cg, 3, 3), dtype, seed=h * 31 + w_, channels_last=cl)
    check(name, x, w, b, padding=p, groups=g)


@settings(max_examples=_examples(30), deadline=None)
@given(nd=st.integers(1, 2), k=st.integers(1, 40), p=st.integers(0, 24), extra=st.integers(0, 40),
       g=st.integers(1, 3), cg=st.integers(1, 2), ocg=st.integers(1, 2),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_property_fft(nd, k, p, extra, g, cg, ocg, dtype):
    if nd == 2:
        k, p, extra = min(k, 15), min(p, 8), min(extra, 12)
    p = min(p, k + 2)
    size = max(1, k - 2 * p) + extra
    x, w, b = make((1, g * cg, *[size] * nd), (g * ocg, cg, *[k] * nd), dtype, seed=k + 7 * p)
    check("fft", x, w, b, padding=p, groups=g)


@settings(max_examples=_examples(40), deadline=None)
@given(case=conv_cases(), cl=st.booleans(), seed=st.integers(0, 99))
def test_property_fused_conv_gives_the_direct_convolutions_strides(case, cl, seed):
    """Whatever the algorithm, the fused convolution's output has the strides of F.conv, also where
    they only differ in size-1 dimensions (found by the thorough hypothesis profile: gemm returned
    (4, 1, 1) where F.conv gives (4, 4, 1))."""
    from fxopt.ops import conv_by_algorithm

    xs, ws, s, p, d, g = case
    x, w, b = make(xs, ws, torch.float32, seed)
    if cl and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    sig = ConvSig.from_tensors(x, w, s, p, d, g)
    ref = CONV[sig.ndim](x, w, b, sig.stride, sig.padding, sig.dilation, g)
    for name in legal_algorithms(sig):
        algo = get_algorithm(name)
        y = conv_by_algorithm(x, w, b, sig.stride, sig.padding, sig.dilation, g, name, algo.prepare(w, sig))
        assert y.stride() == ref.stride(), (name, sig.key(), y.stride(), ref.stride())
        torch.testing.assert_close(y, ref, rtol=algo.tolerance(x.dtype)[0], atol=algo.tolerance(x.dtype)[1])


@pytest.mark.parametrize("shape", [(1, 1, 8), (1, 1, 3, 3), (2, 1, 1, 1), (1, 3, 1, 5)])
def test_fused_conv_strides_for_size_one_dims(shape):
    from fxopt.ops import conv_by_algorithm

    x, w, b = make(shape, (2, shape[1], *[1] * (len(shape) - 2)), torch.float32, seed=3)
    for xi in ((x, x.contiguous(memory_format=torch.channels_last)) if x.dim() == 4 else (x,)):
        sig = ConvSig.from_tensors(xi, w, 1, 0, 1, 1)
        ref = CONV[sig.ndim](xi, w, b, sig.stride, sig.padding, sig.dilation, 1)
        for name in legal_algorithms(sig):
            y = conv_by_algorithm(xi, w, b, sig.stride, sig.padding, sig.dilation, 1, name, None)
            assert y.stride() == ref.stride(), (name, shape, y.stride(), ref.stride())
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_prepacked_shape_and_dtype_do_not_depend_on_the_device(dtype):
    w = torch.randn(6, 2, 3, 3).to(dtype)
    for name in NAMES[1:]:
        a, b = (ALGORITHMS[name].prepare(w, ConvSig((None, 4, 9, 9), (6, 2, 3, 3), 1, 1, 1, 2, dtype, dev))
                for dev in ("cpu", "cuda"))
        assert a.shape == b.shape and a.dtype == b.dtype, name


# --------------------------------------------------------------------------
# cuDNN algorithm choice: heuristics while fxopt compiles and runs, unless cudnn_search
# --------------------------------------------------------------------------
@pytest.fixture
def benchmark_on():
    old = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True
    yield
    torch.backends.cudnn.benchmark = old


def test_cudnn_choosing_turns_the_search_off_inside_only(benchmark_on):
    from fxopt.autotune import cudnn_choice, cudnn_choosing

    with cudnn_choosing(False):
        assert torch.backends.cudnn.benchmark is False
    assert torch.backends.cudnn.benchmark is True
    with pytest.raises(ValueError):
        with cudnn_choosing(False):
            raise ValueError("boom")
    assert torch.backends.cudnn.benchmark is True  # restored after an exception too
    with cudnn_choosing(True):
        assert torch.backends.cudnn.benchmark is True

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    seen = []
    gm.register_forward_pre_hook(lambda m, a: seen.append(torch.backends.cudnn.benchmark))
    heuristics, search = cudnn_choice(gm, False), cudnn_choice(gm, True)
    torch.testing.assert_close(heuristics(-torch.ones(2)), torch.zeros(2))
    search(torch.ones(2))
    assert seen == [False, True] and torch.backends.cudnn.benchmark is True
    assert search is gm and not hasattr(heuristics, "graph")  # the module's own state is not copied


def test_option_cudnn_search_decides_how_cudnn_chooses(benchmark_on, monkeypatch):
    import fxopt.backends
    import fxopt.conv_algorithms as ops  # the library convolution's table (``library_conv``)
    from fxopt.config import Options
    from fxopt.testing import compile_with_fxopt

    at_run, at_compile = [], []

    def spy(*args):
        at_run.append(torch.backends.cudnn.benchmark)
        return F.conv2d(*args)

    real_lower = fxopt.backends.lower

    def lower(*args, **kwargs):
        at_compile.append(torch.backends.cudnn.benchmark)
        return real_lower(*args, **kwargs)

    monkeypatch.setitem(ops._CONV, 2, spy)
    monkeypatch.setattr(fxopt.backends, "lower", lower)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    for search in (False, True):
        torch._dynamo.reset()
        at_run.clear()
        at_compile.clear()
        # the torch executor: the cpu executor runs no cuDNN (nor this spy, in its oneDNN convs)
        fn = compile_with_fxopt(model, {"cudnn_search": search, "executor": "torch"})
        with torch.no_grad():
            torch.testing.assert_close(fn(x), model(x))
        assert at_compile == [search] and at_run and set(at_run) == {search}, (search, at_compile, at_run)
        assert torch.backends.cudnn.benchmark is True
    with pytest.raises(ValueError, match="cudnn_search"):
        Options.from_any({"cudnn_search": "yes"})


def test_library_conv_searches_only_grouped_cuda_convs(monkeypatch):
    """cuDNN's search (``cudnn.benchmark`` on for the call, off after) for a grouped conv of 2+
    channels a group on CUDA outside a capture; the heuristics for dense, depthwise, CPU convs."""
    import types

    import fxopt.conv_algorithms as CA

    cuda = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert CA.searched_grouped(cuda, torch.empty(64, 16, 3, 3), 4)
    assert not CA.searched_grouped(cuda, torch.empty(64, 1, 3, 3), 64)  # depthwise
    assert not CA.searched_grouped(cuda, torch.empty(64, 64, 3, 3), 1)  # dense
    assert not CA.searched_grouped(types.SimpleNamespace(is_cuda=False), torch.empty(64, 16, 3, 3), 4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not CA.searched_grouped(cuda, torch.empty(64, 16, 3, 3), 4)  # a capture: the cached plan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # fake CUDA tensors without a GPU
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: 1 / 0)
    assert not CA.searched_grouped(cuda, torch.empty(64, 16, 3, 3), 4)
    seen = []

    def conv(x, w, b, s, p, d, g):
        seen.append(torch.backends.cudnn.benchmark)
        return F.conv2d(x, w, b, s, p, d, g)

    monkeypatch.setitem(CA._CONV, 2, conv)
    monkeypatch.setattr(CA, "searched_grouped", lambda x, w, g: g > 1)
    x, w = torch.randn(1, 8, 5, 5), torch.randn(8, 2, 3, 3)
    torch.testing.assert_close(CA.library_conv(x, w, None, 1, 1, 1, 4), F.conv2d(x, w, None, 1, 1, 1, 4))
    CA.library_conv(x, torch.randn(8, 8, 3, 3), None, 1, 1, 1, 1)
    assert seen == [True, False] and not torch.backends.cudnn.benchmark
