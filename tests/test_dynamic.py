"""Dynamic shapes (fxopt.dynamic): one Dynamo compile and one pipeline run for every size, the graph
lowered per size lazily (here without padded runs: tests/test_dynamic_serving.py has those), never eagerly; an LRU bound on the sizes kept; training's smaller last batch."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fxopt.pipeline
import fxopt.report
from fxopt.backend import fxopt_backend
from fxopt.testing.models import BasicBlock, SeedCNN2, SmallResNet


class Counting:
    """fxopt as a backend that keeps its reports; ``compiles``: the graphs Dynamo compiled (Dynamo may
    call a backend twice for one graph: AOTAutograd restarts its analysis to make a scalar a tensor)."""

    def __init__(self, **options):
        self.options, self.reports = options, []
        counters.clear()

    @property
    def compiles(self) -> int:
        return counters["stats"]["unique_graphs"]

    def __call__(self, gm, inputs):
        return fxopt_backend(gm, inputs, options=self.options, _sink=self.reports)

    def dynamic(self) -> dict:
        infos = [r.executor_details.get("dynamic") for r in self.reports]
        infos = [i for i in infos if i and "fallback" not in i]
        assert len(infos) == 1, infos
        return infos[0]


@pytest.fixture
def pipeline_runs(monkeypatch):
    runs = []
    real = fxopt.pipeline.run_pipeline

    def counting(gm, ctx, dump_prefix=""):
        runs.append(ctx.mode)
        return real(gm, ctx, dump_prefix=dump_prefix)

    monkeypatch.setattr(fxopt.pipeline, "run_pipeline", counting)
    return runs


def _check(compiled, model, shapes, channels=3):
    with torch.no_grad():
        for b, side in shapes:
            x = torch.randn(b, channels, side, side)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


def test_dynamic_true_compiles_once(pipeline_runs):
    torch.manual_seed(0)
    model, backend = SeedCNN2().eval(), Counting(dynamic_padding=False)  # the default (cpu) executor
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 32), (3, 32), (2, 32)])
    assert backend.compiles == 1
    assert len(pipeline_runs) == 1
    # every pass ran on the symbolic graph (a convolution at a symbolic height and width has no
    # algorithm whose legality is decided: it keeps the library's, rather than failing the pass)
    assert [r.fallback for r in backend.reports] == [None]
    info = backend.dynamic()
    assert info["pipeline_runs"] == 1 and len(info["symbolic"]) == 2  # the batch and the image side
    assert sorted(int(k.split(",")[0].split("=")[1]) for k in info["specializations"]) == [2, 3]
    assert all(rec["lowered"] == 1 and rec["seconds"][0] > 0 for rec in info["specializations"].values())


def test_automatic_dynamic_takes_the_symbolic_graph(pipeline_runs):
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(executor="torch", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend)
    _check(compiled, model, [(1, 32), (2, 32), (3, 32), (5, 32), (7, 32), (3, 32)])
    # the first size static, every later one through Dynamo's second, symbolic graph
    assert backend.compiles == 2
    assert len(pipeline_runs) == 2
    assert len(backend.dynamic()["specializations"]) == 4
    assert "dynamic shapes: symbolic" in str(fxopt.report.Report(backend.reports))


def test_without_dynamic_shapes_option_the_passes_specialize(pipeline_runs):
    torch.manual_seed(0)
    model, backend = BasicBlock(8, 8).eval(), Counting(executor="torch", dynamic_shapes=False)
    compiled = torch.compile(model, backend=backend)
    _check(compiled, model, [(1, 16), (2, 16), (3, 16)], channels=8)
    assert len(pipeline_runs) == backend.compiles >= 2  # the passes run once per Dynamo graph, as before
    assert all(not r.executor_details.get("dynamic") for r in backend.reports)
    assert all(r.executor == "torch" for r in backend.reports)


def test_lru_bound_evicts_and_lowers_again():
    torch.manual_seed(0)
    model, backend = BasicBlock(8, 8).eval(), Counting(executor="torch", max_specializations=2, dynamic_padding=False)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    _check(compiled, model, [(2, 16), (3, 16), (4, 16), (2, 16), (4, 16), (3, 16)], channels=8)
    assert backend.compiles == 1
    info = backend.dynamic()
    assert info["live"] == 2 and info["max_specializations"] == 2
    assert info["evictions"] == 3  # 4 evicts 2, 2 evicts 3, 3 evicts 4
    lowered = {k.split(",")[0].split("=")[1]: v["lowered"] for k, v in info["specializations"].items()}
    assert lowered == {"2": 2, "3": 2, "4": 1}
    assert [v["live"] for v in info["specializations"].values()].count(True) == 2


def test_image_sizes_and_mark_dynamic(pipeline_runs):
    torch.manual_seed(0)
    model, backend = SmallResNet().eval(), Counting(executor="torch", dynamic_padding=False)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 32, 32)
    for d in (0, 2, 3):
        torch._dynamo.mark_dynamic(x, d)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    _check(compiled, model, [(3, 40), (2, 24), (4, 48)])
    assert backend.compiles == 1 and len(pipeline_runs) == 1
    info = backend.dynamic()
    assert len(info["symbolic"]) >= 2 and len(info["specializations"]) == 4


def _train(model, compiled, batches, lr=0.05):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        x, y = torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)
        loss = F.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("dynamic,compiles", [(None, 2), (True, 1)])
def test_training_smaller_last_batch(dynamic, compiles):
    """Two epochs of 8, 5 (drop_last=False), then a third size: automatic dynamic compiles the
    joint graph twice (the static first size, then the symbolic one, which serves every later size);
    dynamic=True once."""
    torch.manual_seed(0)
    model = SmallResNet()
    reference = copy.deepcopy(model)
    backend = Counting()
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    batches = [8, 5, 8, 5, 3]
    losses = _train(model, compiled, batches)
    want = _train(reference, reference, batches)
    assert backend.compiles == compiles
    assert sum(r.kind == "forward" for r in backend.reports) == compiles
    torch.testing.assert_close(losses, want, rtol=1e-3, atol=1e-3)


def test_symbolic_height_and_width_keep_every_pass_for_the_cuda_target():
    """``dynamic=True`` makes the height and width symbolic too: no convolution algorithm's legality
    is decided there, and the convolutions keep the library's (the pass failed before: every pass
    fell back, the unoptimized graph lowered per size). The graph is traced on a fake CUDA input."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    reports = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = SeedCNN2().eval()
        x = torch.empty(4, 3, 32, 32, device="cuda")
        torch.compiler.reset()
        options = {"executor": "cuda", "strict": True, "autotune_cache": False}
        with torch.no_grad():
            torch.compile(model, dynamic=True, backend=lambda gm, ex: fxopt_backend(
                gm, ex, options=options, _sink=reports) and gm.forward)(x)
    torch.compiler.reset()
    (report,) = reports
    assert report.fallback is None
    assert len(report.executor_details["dynamic"]["symbolic"]) == 2  # the batch; height and width (equal: one)
    assert report.conv_algorithms and {c.how for c in report.conv_algorithms.values()} == {"symbolic sizes"}
    assert all(c.algorithm == "direct" for c in report.conv_algorithms.values())
