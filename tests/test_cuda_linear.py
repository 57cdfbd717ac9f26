"""Linear layers over few rows (backends/cuda/schedule/linear.py, codegen/linear.py): which fused_linear nodes get a
candidate and which are declined, that every generated variant compiles with NVRTC (CPU), the
launch checks (CPU), and that the kernel computes what PyTorch computes (GPU, hypothesis over
sizes, dtypes, rows and epilogues; the compiled seed CNN picks it where it is faster)."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fxopt
from fxopt.backends import torch_ref
from fxopt.backends.cuda.codegen.epilogue import template_epilogue
from fxopt.backends.cuda.kernels.linear import MAX_ROWS, generate_linear, row_capacity, vector_width
from fxopt.backends.cuda.compiler import compile_many, nvrtc_available
from fxopt.backends.cuda.kernels.linear import launch_linear
from fxopt.backends.cuda.kernels.linear import LinearRows, plan_linear
from fxopt.ops import fused_linear_ref
from fxopt.testing.models import SeedCNN
from fxopt.tolerances import relative_error

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ACTS = [None, "relu", ("hardtanh", (0.0, 6.0)), "gelu", "silu", "sigmoid"]


def lowered(model, x, options=None):
    r = fxopt.explain(model, x, options=dict({"executor": "torch"}, **(options or {})))
    return torch_ref.lower(r.graphs[0].after)


def linear_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fused_linear_ref]


# ---------------------------------------------------------------------------- planning (CPU)
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_plans_the_three_seedcnn_linears_with_their_epilogues(batch):
    gm = lowered(SeedCNN().eval(), torch.randn(batch, 3, 32, 32))
    nodes = linear_nodes(gm)
    assert len(nodes) == 3
    cands = [plan_linear(n) for n in nodes]
    assert all(isinstance(c, LinearRows) for c in cands)
    assert [(c.spec["k"], c.spec["n"]) for c in cands] == [(400, 120), (120, 84), (84, 10)]
    assert [c.spec["epilogue"] for c in cands] == [template_epilogue(True, False, ("relu", ())),
                                                   template_epilogue(True, False, ("relu", ())), template_epilogue(True, False, None)]
    assert all(c.spec["rows"] == row_capacity(batch) and c.spec["rows"] >= batch for c in cands)
    assert all(c.spec["dtype"] == torch.float32 and c.label == "linear" for c in cands)


def _linear_graph(x, w, b, act="none"):
    """A hand-built graph: one fused_linear node over placeholders carrying example values."""
    g = torch.fx.Graph()
    nodes = []
    for name, v in (("x", x), ("w", w), ("b", b)):
        node = g.placeholder(name) if v is not None else None
        if node is not None:
            node.meta["val"] = v
        nodes.append(node)
    lin = g.call_function(fused_linear_ref, (nodes[0], nodes[1], nodes[2], act, []))
    lin.meta["val"] = torch.empty(*x.shape[:-1], w.shape[0], dtype=x.dtype)
    g.output((lin,))
    return lin


def test_declines_batches_beyond_the_row_limit_and_other_inputs():
    gm = lowered(SeedCNN().eval(), torch.randn(MAX_ROWS + 1, 3, 32, 32))
    assert [plan_linear(n) for n in linear_nodes(gm)] == [None] * 3  # a GEMM: cuBLAS
    w, b = torch.randn(4, 8), torch.randn(4)
    assert plan_linear(_linear_graph(torch.randn(2, 8), w, b, "relu")).spec["rows"] == 2
    assert plan_linear(_linear_graph(torch.randn(2, 8), w, None)).spec["epilogue"] == template_epilogue(False, False, None)
    assert plan_linear(_linear_graph(torch.randn(2, 3, 8), w, b)) is None  # 3-D input
    assert plan_linear(_linear_graph(torch.randn(2, 8).half(), w.half(), b)) is None  # fp32 bias, fp16 x
    assert plan_linear(_linear_graph(torch.randn(2, 8).half(), w, None)) is None  # fp32 weight, fp16 x
    assert plan_linear(_linear_graph(torch.randn(8, 2).T, w, b)) is None  # a transposed input
    assert plan_linear(_linear_graph(torch.randn(2, 8, dtype=torch.float64), w.double(), b.double())) is None
    assert plan_linear(_linear_graph(torch.randn(2, 8), w, b).args[0]) is None  # not a linear


def test_row_capacity_and_vector_width():
    assert [row_capacity(m) for m in (1, 2, 3, 4, 5, 16)] == [1, 2, 4, 4, 8, 16]
    with pytest.raises(ValueError):
        row_capacity(0)
    with pytest.raises(ValueError):
        row_capacity(MAX_ROWS + 1)
    assert vector_width(400, torch.float32) == 4 and vector_width(84, torch.float16) == 4
    assert vector_width(2048, torch.bfloat16) == 8 and vector_width(7, torch.float32) == 1
    with pytest.raises(ValueError):
        generate_linear(8, 8, 16, features_per_warp=4)  # 64 outputs per warp > 32 lanes
    with pytest.raises(ValueError):
        generate_linear(8, 8, 1, epilogue=template_epilogue(False, True, None))  # no residual


def test_launch_checks_sizes_dtypes_and_alignment_before_launching():
    ks = generate_linear(16, 4, 2, torch.float32, template_epilogue(True, False, None))
    x, w, b, out = torch.randn(2, 16), torch.randn(4, 16), torch.randn(4), torch.empty(2, 4)
    with pytest.raises(ValueError, match="do not match"):
        launch_linear(ks, torch.randn(2, 15), w, out, b)
    with pytest.raises(ValueError, match="rows"):
        launch_linear(ks, torch.randn(3, 16), w, torch.empty(3, 4), b)
    with pytest.raises(ValueError, match="bias missing"):
        launch_linear(ks, x, w, out, None)
    with pytest.raises(ValueError, match="contiguous"):
        launch_linear(ks, x.half(), w, out, b)
    with pytest.raises(ValueError, match="contiguous"):
        launch_linear(ks, x, torch.randn(16, 4).T, out, b)
    with pytest.raises(ValueError, match="aligned"):
        launch_linear(ks, torch.randn(2 * 16 + 1)[1:].view(2, 16), w, out, b)


def test_candidate_declines_cpu_tensors_and_other_shapes():
    c = LinearRows("lin", {"k": 16, "n": 4, "rows": 2, "dtype": torch.float32,
                           "epilogue": template_epilogue(True, False, None)})
    c.kernels[0] = object()  # "compiled": the run-time checks come first
    x, w, b = torch.randn(2, 16), torch.randn(4, 16), torch.randn(4)
    assert c(x, w, b, "none", []) is None  # CPU tensors
    assert c(torch.randn(3, 16), w, b, "none", []) is None


@needs_nvrtc
@settings(max_examples=12, deadline=None)  # each example: 1 NVRTC compilation
@given(k=st.integers(1, 600), n=st.integers(1, 300), rows=st.sampled_from([1, 2, 4, 8, 16]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), bias=st.booleans(),
       act=st.sampled_from(ACTS), nw=st.sampled_from([1, 2]))
def test_every_variant_compiles_with_nvrtc(k, n, rows, dtype, bias, act, nw):
    if rows * nw > 32:
        nw = 1
    ks = generate_linear(k, n, rows, dtype, template_epilogue(bias, False, act), nw)
    assert f"linear, few rows" in ks.source and ks.meta["vec"] == vector_width(k, dtype)
    (compiled,) = compile_many([ks])
    assert compiled.pdl_safe
    assert compiled.compiled


# ---------------------------------------------------------------------------- GPU: values
def _reference(x, w, b, act):
    y = F.linear(x.double(), w.double(), None if b is None else b.double())
    if act is None:
        return y
    if isinstance(act, tuple):
        return y.clamp(*act[1])
    return {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid}[act](y)


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, MAX_ROWS), k=st.integers(1, 2100), n=st.integers(1, 1100),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), bias=st.booleans(),
       act=st.sampled_from(ACTS), nw=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 31 - 1))
def test_kernel_matches_pytorch_on_gpu(m, k, n, dtype, bias, act, nw, seed):
    torch.manual_seed(seed)  # the values are part of the example: a failure replays
    rows = row_capacity(m)
    nw = nw if rows * nw <= 32 else 1
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
    b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
    ks = generate_linear(k, n, rows, dtype, template_epilogue(bias, False, act), nw)
    out = launch_linear(ks, x, w, torch.full((m, n), float("nan"), device="cuda", dtype=dtype), b)
    # fp32: a 2100-term dot product summed in another order than PyTorch's differs by ~1e-6 of the
    # largest output, rarely more (one unseeded failure at 1e-5 on the GPU)
    assert relative_error(out.double(), _reference(x, w, b, act)) <= (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@needs_gpu
def test_empty_batch_launches_nothing_on_gpu():
    ks = generate_linear(32, 8, 1, torch.float32)
    out = torch.empty(0, 8, device="cuda")
    assert launch_linear(ks, torch.empty(0, 32, device="cuda"), torch.randn(8, 32, device="cuda"), out) is out


# ---------------------------------------------------------------------------- 1x1 convs on one pixel
class SE(torch.nn.Module):
    """conv -> ReLU, a squeeze-excite gate (mean, 1x1 conv + SiLU, 1x1 conv + sigmoid, multiply), a 1x1 conv
    with a residual: only the gate's two convs are linear layers on one pixel."""

    def __init__(self):
        super().__init__()
        from torchvision.ops import SqueezeExcitation

        self.c = torch.nn.Conv2d(16, 64, 3, padding=1)
        self.se = SqueezeExcitation(64, 16, activation=torch.nn.SiLU)
        self.o = torch.nn.Conv2d(64, 64, 1)

    def forward(self, x):
        y = self.se(torch.relu(self.c(x)))
        return self.o(y) + y


def conv_nodes(gm):
    from fxopt.ops import fused_conv_ref

    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fused_conv_ref]


@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_plans_the_gate_convs_of_one_pixel_as_linear_layers(layout):
    from fxopt.backends.cuda.kernels.linear import ConvAsLinear, plan_conv_as_linear

    gm = lowered(SE().eval().half(), torch.randn(2, 16, 8, 8).half(), {"layout": layout})
    plans = [plan_conv_as_linear(n) for n in conv_nodes(gm)]
    assert [p is not None for p in plans] == [False, True, True, False]  # 3x3; the gate's two; 1x1 on 8x8
    fc1, fc2 = plans[1], plans[2]
    assert isinstance(fc1, ConvAsLinear) and fc1.label == "linear"
    assert (fc1.spec["k"], fc1.spec["n"], fc1.spec["rows"]) == (64, 16, 2)
    assert fc1.spec["epilogue"] == template_epilogue(True, False, ("silu", ()))
    assert fc2.spec["epilogue"] == template_epilogue(True, False, ("sigmoid", ()))
    gm = lowered(SE().eval().half(), torch.randn(MAX_ROWS + 1, 16, 8, 8).half(), {"layout": layout})
    assert all(plan_conv_as_linear(n) is None for n in conv_nodes(gm))  # a batch that is a real GEMM


def test_the_conv_candidate_declines_what_its_views_cannot_take():
    from fxopt.backends.cuda.kernels.linear import _dense, plan_conv_as_linear

    gm = lowered(SE().eval().half(), torch.randn(2, 16, 8, 8).half(), {"layout": "channels_last"})
    cand = plan_conv_as_linear(conv_nodes(gm)[1])
    x, w, b = torch.randn(2, 64, 1, 1).half(), torch.randn(16, 64, 1, 1).half(), torch.randn(16).half()
    args = ([1, 1], [0, 0], [1, 1], 1, "silu", [])
    assert _dense(x) and _dense(x.contiguous(memory_format=torch.channels_last)) and _dense(w)
    assert not _dense(torch.randn(64, 2, 1, 1).half().transpose(0, 1))
    assert cand(x, w, b, None, *args) is None  # nothing compiled here (and a CPU tensor)
    cand.kernels[0] = object()  # compiled, but the tensors do not fit: declined before any launch
    assert cand(x, w, b, torch.randn(2, 16, 1, 1).half(), *args) is None  # a residual
    assert cand(torch.randn(2, 64, 2, 2).half(), w, b, None, *args) is None  # more than one pixel
    assert cand(torch.randn(3, 64, 1, 1).half(), w, b, None, *args) is None  # more rows than generated for
    assert cand(x, w, b, None, *args) is None  # a CPU tensor


@needs_nvrtc
def test_the_cuda_executor_compiles_the_gate_convs_as_linear_kernels_on_cpu():
    r = fxopt.explain(SE().eval().half(), torch.randn(1, 16, 8, 8).half(),
                      options={"executor": "cuda", "layout": "channels_last"})
    names = sorted(k.name for k in r.kernels if k.name.startswith("fx_linear"))
    assert [n.split("_f16")[0] for n in names] == ["fx_linear_k16_n64_r1", "fx_linear_k64_n16_r1"], names
    assert all(k.compiled for k in r.kernels if k.name.startswith("fx_linear"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch", [1, 5])
def test_compiled_gate_matches_eager_and_measures_the_linear_kernels(dtype, batch, tmp_path):
    import copy

    import fxopt.testing

    m = SE().eval().cuda().to(dtype)
    graphs = []
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json")}, graphs)
    x = torch.randn(batch, 16, 12, 12, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double())
        assert relative_error(c(x).double(), want) <= (2e-3 if dtype == torch.float32 else 1e-2)
    measured = [v for v in graphs[0].executor_details["node_choices"].values() if "generated_linear" in v.get("ms", {})]
    assert len(measured) == 2, graphs[0].executor_details["node_choices"]
