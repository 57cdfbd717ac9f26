"""merge_parallel_convs: summed parallel convolutions of one input become one convolution.

Structural (what merges, what is left alone and why, idempotence), numeric (eager's results,
``graph.lint``) and a hypothesis property over random re-parameterizable blocks."""
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import fxopt
from fxopt.passinfra import PassContext
from fxopt.passes import merge_parallel_convs
from fxopt.config import Options
from fxopt.testing import check_equivalence
from fxopt.testing.strategies import Branches, CNNCase, _rand_bn

CONV_OPS = ("aten.convolution.default", "fxopt.fused_conv.default")
PASSES = ["fold_batchnorm", "merge_parallel_convs", "fold_constants"]


def bn(c, seed=0):
    return _rand_bn(nn.BatchNorm2d(c), torch.Generator().manual_seed(seed))


def convs(report) -> int:
    return sum(report.op_counts_after.get(op, 0) for op in CONV_OPS)


def record(report):
    return next(p for p in report.passes if p.name == "merge_parallel_convs")


def explain(model, x, passes=PASSES):
    torch.manual_seed(0)
    return fxopt.explain(model.eval(), x, options={"passes": passes, "strict": True})


def check(model, x, rtol=1e-4, atol=1e-4):
    """The model through the whole pipeline gives eager's result; returns the report."""
    model.eval()
    r = fxopt.explain(model, x, options={"strict": True})
    r.after.graph.lint()
    compiled = torch.compile(model, backend="fxopt", options={"strict": True})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=rtol, atol=atol)
    torch.compiler.reset()
    return r


def repvgg(c, stride=1, groups=1, identity=True):
    return Branches([nn.Sequential(nn.Conv2d(c, c, 3, stride, 1, groups=groups, bias=False), bn(c, 1)),
                     nn.Sequential(nn.Conv2d(c, c, 1, stride, 0, groups=groups, bias=False), bn(c, 2))],
                    bn(c, 3) if identity and stride == 1 else None, False, nn.ReLU())


@pytest.mark.parametrize("stride,groups", [(1, 1), (2, 1), (1, 2), (1, 4)])
def test_repvgg_block_becomes_one_convolution(stride, groups):
    m, x = repvgg(8, stride, groups), torch.randn(2, 8, 10, 10)
    r = explain(m, x)
    assert record(r).changed and convs(r) == 1
    assert not any("batch_norm" in op for op in r.op_counts_after)  # the identity BatchNorm is gone too
    assert any(n.startswith("merged") and ("identity" in n) == (stride == 1) for n in record(r).notes)
    check(m, x)


def test_asymmetric_kernels_and_the_bare_input_merge():
    m = Branches([nn.Conv2d(6, 6, 3, 1, 1), nn.Conv2d(6, 6, (1, 3), 1, (0, 1)), nn.Conv2d(6, 6, (3, 1), 1, (1, 0))],
                 None, True, nn.SiLU())
    x = torch.randn(1, 6, 9, 7)
    r = explain(m, x)
    assert convs(r) == 1 and "aten.add.Tensor" not in r.op_counts_after
    check(m, x)


def test_dilated_kernels_of_different_sizes_align():
    m = Branches([nn.Conv2d(4, 4, 5, 1, 4, dilation=2), nn.Conv2d(4, 4, 3, 1, 2, dilation=2),
                  nn.Conv2d(4, 4, 1, 1, 0, dilation=2)], bn(4), False, nn.Identity())
    x = torch.randn(2, 4, 11, 11)
    assert convs(explain(m, x)) == 1
    check(m, x)


def test_other_summed_terms_stay_added():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(4, 4, 3, 1, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, 1, 1)

        def forward(self, x):
            y = torch.relu(x)
            return self.a(x) + self.c(y) + self.b(x)  # c reads another input
    m, x = M(), torch.randn(1, 4, 6, 6)
    r = explain(m, x)
    assert convs(r) == 2 and r.op_counts_after.get("aten.add.Tensor") == 1
    check(m, x)


class Misaligned(nn.Module):
    def __init__(self, k_b=3, pad_b=1, stride_b=1, dil=1):
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, 1, dil, dilation=dil)
        self.b = nn.Conv2d(4, 4, k_b, stride_b, pad_b, dilation=dil)

    def forward(self, x):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("kw,reason", [(dict(k_b=2, pad_b=1, dil=2), "window does not align"),
                                       (dict(stride_b=2, pad_b=1), None)])
def test_negative_cases_are_left_alone(kw, reason):
    m = Misaligned(**kw)
    x = torch.randn(1, 4, 8, 8)
    try:
        with torch.no_grad():
            m(x)
    except RuntimeError:  # shapes that cannot be summed: eager refuses, nothing to merge
        return
    r = explain(m, x)
    assert convs(r) == 2 and not record(r).changed
    if reason:
        assert any(reason in n for n in record(r).notes), record(r).notes


def test_dilation_differs_is_left_alone():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 4, 3, 1, 2, dilation=2), nn.Conv2d(4, 4, 1)

        def forward(self, x):
            return self.a(x) + self.b(x)
    r = explain(M(), torch.randn(1, 4, 8, 8))
    assert convs(r) == 2 and any("stride, dilation or groups differ" in n for n in record(r).notes)


def test_a_branch_used_elsewhere_is_not_merged():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 4, 3, 1, 1), nn.Conv2d(4, 4, 1)

        def forward(self, x):
            a = self.a(x)
            return a + self.b(x), a.sigmoid()
    m, x = M(), torch.randn(1, 4, 6, 6)
    r = explain(m, x)
    assert convs(r) == 2 and not record(r).changed
    check(m, x)


def test_a_single_convolution_plus_its_input_is_left_to_the_residual_epilogue():
    m = Branches([nn.Conv2d(4, 4, 3, 1, 1)], None, True, nn.ReLU())
    r = explain(m, torch.randn(1, 4, 6, 6))
    assert not record(r).changed and any("residual epilogue" in n for n in record(r).notes)


def test_training_graphs_are_left_alone():
    m = repvgg(4).train()
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    r = fxopt.explain(m, x, options={"strict": True}, training=True)
    assert all(not p.changed for p in r.passes if p.name == "merge_parallel_convs")


def test_idempotent():
    m, x = repvgg(4), torch.randn(1, 4, 6, 6)
    r = explain(m, x)
    gm = r.after
    ctx = PassContext(Options.from_any({}, fxopt.PASS_NAMES), const_placeholders={
        n.name for n in gm.graph.nodes if n.op == "placeholder"})
    assert not merge_parallel_convs.run(gm, ctx).modified
    gm.graph.lint()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.bfloat16, 3e-2)])
def test_other_dtypes(dtype, tol):
    m, x = repvgg(8, groups=2).to(dtype), torch.randn(2, 8, 7, 7, dtype=dtype)
    check(m, x, rtol=tol, atol=tol)


@st.composite
def blocks(draw):
    c = draw(st.integers(1, 6))
    k = draw(st.sampled_from([3, 5]))
    stride, dil = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
    shapes = draw(st.lists(st.sampled_from([(k, k), (1, 1), (1, k), (k, 1), (3, 3)]), min_size=1, max_size=4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    branches = []
    for kh, kw in shapes:
        conv = nn.Conv2d(c, c, (kh, kw), stride, (dil * (kh - 1) // 2, dil * (kw - 1) // 2), dil, groups,
                         bias=draw(st.booleans()))
        branches.append(nn.Sequential(conv, _rand_bn(nn.BatchNorm2d(c), gen)) if draw(st.booleans()) else conv)
    ident = draw(st.sampled_from(["none", "x", "bn"])) if stride == 1 else "none"
    model = Branches(branches, _rand_bn(nn.BatchNorm2d(c), gen) if ident == "bn" else None, ident == "x",
                     draw(st.sampled_from([nn.ReLU(), nn.Identity(), nn.SiLU()]))).eval()
    size = draw(st.integers(2 * dil * (k - 1) // 2 + 1, 12))
    x = torch.randn(draw(st.integers(1, 2)), c, size, draw(st.integers(3, 12)), generator=gen)
    return CNNCase(model, (x,), torch.float32, False, [f"{shapes} s{stride} d{dil} g{groups} {ident}"])


@settings(max_examples=25, deadline=None)
@given(blocks())
def test_random_blocks_give_eagers_results(case):
    check_equivalence(case, options={"passes": PASSES})
    check_equivalence(case)
