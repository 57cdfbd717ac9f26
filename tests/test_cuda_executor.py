"""The cuda executor's CPU-testable part: generated epilogue kernels compile with NVRTC, and their
math (the epilogue's torch reference) equals the fused op's reference."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn as nn

import fxopt
from fxopt.backends.cuda.codegen.epilogue import template_epilogue
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.backends.cuda.kernels.conv_epilogue import GeneratedEpilogue, plan_conv_epilogue as plan
from fxopt.ops import ACTIVATIONS, apply_activation
from fxopt.testing import SmallResNet

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")


@needs_nvrtc
def test_cuda_executor_on_cpu_generates_and_compiles_kernels():
    m = SmallResNet().eval()
    r = fxopt.explain(m, torch.randn(2, 3, 32, 32), options={"executor": "cuda", "layout": "channels_last"})
    kernels = r.kernels
    assert len(kernels) >= 9  # one epilogue (two vector widths) per fused conv
    assert all(k.compiled for k in kernels), [k.error for k in kernels if not k.compiled]
    assert any("nhwc" in k.name for k in kernels)
    assert "extern \"C\" __global__" in kernels[0].source
    assert r.graphs[0].executor == "cuda"


@pytest.mark.parametrize("activation", sorted(set(ACTIVATIONS) - {"none"}) + ["none"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_epilogue_region_matches_reference(activation, layout, dtype):
    params = {"hardtanh": [0.0, 6.0], "leaky_relu": [0.1]}.get(activation, [])
    epi = GeneratedEpilogue("t", template_epilogue(True, True, activation, params), dtype, layout,
                            8 if layout == "nhwc" else 4)
    y, res = torch.randn(2, 8, 4, 4).to(dtype), torch.randn(2, 8, 4, 4).to(dtype)
    bias = torch.randn(8).to(dtype)
    got = epi.reference({"y": y, "bias": bias, "res": res})
    want = apply_activation((y.float() + bias.float()[:, None, None] + res.float()), activation, params).to(dtype)
    torch.testing.assert_close(got.to(dtype), want, rtol=1e-2, atol=1e-2)
    if nvrtc_available():
        for ks in epi.sources.values():
            ks.compile()  # raises CompileError with the log and source on a codegen bug


def test_plan_declines_without_epilogue_and_for_odd_layouts():
    r = fxopt.explain(torch.nn.Conv2d(3, 4, 3, bias=False).eval(), torch.randn(1, 3, 8, 8),
                      options={"executor": "cuda"})
    # no epilogue kernel (nothing to fuse); the direct-conv and F(2x2, 3x3) candidates are the only kernels
    assert r.kernels and all(k.name.startswith(("fx_dconv3x3_c3x4", "fx_wino_")) for k in r.kernels), \
        [k.name for k in r.kernels]
    node = next(n for n in r.after.graph.nodes if n.op == "call_function" and n.target is fxopt.ops.FUSED_CONV)
    assert plan(node) is None  # not the runnable's target: only lowered graphs are planned


def test_convs_with_the_same_epilogue_share_one_kernel_source():
    from fxopt.backends import torch_ref
    from fxopt.bench.models import build_model

    model, shape = build_model("resnet18")
    r = fxopt.explain(model.eval(), torch.randn(1, *shape), options={"executor": "torch", "layout": "channels_last"})
    gm = torch_ref.lower(r.graphs[0].after)
    plans = [p for p in (plan(n) for n in gm.graph.nodes) if p is not None]
    sources = {(ks.name, ks.source) for p in plans for ks in p.sources.values()}
    # relu / add+relu / none, each at two geometries (``small_geometry``), two vector widths each
    assert len(plans) == 20 and len(sources) <= 12 and len({name for name, _ in sources}) == len(sources)
    assert all("conv_epi_" in name and "convolution" not in name for name, _ in sources)
    assert any(name.endswith("_b128") for name, _ in sources) and any("_v4" in name and "_b128" not in name
                                                                      for name, _ in sources)


@pytest.mark.parametrize("shape,dtype,vec,block", [
    ((1, 384, 7, 7), torch.float16, 4, 128), ((1, 128, 56, 56), torch.float16, 4, 128),  # 802 KB
    ((1, 64, 112, 112), torch.float16, 8, 256), ((8, 384, 14, 14), torch.float16, 8, 256),
    ((1, 384, 14, 14), torch.float32, 2, 128), ((4, 256, 28, 28), torch.float32, 4, 256),
    ((1, 12, 7, 7), torch.float16, 4, 128), ((1, 6, 7, 7), torch.float16, 2, 128)])  # the width divides C
def test_small_epilogues_run_narrower_vectors_in_smaller_blocks(shape, dtype, vec, block):
    from fxopt.backends.cuda.kernels.conv_epilogue import small_geometry

    nbytes = math.prod(shape) * dtype.itemsize
    assert small_geometry(nbytes, dtype.itemsize)[1] == block
    conv = nn.Conv2d(shape[1], shape[1], 1).to(dtype)
    r = fxopt.explain(nn.Sequential(conv, nn.SiLU()).eval(), torch.randn(*shape).to(dtype),
                      options={"executor": "torch", "layout": "channels_last"})
    from fxopt.backends import torch_ref

    gm = torch_ref.lower(r.graphs[0].after)
    (p,) = [p for p in (plan(n) for n in gm.graph.nodes) if p is not None]
    ks = p.sources[max(p.sources)]
    assert ks.meta["vec"] == vec and ks.block == (block, 1, 1)
    assert f"__launch_bounds__({block})" in ks.source and ks.name.endswith("_b128") == (block == 128)
    if nvrtc_available():
        ks.compile()



def test_nodes_get_their_candidates_from_the_family_table_in_its_order(monkeypatch):
    from fxopt.backends import torch_ref
    from fxopt.backends.cuda import kernels
    from fxopt.backends.cuda.kernels.common import LibraryCandidate
    from fxopt.backends.cuda.runtime import executor
    from fxopt.config import Options

    r = fxopt.explain(SmallResNet().eval(), torch.randn(2, 3, 16, 16),
                      options={"executor": "torch", "layout": "channels_last"})
    gm = torch_ref.lower(r.graphs[0].after)
    options = Options()
    planned = executor.plan_nodes(gm.graph, options)
    convs = [n for n in gm.graph.nodes if n.target is fxopt.ops.fused_conv_ref]
    assert convs and [p.node for p in planned if p.node in convs] == convs  # each has an epilogue at least
    for p in planned:
        # the families' candidates, family after family in the table's order
        assert [type(c) for c in p.cands] == [type(c) for f in kernels.FAMILIES for c in f.plan(p.node, options)]
        assert list(p.candidates()) == ["reference"] + [c.key for c in p.cands if not c.sources]
        for c in p.cands:
            c.kernels.update(dict.fromkeys(c.sources, object()))  # as if compiled
        names = list(p.candidates())
        assert len(names) == len(p.cands) + 1 and names[0] == "reference", names
        assert all(n in ("generated", "cudnn_fused", "nchw") or n.startswith("generated_") for n in names[1:])
        if p.node in convs:  # the epilogue first, and compiling first
            assert names[1] == "generated" and p.first == [p.cands[0]], names
        else:
            assert p.first == [] and "generated" not in names, names
    # a family offered only beside others plans no node by itself; measured alone, it plans every node
    lib = LibraryCandidate("lib", torch.relu)
    monkeypatch.setattr(executor, "FAMILIES", (kernels.Family("lib", lambda n, o: [lib], alone=False),))
    assert executor.plan_nodes(gm.graph, options) == []
    monkeypatch.setattr(executor, "FAMILIES", (kernels.Family("lib", lambda n, o: [lib]),))
    every = executor.plan_nodes(gm.graph, options)  # every call (the graph's inputs and output are not asked)
    assert [p.node for p in every] == [n for n in gm.graph.nodes if n.op == "call_function"]
    assert every[0].candidates() == {"reference": every[0].node.target, "lib": torch.relu}



@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=5), st.data())
def test_memory_layout_ok_reads_strides_as_is_contiguous_does(shape, data):
    """The layout check planning asks (read from ints) agrees with PyTorch's ``is_contiguous`` on the
    permuted tensor, for any strides: size-1 and empty dimensions, views, overlapping strides."""
    from fxopt.backends.cuda.kernels.common import memory_layout_ok

    strides = data.draw(st.lists(st.integers(0, 40), min_size=len(shape), max_size=len(shape)))
    t = torch.empty_strided(shape, strides)
    for layout in ("nchw", "nhwc"):
        want = (t.is_contiguous() if layout == "nchw" or t.dim() <= 2
                else t.permute(0, *range(2, t.dim()), 1).is_contiguous())
        assert memory_layout_ok(t, layout) == want, (shape, strides, layout)
    dense = torch.empty(shape)
    assert memory_layout_ok(dense, "nchw")
    if dense.dim() == 4:
        assert memory_layout_ok(dense.contiguous(memory_format=torch.channels_last), "nhwc")
