"""Moving a linear layer's epilogue into its readers' kernels (``split_linear_epilogues``), on the CPU:
which nodes it splits and which it leaves, the regions that then compute the bias and activation,
the kernels' IR against eager, and a hypothesis property over random MLP blocks. On a GPU the
executor splits a node only where the bare product plus its epilogue measured faster than the fused
call (``linear_then_epilogue`` against ``fused_linear_ref``, in the autotuning cache)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fxopt.backends import torch_ref
from fxopt.backends.cuda import ir
from fxopt.backends.cuda.runtime.executor import fuse_regions
from fxopt.backends.cuda.schedule.fusion import schedule
from fxopt.backends.cuda.schedule.generated import EmulatedRegion
from fxopt.backends.cuda.schedule.rewrite import linear_then_epilogue, split_linear_epilogues
from fxopt.fuzz.graphs import programs
from fxopt.ops import conv_epilogue_ref, fused_linear_ref
from fxopt.testing.fusion import capture

SPLIT = {"choice": "split", "ms": {}}


class Mlp(nn.Module):
    """A ConvNeXt block's channel MLP on channels-last rows: fc1, activation, fc2, scale, residual."""

    def __init__(self, c=16, hidden=64, act=F.gelu):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(c, hidden), nn.Linear(hidden, c), act
        self.gamma = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        return x + self.gamma * self.fc2(self.act(self.fc1(x)))


def lowered(model, x):
    """The optimized graph as the cuda executor receives it, and its real inputs."""
    (report, example), = capture(model.eval(), (x,), {"executor": "torch"})
    gm = torch_ref.lower(report.after)
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == len(example)
    return gm, example


def linears(gm):
    return [n for n in gm.graph.nodes if n.target is fused_linear_ref]


def test_a_linear_over_many_rows_read_by_generated_kernels_leaves_its_bias_to_them():
    torch.manual_seed(0)
    model, x = Mlp(), torch.randn(2, 5, 5, 16)  # 50 rows
    gm, example = lowered(model, x)
    before = linears(gm)
    assert len(before) == 2 and all(n.args[2] is not None for n in before)
    asked = split_linear_epilogues(gm, choose=lambda n: SPLIT)
    gm.graph.lint()
    # fc1 (read by the GELU) and fc2 (read by the scale and the residual add) both split
    assert set(asked) == {n.name for n in before}
    bare = linears(gm)
    assert len(bare) == 2 and all(n.args[2] is None and n.args[3] == "none" for n in bare)
    epis = [n for n in gm.graph.nodes if n.target is conv_epilogue_ref]
    assert [e.args[0] for e in epis] == bare and all(e.meta.get("fxopt_split_from") for e in epis)
    sched = schedule(gm, strict=True)
    inside = [r for r in sched.regions if "conv_epilogue_ref" in r.ops]
    assert len(inside) == 2
    outputs = {o for r in sched.regions for o in r.outputs}
    assert not outputs & set(epis)  # the biased product is computed where read, never stored
    torch.testing.assert_close(_run(gm, example), model(x))


def _run(gm, example):
    with torch.no_grad():
        out = gm(*example)
    return out[0] if isinstance(out, (tuple, list)) else out


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x) * 0.5)  # fc1 read by a multiply, fc2 by nothing but the output


@pytest.mark.parametrize("case", ["declined", "few rows", "graph output", "no epilogue"])
def test_what_keeps_its_fused_epilogue(case):
    torch.manual_seed(0)
    if case == "few rows":  # 8 rows: the linear family's kernel fuses the epilogue itself
        model, x = Mlp(), torch.randn(2, 2, 2, 16)
    elif case == "graph output":  # fc2 is read by nothing generated: the output
        model, x = _TwoLayers(), torch.randn(40, 16)
    elif case == "no epilogue":
        model, x = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Tanh()), torch.randn(40, 16)
    else:
        model, x = Mlp(), torch.randn(2, 5, 5, 16)
    gm, example = lowered(model, x)
    code = gm.code
    asked = split_linear_epilogues(gm, choose=lambda n: {"choice": "reference"} if case == "declined" else SPLIT)
    if case == "declined":
        assert len(asked) == 2 and gm.code == code
    elif case == "graph output":  # fc1 (read by the ReLU) is asked, fc2 is not
        fc2 = [n for n in linears(gm) if n.args[2] is not None]
        assert len(asked) == 1 and len(fc2) == 1 and fc2[0].name not in asked
    else:
        assert asked == {} and gm.code == code
    assert split_linear_epilogues(gm, choose=None) == {}  # without a measurement: nothing splits


class _Tuning:
    """The executor's measurement, answered: split every node asked."""
    graphed = False

    def __init__(self):
        self.asked = []

    def entry(self, node, candidates, key):
        assert set(candidates) == {"reference", "split"} and "fused_linear_ref" in key
        self.asked.append(node.name)
        return SPLIT


def _emulated(gm, tuning):
    info: dict = {}
    planned = fuse_regions(gm, info, set(), tuning=tuning)
    for p in planned:
        p.node.target = EmulatedRegion(p.generated.region, p.reference)
    gm.recompile()
    gm.graph.lint()
    return info, planned


def test_the_split_regions_kernel_ir_matches_eager(monkeypatch):
    torch.manual_seed(1)
    model, x = Mlp(24, 40, act=F.silu), torch.randn(3, 4, 6, 24)
    gm, example = lowered(model, x)
    tuning = _Tuning()
    info, planned = _emulated(gm, tuning)
    assert len(tuning.asked) == 2 and set(info["linear_epilogues"]) == set(tuning.asked)
    assert sum("conv_epilogue_ref" in p.generated.ops for p in planned) == 2
    evaluated = []
    real = ir.evaluate
    monkeypatch.setattr(ir, "evaluate", lambda *a, **k: (evaluated.append(1), real(*a, **k))[1])
    torch.testing.assert_close(_run(gm, example), model(x), rtol=1e-5, atol=1e-5)
    assert len(evaluated) == len(planned)  # every region ran its IR, none fell back to its reference


def test_linear_then_epilogue_is_the_fused_call():
    torch.manual_seed(2)
    x, w, b = torch.randn(20, 12), torch.randn(7, 12), torch.randn(7)
    for act, params in (("none", []), ("relu", []), ("silu", []), ("hardtanh", [0.0, 6.0])):
        torch.testing.assert_close(linear_then_epilogue(x, w, b, act, params), fused_linear_ref(x, w, b, act, params))


_ACTS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "hardswish": F.hardswish, "sigmoid": torch.sigmoid}


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(3, 9), c=st.integers(1, 12), hidden=st.integers(1, 24), act=st.sampled_from(sorted(_ACTS)),
       seed=st.integers(0, 2**16))
def test_property_split_mlp_blocks_match_eager(rows, c, hidden, act, seed):
    torch.manual_seed(seed)
    model, x = Mlp(c, hidden, act=_ACTS[act]), torch.randn(1, rows, 3, c)  # 9..27 rows
    gm, example = lowered(model, x)
    tuning = _Tuning()
    _emulated(gm, tuning)
    if 3 * rows > 16:
        assert tuning.asked, "a linear over more than 16 rows read by generated kernels is asked"
    torch.testing.assert_close(_run(gm, example), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_each_linear_is_measured_and_the_compiled_block_matches_eager(dtype):
    from fxopt.testing import compile_with_fxopt

    torch.manual_seed(0)
    model = Mlp(96, 384).cuda().to(dtype).eval()
    x = torch.randn(4, 28, 28, 96, device="cuda", dtype=dtype)
    graphs: list = []
    fast = compile_with_fxopt(model, {"executor": "cuda", "autotune_cache": False}, graphs)
    with torch.no_grad():
        got, want = fast(x), model(x)
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    choices = graphs[0].executor_details["node_choices"]
    measured = {k: v for k, v in choices.items() if set(v.get("ms", {})) == {"reference", "split"}}
    assert len(measured) == 2, choices  # both layers timed: the fused call against bare product + epilogue


@settings(max_examples=10, deadline=None, database=None)
@given(program=programs(
    kinds=("mlp",), max_layers=2, max_batch=8, max_size=6, modes=("inference", "training"), cudagraphs=(None,)),
    executor=st.sampled_from([None, "torch", "cuda"]))
def test_property_the_fuzzers_channel_mlp_passes_on_the_cpu(program, executor):
    """The fuzzer's ``mlp`` layer (ConvNeXt's channel MLP, inside ``fxopt fuzz``'s kinds) judged as
    the fuzzer judges it: against eager and float64, on every executor's CPU-checkable part."""
    from fxopt.fuzz.check import run_program

    assume("mlp" in program.ops)
    if executor:  # None: the default (the cpu executor for inference)
        program.options["executor"] = executor
    run_program(program, "cpu")
