"""Column reductions on a GPU (skipped without one): each geometry of ``test_column_reduction.py``
launched directly, every variant (vector and scalar), against the kernel's IR run by torch on the
same device, outputs pre-filled with NaN; and the split-attention block compiled with the cuda
executor against eager."""
import copy

import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.kernels.region import launch_fused, vector_aligned

from test_column_reduction import CONTIGUOUS, REDUCED, SplitAttn, layout, sources

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _launch_and_compare(k, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = [torch.empty_strided(b.shape, b.strides, dtype=b.dtype, device="cuda").normal_(generator=gen)
              for b in k.inputs]
    want = [torch.empty_strided(b.shape, b.strides, dtype=torch.float32, device="cuda") for b in k.outputs]
    ir.evaluate(k, inputs, want)
    for ks in sources(k):
        outs = [torch.full(b.shape, float("nan"), dtype=b.dtype, device="cuda").as_strided(b.shape, b.strides)
                for b in k.outputs]
        assert vector_aligned(ks, inputs, outs)
        launch_fused(ks, inputs, outs, ks.compile())
        launch_fused(ks, inputs, outs, ks.compile())  # twice: a split's tickets start from zero again
        for got, w in zip(outs, want):
            err = ((got.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1)).item()
            assert err <= TOL[k.inputs[0].dtype], f"{ks.name} {ks.meta['geometry']}: error {err}"


@pytest.mark.parametrize("C", CONTIGUOUS)
@pytest.mark.parametrize("R", REDUCED)
@pytest.mark.parametrize("name, dtype", [(n, d) for n in ("ncr", "cl", "cl_nhwc", "mean", "softmax")
                                         for d in (torch.float32, torch.float16)]
                         + [("ncr", torch.bfloat16), ("cl", torch.bfloat16)])
def test_column_reductions_match_their_ir(name, dtype, R, C):
    _launch_and_compare(layout(name, R, C, dtype, n=2, w=20 if R * C <= 1 << 16 else 3))


@pytest.mark.parametrize("case", [("cl", 2, 256, 16, 3136), ("cl_nhwc", 2, 256, 16, 3136), ("mean", 49, 2048, 16),
                                  ("ncr", 200704, 64, 1), ("ncr", 2, 256, 16)])
def test_the_cost_models_cases_at_full_size(case):
    _launch_and_compare(layout(case[0], case[1], case[2], torch.float16, *case[3:]))


@pytest.mark.parametrize("shape", [(1, 1536, 7, 7), (1, 1536, 14, 14), (1, 512, 28, 28), (1, 256, 56, 56),
                                   (2, 40, 20, 20)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_latency_plans_with_kept_tickets(shape, dtype):
    """The under-filled means' alternative plans (a tree over up to 64 rows of a block, a split over
    blocks) against their IR, launched three times with the region's kept ticket counters: the same
    counters each time, back at zero after every launch."""
    from fxopt.backends.cuda.kernels import column_reduction as cr
    from fxopt.backends.cuda.kernels.region import generate_kernel

    from test_column_reduction import column_kernel
    k = column_kernel(shape, (0, 2, 3, 1), (2, 3), dtype, op="mean")
    ks = generate_kernel(k, cr.column_vector_width(k), work=cr.LATENCY_WORK)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.empty_strided(b.shape, b.strides, dtype=b.dtype, device="cuda").normal_(generator=gen)
              for b in k.inputs]
    want = [torch.empty_strided(b.shape, b.strides, dtype=torch.float32, device="cuda") for b in k.outputs]
    ir.evaluate(k, inputs, want)
    kept, kernel = {}, ks.compile()
    for _ in range(3):
        outs = [torch.full(b.shape, float("nan"), dtype=b.dtype, device="cuda").as_strided(b.shape, b.strides)
                for b in k.outputs]
        launch_fused(ks, inputs, outs, kernel, tickets=kept)
        for got, w in zip(outs, want):
            err = ((got.double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1)).item()
            assert err <= TOL[dtype], f"{ks.name} {ks.meta['geometry']}: error {err}"
    assert len(kept) == (ks.meta["geometry"]["splits"] > 1)
    assert all(int(t.abs().sum()) == 0 for t in kept.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_attention_compiled_matches_eager(dtype):
    from fxopt.testing import compile_with_fxopt

    torch.manual_seed(0)
    model = SplitAttn(64).eval().cuda().to(dtype).to(memory_format=torch.channels_last)
    x = torch.randn(4, 64, 28, 28, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        got = compile_with_fxopt(copy.deepcopy(model), {"executor": "cuda"})(x)
        eager = model(x)
    err, err_eager = ((t.double() - exact).abs().max().item() for t in (got, eager))
    assert err <= max(4 * err_eager, 1e-4), f"fxopt's error against float64 {err}, eager's {err_eager}"


@settings(deadline=None, database=None)
@given(shape=st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 8, 24, 40, 96, 200, 1536]), st.integers(1, 40),
                       st.integers(1, 40)),
       case=st.sampled_from(["spatial_cl", "batch_nchw", "softmax_c"]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       work=st.sampled_from([1, 3]))
def test_every_plan_of_every_work_on_the_gpu(shape, case, dtype, work):
    """The default, heavy-math and latency plans (warp shuffles, splits over blocks with kept
    tickets) of random column reductions, launched twice, against their IR (``test_column_work.py``
    runs the same plans thread by thread on the CPU)."""
    from fxopt.backends.cuda.kernels import column_reduction as cr
    from fxopt.backends.cuda.kernels.region import generate_kernel

    from test_column_reduction import column_kernel
    if case == "spatial_cl":
        k = column_kernel(shape, (0, 2, 3, 1), (2, 3), dtype, op="mean" if shape[0] % 2 else "sum")
    elif case == "batch_nchw":
        k = column_kernel(shape, (0, 1, 2, 3), (0,), dtype)
    else:
        k = column_kernel(shape, (0, 2, 3, 1), (1,), dtype, (0, 2, 3, 1), op="softmax")
    assume(k.strategy == "outer" and k.outer)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.empty_strided(b.shape, b.strides, dtype=b.dtype, device="cuda").normal_(generator=gen)
              for b in k.inputs]
    want = [torch.empty_strided(b.shape, b.strides, dtype=torch.float32, device="cuda") for b in k.outputs]
    ir.evaluate(k, inputs, want)
    for w in (work, cr.LATENCY_WORK):
        ks = generate_kernel(k, cr.column_vector_width(k), work=w)
        kept, kernel = {}, ks.compile()
        for _ in range(2):
            outs = [torch.full(b.shape, float("nan"), dtype=b.dtype, device="cuda").as_strided(b.shape, b.strides)
                    for b in k.outputs]
            if not vector_aligned(ks, inputs, outs):
                break
            launch_fused(ks, inputs, outs, kernel, tickets=kept)
            for got, ref in zip(outs, want):
                err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1)).item()
                assert err <= TOL[dtype], f"{ks.name} {ks.meta['geometry']}: error {err}"
