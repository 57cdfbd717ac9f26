"""Training through fxopt: gradients of generated graphs, the reference loop's loss curve, the
partition of the joint graph, the training benchmark and data parallel (CPU; the GPU part is
marked ``gpu``).

The CI profile runs a bounded, deterministic number of examples; ``--hypothesis-profile=thorough``
searches longer.
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings

import fxopt
from fxopt.testing import SeedCNN2, check_equivalence, cnn_cases, compile_with_fxopt
from fxopt.testing.training import (AMP_DTYPES, LOSS_TOLERANCE, TrainLoop, make_batches, max_rel_diff,
                                    run_steps)


def _examples(n):
    """n examples in the CI profile, the profile's own (larger) number otherwise."""
    current = settings.default.max_examples
    return settings(max_examples=n if current <= 25 else current)


def test_an_ill_conditioned_gradient_is_judged_against_float64_as_the_fuzzer_judges_it():
    """A gradient off eager's by more than the tolerance passes where eager's own error against the
    float64 step is as large (a 16-bit BatchNorm backward over few values), fails where it is not."""
    from fxopt.testing.strategies import _as_close_as_eager, _Float64Step

    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3)), torch.randn(2, 2, 5, 5)
    w = torch.randn(2, 3, 3, 3)
    step = _Float64Step(model, [x])
    exact = step.grads(w)["0.weight"]
    assert exact.dtype == torch.float64 and step.grads(w)[0].shape == x.shape
    assert model[0].weight.dtype == torch.float32  # the model itself untouched
    off = exact.float() + 0.5  # eager 0.5 away from float64 everywhere
    _as_close_as_eager(exact.float() - 0.9, off, lambda: exact, 1e-2, 1e-3, "w")  # 0.9 <= 2 * 0.5
    with pytest.raises(AssertionError, match="error against float64 1.5, eager's 0.5"):
        _as_close_as_eager(exact.float() - 1.5, off, lambda: exact, 1e-2, 1e-3, "w")
    _as_close_as_eager(off + 1e-4, off, lambda: 1 / 0, 1e-2, 1e-3, "w")  # within the tolerance: no reference run


# ---- generated graphs: loss, every parameter's gradient, buffers ----------------------------------
@_examples(20)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(1, 2), training=True, min_batch=2, max_layers=4,
                 kinds=("basic_block", "residual", "conv")))
def test_training_bn_and_residual_blocks(case):
    """BatchNorm in training mode (batch statistics, running statistics updated) in residual and
    ResNet basic blocks: the gradient of every parameter, the input's, and the buffers."""
    graphs = check_equivalence(case)
    assert [g.kind for g in graphs] == ["forward", "backward"]


@_examples(12)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), training=True, min_batch=2, max_layers=4))
def test_training_under_bfloat16_autocast(case):
    check_equivalence(case, autocast=torch.bfloat16)


def test_training_check_catches_a_wrong_gradient(monkeypatch):
    """The training check compares gradients, not only outputs: a backward graph scaled by 2
    fails it."""
    from fxopt import backend

    real = backend.FxoptCompiler.backward

    def doubled(self, gm, args):
        fn = real(self, gm, args)

        def call(*a):
            return [None if g is None else g * 2 for g in fn(*a)]
        call._boxed_call = True
        return call

    monkeypatch.setattr(backend.FxoptCompiler, "backward", doubled)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU()).train()
    from fxopt.testing.strategies import CNNCase

    with pytest.raises(AssertionError, match="grad"):
        check_equivalence(CNNCase(model, (torch.randn(2, 3, 8, 8),), torch.float32, training=True))


# ---- the reference loop -----------------------------------------------------------------------
@pytest.mark.parametrize("amp", ["none", "bfloat16", "float16"])
def test_reference_loop_loss_curve_matches_eager(amp):
    """20 steps of the reference loop (SeedCNN2): fxopt's losses within tolerance of eager's; the
    loop learns; bfloat16 trains without a GradScaler, float16 with one."""
    torch.manual_seed(0)
    base = SeedCNN2().train()
    batches = make_batches(4, 8, (3, 32, 32), 10)
    curves, loops = {}, {}
    for name in ("eager", "fxopt"):
        model = copy.deepcopy(base)
        graphs = []
        run = model if name == "eager" else compile_with_fxopt(model, None, graphs)
        loops[name] = TrainLoop(run, model.parameters(), "cpu", amp=AMP_DTYPES[amp])
        curves[name] = [float(x) for x in run_steps(loops[name], batches, 20)]
        if name == "fxopt":
            assert [g.kind for g in graphs] == ["forward", "backward"] and not any(g.fallback for g in graphs)
    assert max_rel_diff(curves["fxopt"], curves["eager"]) <= LOSS_TOLERANCE[AMP_DTYPES[amp]]
    assert sum(curves["fxopt"][-4:]) < sum(curves["fxopt"][:4])  # it trains
    assert (loops["fxopt"].scaler is not None) == (amp == "float16")


def test_run_steps_seeds_each_step():
    """With ``seed``, step i draws the same dropout masks whatever ran between steps (the harness
    trains its backends in turns); without it, another draw in between changes the losses."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(48, 10)).train()
    batches = make_batches(2, 8, (3, 4, 4), 10)

    def curve(seed, interleave):
        model = copy.deepcopy(base)
        loop = TrainLoop(model, model.parameters(), "cpu", amp=None)
        out = []
        for i in range(4):
            if interleave:
                torch.rand(100)  # another backend's step, between two of this one's
            out += run_steps(loop, batches, 1, start=i, seed=seed)
        return [float(x) for x in out]

    assert curve(5, False) == curve(5, True)
    assert curve(None, False) != curve(None, True)


def test_max_rel_diff():
    assert max_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert max_rel_diff([1.1, 2.0], [1.0, 2.0]) == pytest.approx(0.1)
    assert max_rel_diff([float("nan")], [1.0]) == float("inf")
    with pytest.raises(ValueError):
        max_rel_diff([1.0], [1.0, 2.0])


# ---- the partition of the joint graph -----------------------------------------------------------
def test_min_cut_partition_is_used_and_saves_less():
    """min-cut rematerialization (the default) splits the joint graph: the reports say so, the
    backward reads fewer and smaller saved activations than with AOTAutograd's default partition,
    and the gradients are eager's either way."""
    torch.manual_seed(0)
    base = SeedCNN2().train()
    x = torch.randn(8, 3, 32, 32)
    ref = copy.deepcopy(base)
    ref(x).square().mean().backward()
    saved = {}
    for part in ("min_cut", "default"):
        model = copy.deepcopy(base)
        graphs = []
        compile_with_fxopt(model, {"partitioner": part}, graphs)(x).square().mean().backward()
        assert [g.training["partitioner"] for g in graphs] == [part, part]
        saved[part] = graphs[1].training["saved_for_backward"]
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{part} {name}: {m}")
    assert saved["min_cut"]["activations"] < saved["default"]["activations"]
    assert saved["min_cut"]["activation_bytes"] < saved["default"]["activation_bytes"]
    assert saved["min_cut"]["bytes"] - saved["min_cut"]["activation_bytes"] > 0  # weights are read, not copied


def test_partitioner_option_is_validated():
    with pytest.raises(ValueError, match="partitioner"):
        fxopt.Options.from_any({"partitioner": "greedy"})


# ---- the training benchmark ---------------------------------------------------------------------
def test_bench_train_on_cpu(tmp_path):
    """``fxopt bench --train`` on the CPU (float16 autocast with GradScaler): every backend through the
    same loop, losses compared with eager's, fxopt's graphs and why CUDA graphs are off, reports."""
    from fxopt.bench import main as bench_main

    out = tmp_path / "train"
    rc = bench_main(["--train", "--device", "cpu", "--models", "seedcnn2:4", "--backends", "eager,fxopt",
                     "--amp", "float16", "--warmup", "1", "--iters", "3", "--losses", "6", "--final-steps", "8",
                     "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["config"]["grad_scaler"] is True
    cells = {c["backend"]: c for c in res["cells"]}
    assert set(cells) == {"eager", "fxopt"} and all(c["status"] == "ok" for c in cells.values())
    fx = cells["fxopt"]
    assert fx["n"] == 3 and fx["steps"] == 6 and len(fx["losses"]) == 6
    assert fx["learning_task_steps"] == 8  # the second training, on the learning task
    assert fx["losses_max_rel_diff"] <= LOSS_TOLERANCE[torch.float16]
    assert fx["final_loss_rel_diff"] <= 0.05 and fx["first_step_s"] > 0
    assert fx["fxopt"]["graphs"] == ["forward", "backward"] and fx["fxopt"]["fallbacks"] == []
    assert fx["fxopt"]["partitioner"] == ["min_cut"] and fx["fxopt"]["saved_activations"] > 0
    assert all("inputs are not on CUDA" in s for s in fx["fxopt"]["cudagraphs"])
    assert fx["fxopt"]["cudagraph_decisions"] == []  # no CUDA-graph runner on the CPU
    assert [c["ok"] for c in res["checks"]] == [True]
    refs = cells["eager"]["rounding_references"]  # default 4: eager with gradients perturbed by one rounding
    assert [r["status"] for r in refs] == ["ok"] * 4 and len({r["noise_seed"] for r in refs}) == 4
    assert all(0 < r["losses_max_rel_diff"] <= LOSS_TOLERANCE[torch.float16] for r in refs)
    assert res["checks"][0]["tol"] == max(LOSS_TOLERANCE[torch.float16], *(r["losses_max_rel_diff"] for r in refs))
    md = (out / "results.md").read_text()
    assert "Rounding spread per row" in md and "- seedcnn2 b4, final loss: " in md
    assert "## fxopt's training graphs" in md and "seedcnn2" in (out / "summary.md").read_text()


def test_bench_train_final_loss_over_several_learning_tasks(tmp_path):
    """``--final-tasks K``: K trainings from the initial weights, each on its own learning task; the
    final loss is the mean of theirs, for every backend and every rounding reference alike."""
    from fxopt.bench import main as bench_main
    from fxopt.testing.training import LearningTask

    out = tmp_path / "train"
    rc = bench_main(["--train", "--device", "cpu", "--models", "seedcnn2:4", "--backends", "eager,fxopt",
                     "--amp", "float16", "--warmup", "1", "--iters", "2", "--losses", "3", "--final-steps", "6",
                     "--final-tasks", "2", "--rounding-references", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["config"]["final_tasks"] == 2
    cells = {c["backend"]: c for c in res["cells"]}
    for c in cells.values():
        assert c["learning_task_steps"] == 12 and len(c["final_loss_per_task"]) == 2
        assert c["final_loss"] == pytest.approx(sum(c["final_loss_per_task"]) / 2)
        assert c["final_loss_per_task"][0] != c["final_loss_per_task"][1]  # two tasks, not one twice
    fx = cells["fxopt"]
    assert fx["eager_final_loss"] == pytest.approx(cells["eager"]["final_loss"])
    assert fx["final_loss_rel_diff"] == pytest.approx(abs(fx["final_loss"] - fx["eager_final_loss"])
                                                      / fx["eager_final_loss"])
    ref = cells["eager"]["rounding_references"][0]
    assert ref["final_loss_rel_diff"] == pytest.approx(abs(ref["final_loss"] - cells["eager"]["final_loss"])
                                                       / cells["eager"]["final_loss"])
    mean = (cells["eager"]["final_loss"] + ref["final_loss"]) / 2  # eager's mean over its two trainings
    assert cells["eager"]["eager_final_trainings"] == 2 and fx["eager_mean_final_loss"] == pytest.approx(mean)
    assert fx["final_loss_rel_diff_eager_mean"] == pytest.approx(abs(fx["final_loss"] - mean) / mean)
    assert "final loss against eager's mean over its 2 trainings" in (out / "results.md").read_text()
    x0, y0 = LearningTask(6, 4, (3, 8, 8), 10, seed=0)[0]
    x1, y1 = LearningTask(6, 4, (3, 8, 8), 10, seed=1)[0]
    assert not torch.equal(x0, x1)  # the tasks' seeds differ, so do their batches
    assert "averaged over 2 such trainings" in (out / "results.md").read_text()
    with pytest.raises(SystemExit):
        bench_main(["--train", "--device", "cpu", "--final-tasks", "0", "--out", str(out)])


def test_bench_train_keeps_the_cuda_graph_runners_decisions():
    """The results say, per fxopt graph and signature, which way its CUDA-graph runner runs it and
    the times behind the choice (or why nothing was measured)."""
    from types import SimpleNamespace

    from fxopt.bench.train import _graph_summary

    class Runner:
        def __init__(self, *decisions):
            self._d = list(decisions)

        def decisions(self):
            return self._d

    fwd = {"runs": "optimized graph", "graph_ms": 1.0, "plain_ms": 1.5, "baseline_graph_ms": 1.2, "captures": 1}
    bwd = {"runs": "optimized graph", "not_measured": "out of memory while measuring the plain run and the baseline"}
    reports = [SimpleNamespace(kind=k, fallback=None, cudagraphs="on", executor="cuda", training={},
                               executor_details={"cudagraph_runner": Runner(d)}) for k, d in
               (("forward", fwd), ("backward", bwd))]
    got = _graph_summary(reports)["cudagraph_decisions"]
    assert got == [{"graph": "forward", "runs": "optimized graph", "graph_ms": 1.0, "plain_ms": 1.5,
                    "baseline_graph_ms": 1.2},
                   {"graph": "backward", **bwd}]


def test_bench_train_check_fails_on_a_diverging_backend(tmp_path, monkeypatch):
    """A backend whose losses leave eager's fails the check and the exit status says so."""
    from fxopt.bench import train as T

    def noisy(model, options, sink):
        return lambda x: model(x) * 1.5

    monkeypatch.setitem(T.TRAIN_BACKENDS, "fxopt-noisy", (noisy, False))
    out = tmp_path / "noisy"
    rc = T.main(["--device", "cpu", "--models", "seedcnn2:4", "--backends", "eager,fxopt-noisy", "--amp", "none",
                 "--warmup", "0", "--iters", "2", "--losses", "3", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    assert rc == 1 and not res["checks"][0]["ok"] and "losses differ" in res["checks"][0]["reason"]


def test_bench_train_rounding_references_do_not_hide_a_wrong_backward(tmp_path, monkeypatch):
    """The rounding references widen a bound only as far as rounding moves eager (float32: about
    1e-7 here); a backward whose gradient is up to 10% off (seeded noise on the logits' gradient)
    leaves it within 20 steps."""
    from fxopt.bench import train as T

    def wrong(model, options, sink):
        gen = torch.Generator().manual_seed(0)

        def run(x):
            out = model(x)
            out.register_hook(lambda g: g * (0.9 + 0.2 * torch.rand(g.shape, generator=gen)))
            return out
        return run

    monkeypatch.setitem(T.TRAIN_BACKENDS, "wrong-backward", (wrong, False))
    out = tmp_path / "wrong"
    rc = T.main(["--device", "cpu", "--models", "seedcnn2:8", "--backends", "eager,wrong-backward", "--amp", "none",
                 "--warmup", "0", "--iters", "1", "--losses", "20", "--rounding-references", "2", "--out", str(out)])
    res = json.loads((out / "results.json").read_text())
    eager = next(c for c in res["cells"] if c["backend"] == "eager")
    spread = max(r["losses_max_rel_diff"] for r in eager["rounding_references"])
    assert 0 < spread < 1e-5 and res["checks"][0]["tol"] == LOSS_TOLERANCE[None]
    assert rc == 1 and not res["checks"][0]["ok"] and "losses differ" in res["checks"][0]["reason"]


def test_learning_task_is_seeded_fresh_and_learnable():
    """LearningTask: batch i is the same for the same seed and i, new for every i; SeedCNN2 learns
    the rule (the loss falls far below ln(10)) without the loss collapsing to zero."""
    from fxopt.testing.training import LearningTask

    task = LearningTask(200, 32, (3, 32, 32), 10, "cpu", seed=0)
    (x0, y0), (x1, _) = task[0], task[1]
    assert torch.equal(x0, task[0][0]) and torch.equal(y0, task[0][1]) and not torch.equal(x0, x1)
    assert len(task) == 200 and y0.dtype == torch.int64 and 0 <= int(y0.min()) and int(y0.max()) < 10
    with pytest.raises(IndexError):
        task[200]
    torch.manual_seed(0)
    model = SeedCNN2()
    losses = [float(v) for v in run_steps(TrainLoop(model, model.parameters(), "cpu", amp=None), task, 200, seed=0)]
    final = sum(losses[-50:]) / 50
    assert losses[0] > 2.0 and 0.01 < final < 0.5 * losses[0], (losses[0], final)


def test_train_loop_gradient_noise_is_seeded_and_one_rounding():
    """``TrainLoop(grad_noise=(eps, seed))``: every gradient times 1 + eps*u, u in [-1, 1]; the same
    seed draws the same numbers (data-parallel replicas stay equal), another seed others."""
    from fxopt.testing.training import UNIT_ROUNDOFF

    torch.manual_seed(0)
    base = torch.nn.Linear(8, 3)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    def grads(noise):
        m = copy.deepcopy(base)
        loop = TrainLoop(m, m.parameters(), "cpu", amp=None, grad_noise=noise)
        loop.optimizer.step = lambda: None  # look at the gradients the optimizer would see
        loop.step(x, y)
        return [p.grad.clone() for p in m.parameters()]

    clean, a, b, c = grads(None), grads((1e-3, 1)), grads((1e-3, 1)), grads((1e-3, 2))
    assert all(torch.equal(p, q) for p, q in zip(a, b)) and not all(torch.equal(p, q) for p, q in zip(a, c))
    for g, g0 in zip(a, clean):
        rel = (g / g0 - 1).abs()
        assert 0 < rel.max() <= 1e-3 * (1 + 1e-3)
    assert UNIT_ROUNDOFF[torch.float16] == 2 ** -11 and UNIT_ROUNDOFF[None] == 2 ** -24


def test_bench_train_checks_widen_to_eagers_own_layout_spread():
    """A row that ran eager in channels_last: a backend is held to the larger of the tolerance and
    eager's own distance between its two memory formats, no further."""
    from fxopt.bench.train import _checks

    row = {"model": "m", "batch": 2, "dtype": "amp-float16", "status": "ok"}
    cells = [{**row, "backend": "eager"},
             {**row, "backend": "eager-channels-last", "losses_max_rel_diff": 0.03, "final_loss_rel_diff": 0.07,
              "final_loss_tol": 0.05, "final_loss": 1.07, "eager_final_loss": 1.0},
             {**row, "backend": "a", "losses_max_rel_diff": 0.03, "final_loss_rel_diff": 0.06,
              "final_loss_tol": 0.05, "final_loss": 1.06, "eager_final_loss": 1.0},
             {**row, "backend": "b", "losses_max_rel_diff": 0.031, "final_loss_rel_diff": 0.0,
              "final_loss_tol": 0.05, "final_loss": 1.0, "eager_final_loss": 1.0},
             {**row, "model": "n", "backend": "a", "losses_max_rel_diff": 0.03}]  # no spread measured
    got = {(c["model"], c["backend"]): c for c in _checks(cells, 0.02)}
    assert got[("m", "a")]["ok"] and got[("m", "a")]["tol"] == 0.03
    assert not got[("m", "b")]["ok"] and "losses differ" in got[("m", "b")]["reason"]
    assert not got[("n", "a")]["ok"] and got[("n", "a")]["tol"] == 0.02
    # eager's rounding references widen the bound to the largest of their distances (a failed one counts not)
    cells[0]["rounding_references"] = [{"status": "ok", "losses_max_rel_diff": 0.025, "final_loss_rel_diff": 0.01},
                                       {"status": "ok", "losses_max_rel_diff": 0.032, "final_loss_rel_diff": 0.02},
                                       {"status": "error", "losses_max_rel_diff": 0.5}]
    got = {(c["model"], c["backend"]): c for c in _checks(cells, 0.02)}
    assert got[("m", "b")]["ok"] and got[("m", "b")]["tol"] == 0.032
    assert not got[("n", "a")]["ok"]  # another row's references do not widen this one's bound


def test_bench_train_arguments():
    from fxopt.bench import train as T

    a = T.parse_args(["--device", "cpu"])
    assert a.rows == list(T.CPU_SUITE.items()) and a.amp == "bfloat16" and a.rounds == 1
    assert a.profile_steps == 0  # profiling only on request (README: the profiler crash)
    a = T.parse_args(["--device", "cpu", "--models", "resnet50,seedcnn2:16", "--batch", "6", "--backends", "fxopt"])
    assert a.rows == [("resnet50", 6), ("seedcnn2", 16)] and a.backends == ["eager", "fxopt"]
    for bad in (["--models", "nope"], ["--models", "seedcnn2:1"], ["--backends", "nope"]):
        with pytest.raises(SystemExit):
            T.parse_args(["--device", "cpu", *bad])


# ---- data parallel ---------------------------------------------------------------------------------
def test_ddp_gloo_two_processes_matches_eager_ddp(tmp_path):
    """torch.compile(DistributedDataParallel(model), backend="fxopt") in 2 processes (gloo): Dynamo's
    DDPOptimizer splits the graph at the bucket boundary (1 MB buckets: SeedCNN2's fc1 weight is one),
    fxopt compiles every piece, and losses and parameters are eager DDP's; the one-device models
    are timed in the same rounds as the DDP ones."""
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "fxopt.bench.ddp", "--device", "cpu", "--model", "seedcnn2", "--batch", "8", "--amp", "none",
           "--warmup", "1", "--iters", "4", "--rounds", "2", "--losses", "5", "--bucket-cap-mb", "1",
           "--backends", "fxopt", "--rounding-references", "1", "--phases", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["world_size"] == 2 and res["meta"]["backend_comm"] == "gloo"
    fx = res["summary"]["backends"]["fxopt"]
    assert fx["status"] == "ok" and fx["losses_max_rel_diff"] <= LOSS_TOLERANCE[None]
    assert fx["param_rel_diff"] <= 1e-4 and fx["param_rel_diff_parameters"] <= 1e-4
    # one-device and DDP models timed in the same 2 rounds, 2 steps each: the scaling compares like with like
    assert res["meta"]["config"]["rounds"] == 2 and fx["scaling"] > 0
    for rank in res["ranks"]:
        assert [rank["single"][be]["n"] for be in ("eager", "fxopt")] == [4, 4]
        assert [rank["ddp"][be]["n"] for be in ("eager", "fxopt")] == [4, 4]
    for rank in res["ranks"]:
        graphs = rank["ddp"]["fxopt"]["fxopt"]
        assert graphs["graphs"].count("forward") >= 2 and graphs["graphs"].count("backward") >= 2, graphs
        assert graphs["fallbacks"] == []
        # first, warm-up, 2 x (re-warm + timed), 2 under the phase timer
        assert len(rank["ddp"]["fxopt"]["losses"]) == 1 + 1 + 2 * (2 + 2) + 2
    for which in ("phases_single", "phases_ddp"):  # host times only on the CPU
        assert fx[which]["steps"] == 2 and fx[which]["backward"]["host_ms"] > 0 and "gpu_ms" not in fx[which]["forward"]
    assert set(fx["ddp_stats"]) >= {"forward_compute_time_ms", "backward_compute_time_ms"}, fx["ddp_stats"]
    # eager DDP with gradients perturbed by one float32 rounding, the same noise on both ranks
    (ref,) = res["summary"]["rounding_references"]
    assert ref["status"] == "ok" and 0 < ref["param_rel_diff"] <= 1e-4
    assert all(c["ok"] for c in res["summary"]["checks"])


# ---- GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_train_on_gpu_profiles_the_step(tmp_path):
    from fxopt.bench.train import main

    out = tmp_path / "gpu"
    assert main(["--device", "cuda", "--models", "seedcnn2:32", "--backends", "eager,fxopt", "--warmup", "2",
                 "--iters", "6", "--rounds", "2", "--profile-steps", "2", "--out", str(out)]) == 0
    cells = {c["backend"]: c for c in json.loads((out / "results.json").read_text())["cells"]}
    for c in cells.values():
        assert c["kernels_per_step"] > 0 and c["gpu_kernel_ms"] > 0 and c["host_ms"] > 0 and c["peak_mem_mb"] > 0
        assert 0 < c["step_peak_mem_mb"] <= c["peak_mem_mb"] + 1  # compiled steps need no more than compiling
    assert cells["fxopt"]["losses_max_rel_diff"] <= LOSS_TOLERANCE[torch.float16]
    decisions = cells["fxopt"]["fxopt"]["cudagraph_decisions"]
    assert {d["graph"] for d in decisions} == {"forward", "backward"}
    assert all(d["runs"] in ("optimized graph", "optimized plain", "baseline graph") for d in decisions)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@_examples(10)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), training=True, min_batch=2, max_layers=4))
def test_training_under_float16_autocast_on_gpu(case):
    """Generated training graphs on CUDA under float16 autocast: loss, gradients and buffers within
    float16's tolerance of eager's (a gradient beyond it no further from float64 than twice eager's)."""
    case.model.cuda()
    case.inputs = tuple(t.cuda() for t in case.inputs)
    check_equivalence(case, autocast=torch.float16)


def test_ddp_checks_take_the_rounding_spread_apart_per_part_and_require_equal_replicas():
    """The DDP checks: a compiled backend's distance from eager DDP may be as large as eager
    channels_last's own or eager DDP's rounding references' (the largest over ranks and seeds), the
    trained parameters and BatchNorm's buffers each bounded by their own spread; replicas whose
    parameters differ across ranks (gradients not all-reduced) fail whatever the losses say."""
    from types import SimpleNamespace

    from fxopt.bench.ddp import PARAM_TOLERANCE, _summarize

    def cell(loss_diff=None, params=None, buffers=None, replica=0.0, fx=None):
        return {"status": "ok", "median_ms": 10.0, "images_per_s": 12800.0, "images_per_s_per_device": 6400.0,
                "losses_max_rel_diff": loss_diff, "param_rel_diff": None if params is None else max(params, buffers),
                "param_rel_diff_parameters": params, "param_rel_diff_buffers": buffers, "replica_diff": replica,
                "fxopt": fx}

    fx = {"graphs": ["forward", "backward"], "fallbacks": []}
    a = SimpleNamespace(backends=["eager", "eager-channels-last", "fxopt"], amp="float16")
    ranks = [{"single": {}, "ddp": {"eager": cell(), "eager-channels-last": cell(0.05, 0.04, 0.7),
                                    "fxopt": cell(0.05, 0.04, 0.7, fx=fx)}} for _ in range(2)]
    out = _summarize(ranks, a, 0.02)
    assert out["tolerances"] == {"losses": 0.05, "parameters": 0.04, "buffers": 0.7}
    assert all(c["ok"] for c in out["checks"]), out["checks"]
    ranks[1]["ddp"]["fxopt"]["param_rel_diff_parameters"] = 0.05  # buffers far apart do not hide the parameters
    bad = {c["backend"]: c for c in _summarize(ranks, a, 0.02)["checks"]}["fxopt"]
    assert not bad["ok"] and bad["reason"] == "parameters differ from eager DDP's by 0.05 > 0.04"
    ranks[1]["ddp"]["fxopt"].update(param_rel_diff_parameters=0.04, replica_diff=1e-3)
    bad = {c["backend"]: c for c in _summarize(ranks, a, 0.02)["checks"]}["fxopt"]
    assert not bad["ok"] and "replicas" in bad["reason"]
    a.backends = ["eager", "fxopt"]  # no reference ran: the precision's tolerances
    ranks[1]["ddp"]["fxopt"]["replica_diff"] = 0.0
    out = _summarize(ranks, a, 0.02)
    assert out["tolerances"] == {"losses": 0.02, "parameters": PARAM_TOLERANCE["float16"],
                                 "buffers": PARAM_TOLERANCE["float16"]}
    reason = out["checks"][-1]["reason"]
    assert "losses differ" in reason and "parameters differ" in reason and "buffers differ" in reason
    # eager DDP's rounding references: the bounds widen to their largest distance over the ranks and seeds
    for i, r in enumerate(ranks):
        r["ddp"]["eager"]["rounding_references"] = [
            {"status": "ok", "noise_seed": 1, "grad_noise": 2 ** -11, "losses_max_rel_diff": 0.03 + 0.02 * i,
             "param_rel_diff_parameters": 0.04, "param_rel_diff_buffers": 0.5},
            {"status": "ok", "noise_seed": 2, "grad_noise": 2 ** -11, "losses_max_rel_diff": 0.01,
             "param_rel_diff_parameters": 0.03, "param_rel_diff_buffers": 0.6 + 0.1 * i}]
    out = _summarize(ranks, a, 0.02)
    assert out["tolerances"] == {"losses": 0.05, "parameters": 0.04, "buffers": 0.7} and out["checks"][-1]["ok"]
    assert [r["losses_max_rel_diff"] for r in out["rounding_references"]] == [0.05, 0.01]
    ranks[1]["ddp"]["eager"]["rounding_references"][1]["status"] = "error"  # a failed reference widens nothing
    assert _summarize(ranks, a, 0.02)["tolerances"] == {"losses": 0.05, "parameters": 0.04, "buffers": 0.5}


def test_ddp_parameter_distance_over_parameters_and_buffers_and_apart():
    from fxopt.bench.ddp import _param_rel_diff

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 1), torch.nn.BatchNorm2d(3))
    with torch.no_grad():
        ref[1].running_var.fill_(4.0)
    other = copy.deepcopy(ref)
    with torch.no_grad():
        other[0].weight[0, 0, 0, 0] += 0.5
        other[1].running_var[1] += 1.0
    d = _param_rel_diff(other, ref)
    w_max = max(p.abs().max().item() for p in ref.parameters())
    assert d["parameters"] == pytest.approx(0.5 / w_max) and d["buffers"] == pytest.approx(1.0 / 4.0)
    assert d["all"] == pytest.approx(1.0 / 4.0)  # the largest difference over the largest magnitude of all
    assert _param_rel_diff(ref, copy.deepcopy(ref)) == {"all": 0.0, "parameters": 0.0, "buffers": 0.0}


def test_ddp_arguments_profile_only_on_request():
    from fxopt.bench.ddp import parse_args

    a = parse_args(["--device", "cpu", "--model", "seedcnn2"])
    assert a.profile_steps == 0 and a.backends == ["eager", "eager-channels-last", "fxopt"] and a.ddp_options == {}
    a = parse_args(["--device", "cpu", "--model", "seedcnn2", "--trace", "--ddp-options", '{"static_graph": true}'])
    assert a.profile_steps == 2 and a.ddp_options == {"static_graph": True}
    assert parse_args(["--device", "cpu", "--model", "seedcnn2", "--trace", "--profile-steps", "4"]).profile_steps == 4
