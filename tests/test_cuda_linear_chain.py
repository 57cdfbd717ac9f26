"""Linear chains in one block (backends/cuda/schedule/linear.py, codegen/linear.py): which chains of fused_linear nodes
are planned and which are declined, that generated chains compile with NVRTC (CPU, hypothesis),
the executor's chain rewrite with the measurement stubbed (CPU: structure, lint, values), and that
the kernel computes what the layers compute (GPU, hypothesis over sizes, rows, dtypes, epilogues)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fxopt
import fxopt.testing
from fxopt.backends import torch_ref
from fxopt.backends.cuda.runtime import executor as X, measure
from fxopt.backends.cuda.runtime import groups
from fxopt.backends.cuda.codegen.epilogue import template_epilogue
from fxopt.backends.cuda.kernels.linear import MAX_ROWS, generate_linear_chain, row_capacity
from fxopt.backends.cuda.compiler import compile_many, nvrtc_available
from fxopt.backends.cuda.kernels.linear import LinearChain, LinearChainGroup, linear_chain_of, plan_linear_chains
from fxopt.ops import fused_linear_ref
from fxopt.testing.models import SeedCNN
from fxopt.tolerances import relative_error

needs_nvrtc = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ACTS = [None, "relu", ("hardtanh", (0.0, 6.0)), "gelu", "silu", "sigmoid"]
RELU = template_epilogue(True, False, ("relu", ()))


def lowered(model, x):
    r = fxopt.explain(model, x, options={"executor": "torch"})
    return torch_ref.lower(r.graphs[0].after)


def linears(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fused_linear_ref]


class Head(nn.Module):
    def __init__(self, sizes, reuse=False, dtype=torch.float32):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, dtype=dtype) for a, b in zip(sizes, sizes[1:]))
        self.reuse = reuse

    def forward(self, x):
        h = torch.relu(self.layers[0](x))
        for layer in self.layers[1:]:
            y = torch.relu(layer(h))
            h = y + h[:, :1].sum() if self.reuse else y  # reuse: h read twice
        return h


# ---------------------------------------------------------------------------- planning (CPU)
SMALL = [128, 64, 32, 10]  # 41 KiB of fp32 weights: a head the chain is planned for


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_plans_a_small_head_as_one_chain(batch):
    gm = lowered(Head(SMALL).eval(), torch.randn(batch, 128))
    (chain, cand), = plan_linear_chains(gm.graph)
    assert chain == linears(gm)
    assert isinstance(cand, LinearChain) and cand.label == "linear_chain"
    assert cand.spec["layers"] == [(128, 64, RELU), (64, 32, RELU), (32, 10, RELU)]
    assert cand.spec["rows"] == row_capacity(batch) and cand.spec["dtype"] == torch.float32
    ks = cand.sources[0]
    assert ks.param_names == ("x", "w0", "b0", "w1", "b1", "w2", "b2", "y", "M") and ks.block == (1024, 1, 1)
    assert len(plan_linear_chains(gm.graph)) == 1  # planning changes nothing


def test_declines_big_batches_big_heads_and_shared_outputs():
    assert plan_linear_chains(lowered(Head(SMALL).eval(), torch.randn(MAX_ROWS + 1, 128)).graph) == []
    # the seed CNN's head: 192 KiB of weights, slower in one block than as three kernels
    assert plan_linear_chains(lowered(SeedCNN().eval(), torch.randn(1, 3, 32, 32)).graph) == []
    # every intermediate read twice: no two layers chain
    assert plan_linear_chains(lowered(Head([16, 32, 32, 8], reuse=True).eval(), torch.randn(2, 16)).graph) == []
    gm = lowered(Head([16, 32, 32, 8]).eval(), torch.randn(2, 16))
    (chain, cand), = plan_linear_chains(gm.graph)
    assert len(chain) == 3 and [k for k, _, _ in cand.spec["layers"]] == [16, 32, 32]


def test_generator_rejects_what_the_template_cannot_run():
    with pytest.raises(ValueError, match="layers"):
        generate_linear_chain([(8, 8, template_epilogue())], 1)
    with pytest.raises(ValueError, match="takes K"):
        generate_linear_chain([(8, 8, template_epilogue()), (4, 2, template_epilogue())], 1)
    with pytest.raises(ValueError, match="residual"):
        generate_linear_chain([(8, 8, template_epilogue(residual=True)), (8, 2, template_epilogue())], 1)
    with pytest.raises(ValueError, match="shared-memory"):
        generate_linear_chain([(8, 4096, template_epilogue()), (4096, 2, template_epilogue())], 16)


def test_candidate_declines_cpu_tensors_and_other_shapes():
    cand = LinearChain("t", {"layers": [(8, 4, template_epilogue(True)), (4, 2, template_epilogue())], "rows": 2,
                             "dtype": torch.float32})
    cand.kernels[0] = object()  # never launched: every call below declines first
    w0, b0, w1 = torch.randn(4, 8), torch.randn(4), torch.randn(2, 4)
    assert cand(torch.randn(2, 8), w0, b0, "none", [], w1, None, "none", []) is None  # CPU tensors
    assert linear_chain_of([fused_linear_ref] * 2).weight_arg_indices == (1, 5)


@needs_nvrtc
@settings(max_examples=10, deadline=None)  # each example: 1 NVRTC compilation
@given(sizes=st.lists(st.integers(1, 300), min_size=3, max_size=5), rows=st.sampled_from([1, 2, 4, 8, 16]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       epis=st.lists(st.tuples(st.booleans(), st.sampled_from(ACTS)), min_size=4, max_size=4))
def test_every_chain_compiles_with_nvrtc(sizes, rows, dtype, epis):
    if 2 * rows * max(sizes[1:-1]) > 6144:
        return
    layers = [(k, n, template_epilogue(b, False, a)) for (k, n), (b, a) in zip(zip(sizes, sizes[1:]), epis)]
    ks = generate_linear_chain(layers, rows, dtype)
    assert ks.source.count("__syncthreads();") == len(layers)  # one barrier after each layer
    (compiled,) = compile_many([ks])
    assert compiled.compiled and compiled.pdl_safe


# ---------------------------------------------------------------------------- executor rewrite (CPU)
def _inputs(gm, model, x):
    """The lowered graph's inputs in its order: x, and the parameters (each of its own shape)."""
    by_shape = {tuple(p.shape): p for p in model.parameters()}
    by_shape[tuple(x.shape)] = x
    return [by_shape[tuple(n.meta["val"].shape)] for n in gm.graph.nodes if n.op == "placeholder"]


@needs_nvrtc
@pytest.mark.parametrize("wins", [True, False])
def test_chain_rewrite_replaces_the_layers_only_where_measured_faster(monkeypatch, wins):
    model, x = Head(SMALL).eval(), torch.randn(1, 128)
    gm = lowered(model, x)
    with torch.no_grad():
        want = model(x)
    (chain, cand), = plan_linear_chains(gm.graph)
    info = {"kernels": []}
    X._compile([cand], info)
    assert [k.compiled for k in info["kernels"]] == [True]
    seen = {}

    def fake_measure(node, candidates, graphed):
        seen["args"] = measure.real_args(node)
        pick = "generated_linear_chain" if wins else "reference"
        return {"ms": {n: (1.0 if n == pick else 2.0) for n in candidates}, "errors": {}, "choice": pick}

    monkeypatch.setattr(measure, "measure", fake_measure)
    from fxopt.autotune import AutotuneCache

    class Ctx:
        measurements = 0

    decisions = {}
    tuning = measure.Tuning(AutotuneCache(None), "dev", True, Ctx)
    assert groups.fuse_group(gm, LinearChainGroup(chain, [cand]), tuning, decisions) is wins
    gm.graph.lint()
    gm.recompile()
    names = [getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"]
    assert (fused_linear_ref in [n.target for n in gm.graph.nodes]) is not wins
    assert names.count("fx_linear_chain_" + chain[0].name) == int(wins)
    assert list(decisions) == ["+".join(n.name for n in chain)]
    # measured on random inputs whose weights are scaled by 1/sqrt(K)
    w0 = seen["args"][1]
    assert tuple(w0.shape) == (64, 128) and w0.std() < 0.2
    with torch.no_grad():  # on the CPU the candidate declines and the chained reference runs
        torch.testing.assert_close(gm(*_inputs(gm, model, x))[0], want)


# ---------------------------------------------------------------------------- GPU
def _reference(x, layers, dtype):
    h = x
    for i, (w, b, act) in enumerate(layers):
        y = F.linear(h.double(), w.double(), None if b is None else b.double())
        if isinstance(act, tuple):
            y = y.clamp(*act[1])
        elif act is not None:
            y = {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid}[act](y)
        h = y if i == len(layers) - 1 else y.to(dtype)  # each layer stores its output in dtype
    return h


@pytest.mark.gpu
@needs_gpu
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, MAX_ROWS), sizes=st.lists(st.integers(1, 700), min_size=3, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       epis=st.lists(st.tuples(st.booleans(), st.sampled_from(ACTS)), min_size=3, max_size=3),
       seed=st.integers(0, 2 ** 31 - 1))
def test_chain_matches_the_layers_on_gpu(m, sizes, dtype, epis, seed):
    rows = row_capacity(m)
    if 2 * rows * max(sizes[1:-1]) > 6144:
        return
    torch.manual_seed(seed)
    layers, flat, spec = [], [], []
    for (k, n), (bias, act) in zip(zip(sizes, sizes[1:]), epis):
        w = torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5
        b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
        layers.append((w, b, act))
        a = "none" if act is None else (act if isinstance(act, str) else act[0])
        flat += [w, b, a, [] if not isinstance(act, tuple) else list(act[1])]
        spec.append((k, n, template_epilogue(bias, False, act)))
    cand = LinearChain("t", {"layers": spec, "rows": rows, "dtype": dtype})
    (cand.kernels[0],) = compile_many([cand.sources[0]])
    x = torch.randn(m, sizes[0], device="cuda", dtype=dtype)
    out = cand(x, *flat)
    assert out is not None and out.shape == (m, sizes[-1])
    ref = linear_chain_of([fused_linear_ref] * len(spec))(x, *flat)  # the layers as PyTorch runs them
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert relative_error(out.double(), _reference(x, layers, dtype)) <= tol
    assert relative_error(out.double(), ref.double()) <= tol


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_small_head_measures_the_chain(dtype, tmp_path):
    import copy
    m = Head(SMALL).eval().cuda().to(dtype)
    graphs = []
    c = fxopt.testing.compile_with_fxopt(m, {"autotune_cache": str(tmp_path / "c.json")}, graphs)
    x = torch.randn(1, 128, device="cuda", dtype=dtype)
    with torch.no_grad():
        want = copy.deepcopy(m).double()(x.double())
        for _ in range(3):
            assert relative_error(c(x), want) <= (2e-3 if dtype == torch.float32 else 1e-2)
    choices = graphs[0].executor_details["node_choices"]
    (entry,) = [v for k, v in choices.items() if k.count("+") == 2 and "linear" in k]
    assert set(entry["ms"]) | set(entry.get("pruned", {})) == {"reference", "generated_linear_chain"}, entry
