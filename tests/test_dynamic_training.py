"""Training graphs with symbolic sizes (the smaller last batch of an epoch, then every later batch:
Dynamo serves them all with its newest, symbolic graph): the cuda executor's forward and backward
are lowered per size with their kernels, never padded, the backward's CUDA-graph runner linked to
the forward's runner of its size, every step equal to eager's."""
import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given

from fxopt.dynamic import SizeRunners
from fxopt.testing.strategies import _check_training_step, cnn_cases, compile_with_fxopt, tolerance
from test_cudagraphs_training_cpu import _sim_training, step_alike
from test_properties import _examples

BATCHES = (4, 4, 3, 4, 3, 2)


def _model():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _train_like_eager(options: dict, device: str = "cpu", dtype=torch.float32, tol: float = 1e-5,
                      dynamic=None) -> list:
    """Steps over ``BATCHES`` through fxopt and eager alike, outputs and parameters compared after
    each; returns the reports."""
    from fxopt.backend import fxopt_backend

    torch.manual_seed(0)
    model = _model().to(device, dtype)
    ref = copy.deepcopy(model)
    reports: list = []
    compiled = torch.compile(model, backend=lambda gm, ex: fxopt_backend(gm, ex, options, _sink=reports),
                             dynamic=dynamic)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for b in BATCHES:
        x = torch.randn(b, 3, 8, 8, device=device, dtype=dtype)
        outs = step_alike(((compiled, opt), (ref, ref_opt)), x)
        torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)
        for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    return reports


def _symbolic(reports: list) -> dict:
    """kind -> the report of the symbolic graph of that kind."""
    out = {r.kind: r for r in reports if r.executor.endswith("(per size)")}
    assert set(out) == {"forward", "backward"}, [(r.kind, r.executor) for r in reports]
    return out


def test_symbolic_training_graphs_lower_every_size_with_the_kernels_of_the_static_ones():
    """The cuda executor's kernels, emulated on the CPU: the static graphs of the first size and the
    symbolic ones each size lowers have the same fused regions; nothing padded."""
    reports = _train_like_eager({"executor": "cuda", "emulate_kernels": True, "autotune_cache": False})
    static = {r.kind: r for r in reports if r.kind in ("forward", "backward") and r not in _symbolic(reports).values()}
    for kind, rep in _symbolic(reports).items():
        dispatcher = rep.lowered.fn
        assert sorted(k[0] for k in dispatcher.cache) == [2, 3, 4]  # sizes after the symbolic graph came
        for low in dispatcher.cache.values():
            assert low.executor == "cuda" and len(low.regions) == len(static[kind].lowered.regions) > 0
        info = rep.lowered.details["dynamic"]
        assert info["padding_declined"].startswith("a training graph") and not info["padded_calls"]
        assert rep.training is not None


def test_a_symbolic_backward_reads_the_saved_values_its_sizes_forward_lent(monkeypatch):
    """CUDA-graph runners simulated (captures recompute): at every size the backward's capture reads
    the saved values in place and allocates from the pool of that size's forward capture."""
    _sim_training(monkeypatch)
    reports = _train_like_eager({"executor": "cuda", "autotune_cache": False})
    sym = _symbolic(reports)
    forwards, backwards = sym["forward"].lowered.fn.cache, sym["backward"].lowered.fn.cache
    assert set(forwards) == set(backwards) and len(forwards) == 3
    for key, low in backwards.items():
        decision, = low.cudagraph_runner.decisions()
        assert decision["runs"] != "baseline" and "read in place" in decision["inputs"], (key, decision)
        fw_inst, = (i for e in forwards[key].cudagraph_runner.graphs.values() for i in e.instances)
        bw_inst, = (i for e in low.cudagraph_runner.graphs.values() for i in e.instances)
        assert bw_inst.pool is fw_inst.pool
    runners = SizeRunners(sym["forward"].lowered.fn)
    assert len(runners.graphs) == 3 and runners.handed_storages() >= runners.lent_storages()


def test_inference_graphs_stay_padded_and_cpu_training_stays_on_the_torch_executor():
    """Padding stays an inference graph's; training graphs on the CPU (the torch executor, which
    runs symbolic sizes as they are) take the symbolic path of before."""
    reports = _train_like_eager({"autotune_cache": False})
    assert not [r for r in reports if r.executor.endswith("(per size)")]


@_examples(8)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), training=True, min_batch=2))
def test_random_cnns_train_like_eager_at_a_second_batch_and_back(case):
    """Random training CNNs, kernels emulated: a step at the drawn batch, one at a batch one larger
    (Dynamo's symbolic graph), one at the first again (served by that graph), each against eager."""
    eager, model = case.model, copy.deepcopy(case.model)
    graphs: list = []
    compiled = compile_with_fxopt(model, {"executor": "cuda", "emulate_kernels": True, "autotune_cache": False},
                                  graphs)
    x = case.inputs[0]
    rtol, atol = tolerance(case.dtype)
    for b in (x.shape[0], x.shape[0] + 1, x.shape[0]):
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        _check_training_step(eager, model, compiled, [torch.randn(b, *x.shape[1:], dtype=x.dtype)], rtol, atol, None)
    assert all(g.fallback is None for g in graphs)
    assert {g.kind for g in graphs if g.executor.endswith("(per size)")} == {"forward", "backward"}, \
        [(g.kind, g.executor, g.executor_details.get("dynamic")) for g in graphs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_symbolic_training_on_the_gpu_matches_eager_at_every_size():
    """``dynamic=True``: every step as eager's; one forward and one backward graph for every batch
    (BatchNorm in training runs cuDNN's kernels, whose reserve-space query in propagation does not
    specializes the batch), the forward lowered per size with CUDA graphs, its backward linked to them."""
    reports = _train_like_eager({"autotune_cache": False}, device="cuda", tol=2e-4, dynamic=True)
    per_size = [r for r in reports if r.executor.endswith("(per size)")]
    assert sorted(r.kind for r in reports) == ["backward", "forward"], [(r.kind, r.executor) for r in reports]
    assert {r.kind for r in per_size} == {"forward", "backward"}, \
        [(r.kind, r.executor, r.executor_details.get("dynamic")) for r in reports]
    for rep in per_size:
        for low in rep.lowered.fn.cache.values():
            assert low.executor == "cuda" and low.cudagraphs.startswith("on"), (rep.kind, low.cudagraphs)
