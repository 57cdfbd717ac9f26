"""Column reductions of heavy math (``column_reduction.element_work``, ``region.parallel_variant``):
a squeeze-excite mean with its SiLU epilogue inlined, or a plain one whose default plan leaves the
GPU under-filled (``column_reduction.underfilled``: a mean at batch 1), gets a second candidate
planned for more threads, measured against the default plan on the GPU. On the CPU: the work count, the plans, every
thread of the alternative kernel run by ``fxopt.fuzz.simt`` against the IR, and the candidate offered
(and compiled with NVRTC) only where it differs."""
import dataclasses
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import assume, event, given, settings, strategies as st

import fxopt
from fxopt.backends.cuda import ir
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda.kernels import column_reduction as cr
from fxopt.backends.cuda.kernels.region import generate_kernel
from fxopt.backends.cuda.kernels.pointwise import vector_width
from fxopt.fuzz.simt import check_column_geometry

from test_column_reduction import column_kernel


HEAVY = re.compile(r"_cols\d+v\d+(s\d+)?t?x?w\d+f?_")  # a kernel planned for heavy math (``w<work>``; ``f``: fast_math)
LATENCY = re.compile(r"_cols\d+v\d+(s\d+)?x?lf?_")  # the latency plan of an under-filled one


def silu_mean(shape, dtype=torch.float32):
    """The spatial mean of silu(x) of a channels_last tensor of ``shape``."""
    k = column_kernel(shape, (0, 2, 3, 1), (2, 3), dtype, op="mean")
    x = k.phases[0].value
    silu = ir.op("div", x, ir.op("add", ir.Const(1.0), ir.op("exp", ir.op("neg", x))))
    return dataclasses.replace(k, phases=[dataclasses.replace(k.phases[0], value=silu)])


def test_element_work_counts_the_heavy_math_per_element():
    assert cr.element_work(column_kernel((2, 8, 3, 3), (0, 2, 3, 1), (2, 3), op="mean")) == 1
    assert cr.element_work(silu_mean((2, 8, 3, 3))) == 3  # exp and the division


@pytest.mark.parametrize("shape", [(8, 1536, 10, 10), (8, 960, 19, 19), (1, 672, 14, 14), (32, 1280, 7, 7)])
def test_heavy_plans_use_more_threads_fewer_elements_each(shape):
    k = silu_mean(shape)
    vec = cr.column_vector_width(k)
    base, heavy = cr.column_plan(k, vec), cr.column_plan(k, vec, cr.element_work(k))
    threads = lambda p: p.block * -(-p.tiles // 1) * p.splits  # noqa: E731
    assert threads(heavy) >= threads(base)
    assert -(-k.row_size // (heavy.by * heavy.splits)) <= -(-k.row_size // (base.by * base.splits))
    assert cr.column_plan(k, vec, 1) == base  # work 1: the default plan, unchanged


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 24, 5, 7), (3, 40, 10, 10), (1, 64, 3, 3), (2, 8, 1, 2)])
def test_every_thread_of_the_heavy_plan(shape, dtype):
    k = silu_mean(shape, dtype)
    ks = generate_kernel(k, vector_width(k), work=cr.element_work(k))
    assert "w3" in ks.name
    check_column_geometry(ks, high=8, rtol=1e-5, atol=1e-5)


class SqueezeExcite(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.conv, self.fc1, self.fc2 = nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, 8, 1), nn.Conv2d(8, c, 1)

    def forward(self, x):
        y = torch.nn.functional.silu(self.conv(x))
        return y * torch.sigmoid(self.fc2(torch.relu(self.fc1(y.mean((2, 3), keepdim=True)))))


def _kernels(model, x):
    r = fxopt.explain(model.eval(), x, options={"executor": "cuda", "layout": "channels_last"})
    return [k for g in r.graphs for k in g.kernels]


def test_the_squeeze_mean_gets_the_parallel_candidate():
    torch.manual_seed(0)
    names = [k.name for k in _kernels(SqueezeExcite(), torch.randn(8, 32, 20, 20))]
    means = [n for n in names if n.startswith("fx_red_mean")]
    assert any(HEAVY.search(n) for n in means) and any(not HEAVY.search(n) for n in means), means


def test_plain_means_get_it_only_where_the_default_plan_is_underfilled():
    """A plain spatial mean of few columns and many positions (32 columns x 400 positions) is bound
    by each thread's chain of loads, not by bandwidth: the latency plan (``l``) is its candidate too;
    one of two positions per column is not."""
    torch.manual_seed(0)
    pool = nn.Sequential(nn.Conv2d(32, 32, 3, padding=1), nn.AdaptiveAvgPool2d(1))
    long = [k.name for k in _kernels(pool, torch.randn(8, 32, 20, 20)) if k.name.startswith("fx_red_mean")]
    assert any(LATENCY.search(n) for n in long) and any(not LATENCY.search(n) for n in long), long
    short = [k.name for k in _kernels(pool, torch.randn(8, 32, 1, 2)) if k.name.startswith("fx_red_mean")]
    assert short and not any(HEAVY.search(n) or LATENCY.search(n) for n in short), short


def test_an_underfilled_squeeze_mean_gets_both_plans():
    """A squeeze-excite mean at batch 1 (SiLU inlined, 32 columns x 400 positions): heavy math and
    under-filled, so both other plans are candidates."""
    torch.manual_seed(0)
    names = [k.name for k in _kernels(SqueezeExcite(), torch.randn(1, 32, 20, 20)) if k.name.startswith("fx_red_mean")]
    assert any(HEAVY.search(n) for n in names) and any(LATENCY.search(n) for n in names), names


@pytest.mark.parametrize("shape, want", [
    # (bx, by, splits): one warp a block at least, ~8 elements a thread, over blocks only past 16
    ((1, 1536, 7, 7), (4, 8, 1)), ((1, 1536, 14, 14), (1, 32, 1)), ((1, 512, 28, 28), (1, 64, 1)),
    ((1, 256, 56, 56), (1, 32, 8)), ((32, 1536, 7, 7), (4, 8, 1)), ((8, 32, 20, 20), (1, 64, 1))])
def test_underfilled_plans_get_short_chains_and_small_blocks(shape, want):
    k = column_kernel(shape, (0, 2, 3, 1), (2, 3), torch.float16, op="mean")
    vec = cr.column_vector_width(k)
    base, alt = cr.column_plan(k, vec), cr.column_plan(k, vec, cr.LATENCY_WORK)
    assert cr.underfilled(k, vec)
    chain = lambda p: -(-k.row_size // (p.by * p.splits))  # noqa: E731 - loads a thread chains
    assert (alt.bx, alt.by, alt.splits) == want and alt.shfl and alt.block <= 64
    assert chain(alt) <= min(chain(base), 2 * cr.LATENCY_ITERS)
    assert alt.tiles * alt.splits >= base.tiles * base.splits and alt.splits <= base.splits  # no fewer blocks
    check_column_geometry(generate_kernel(k, vec, work=cr.LATENCY_WORK), high=4, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("shape", [(256, 2048, 2, 2), (8, 32, 1, 2)])
def test_filled_or_short_plans_are_not_underfilled(shape):
    """Enough column groups to fill the GPU (524,288 rows), or chains of two loads."""
    k = column_kernel(shape, (0, 2, 3, 1), (2, 3), torch.float16, op="mean")
    assert not cr.underfilled(k, cr.column_vector_width(k))


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
def test_the_parallel_candidate_compiles():
    torch.manual_seed(0)
    ks = [k for k in _kernels(SqueezeExcite(), torch.randn(8, 32, 20, 20)) if HEAVY.search(k.name)]
    assert ks and all(k.compiled for k in ks), [(k.name, k.compiled) for k in ks]


def test_emulated_inputs_with_gaps_between_elements():
    """An input read in place as a piece of a wider tensor (strides leave gaps): the emulator lays its
    elements out where the strides put them (CPU fuzz seed 9, 9f7dbe6073: a split piece under a
    LayerNorm over channels raised in the emulator's setup, not in the kernel)."""
    from fxopt.backends.cuda.ir import Buffer, Ix, Load, Phase, ReductionKernel, Store, Var
    from fxopt.backends.cuda.schedule.loops import arrange

    x0, x1, x2 = Var("i0", 2), Var("i1", 4), Var("i2", 3)
    src = Buffer("x", (2, 4, 3), (24, 6, 1), torch.float32)  # width 3 of a width-6 tensor
    out = Buffer("out", (2, 3), (3, 1), torch.float32)
    load = Load(0, Ix.of(x0) * 24 + Ix.of(x1) * 6 + Ix.of(x2))
    k = ReductionKernel("fx_red_sum_1", [x0, x2], [x1], [src], [out], [Phase("acc", "sum", load)], [],
                        [Store(0, Ix.of(x0) * 3 + Ix.of(x2), ir.Red("acc"))])
    arrange(k)
    assert src.span() > 24  # gaps
    check_column_geometry(generate_kernel(k, vector_width(k)))


def test_a_latency_plan_keeps_its_split_within_the_block():
    """[1, 1536, 14, 14] at batch 1: the default plan splits the 196 positions over 2 blocks (a
    ticket and scratch); the latency plan gives them to 32 threads of a block, combined by warp
    shuffles (one warp: no tree, one row of partials), each thread a chain of 7 loads."""
    k = column_kernel((1, 1536, 14, 14), (0, 2, 3, 1), (2, 3), torch.float16, op="mean")
    vec = cr.column_vector_width(k)
    base, alt = cr.column_plan(k, vec), cr.column_plan(k, vec, cr.LATENCY_WORK)
    assert base.splits == 2 and (alt.splits, alt.by, alt.bx) == (1, 32, 1)
    ks = generate_kernel(k, vec, work=cr.LATENCY_WORK)
    src = ks.source
    assert src.count("__shfl_xor_sync") == 5 * vec and "if (ty_ <" not in src and "cnt_" not in src
    assert LATENCY.search(ks.name), ks.name
    check_column_geometry(ks, high=4, rtol=1e-3, atol=1e-3)


def test_the_emulator_sees_a_shuffle_of_part_of_a_warp():
    """A shuffle inside a branch that only some lanes of a warp take is reported."""
    from fxopt.fuzz.geometry import GeometryParseError  # noqa: F401 - the emulator's module loads

    k = column_kernel((1, 64, 4, 4), (0, 2, 3, 1), (2, 3), torch.float32, op="sum")
    ks = generate_kernel(k, cr.column_vector_width(k), work=cr.LATENCY_WORK)
    assert "__shfl_xor_sync" in ks.source
    bad = ks.source.replace("    acc_acc_0 = __fadd_rn(acc_acc_0, __shfl_xor_sync(",
                            "    if (tx_ == 0) {\n    acc_acc_0 = __fadd_rn(acc_acc_0, __shfl_xor_sync(", 1)
    first = bad.index("__shfl_xor_sync(")
    end = bad.index("\n", first)
    bad = bad[:end] + "\n    }" + bad[end:]
    with pytest.raises(AssertionError, match="part of a warp"):
        check_column_geometry(dataclasses.replace(ks, source=bad), high=4)


def test_split_tickets_are_kept_per_region_and_kernel():
    """A split reduction's counters (zeroed once, reset by the kernel's last block) are kept by the
    region that launches it, one set per kernel and device; without a region's cache, fresh ones."""
    from fxopt.backends.cuda.kernels.region import split_tickets

    mine, other = {}, {}
    a = split_tickets(mine, "k", 5, torch.device("cpu"))
    assert split_tickets(mine, "k", 5, torch.device("cpu")) is a and int(a.abs().sum()) == 0
    assert split_tickets(other, "k", 5, torch.device("cpu")) is not a
    assert split_tickets(mine, "k2", 5, torch.device("cpu")) is not a
    assert split_tickets(None, "k", 5, torch.device("cpu")) is not a
    assert split_tickets(mine, "k", 7, torch.device("cpu")).numel() == 7


@settings(deadline=None, database=None)
@given(shape=st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 8, 24, 40, 96, 200]), st.integers(1, 40),
                       st.integers(1, 40)),
       case=st.sampled_from(["spatial_cl", "batch_nchw", "softmax_c"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       work=st.sampled_from([1, 2, 3, cr.LATENCY_WORK]))
def test_every_plan_of_every_work_on_its_emulated_grid(shape, case, dtype, work):
    """Any column reduction planned for any ``work`` (the default plan, the heavy-math and the
    under-filled alternatives: splits within the block combined serially or by a tree, splits over
    blocks with their tickets) stores each output once with the IR's value, every thread of its
    grid run by the emulator."""
    if case == "spatial_cl":  # a spatial sum / mean of a channels_last tensor
        k = column_kernel(shape, (0, 2, 3, 1), (2, 3), dtype, op="mean" if shape[0] % 2 else "sum")
    elif case == "batch_nchw":  # a sum over the batch of a contiguous tensor
        k = column_kernel(shape, (0, 1, 2, 3), (0,), dtype)
    else:  # a softmax over the channels of a channels_last tensor: two phases and row stores
        k = column_kernel(shape, (0, 2, 3, 1), (1,), dtype, (0, 2, 3, 1), op="softmax")
    assume(k.strategy == "outer" and k.outer)
    ks = generate_kernel(k, cr.column_vector_width(k), work=work)
    g = ks.meta["geometry"]
    event(f"by {'> TREE_BY' if g['by'] > cr.TREE_BY else '<= TREE_BY'}, {'split' if g['splits'] > 1 else 'one block'}")
    check_column_geometry(ks, high=4, rtol=1e-3, atol=1e-3)
