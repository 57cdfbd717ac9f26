"""Training-step benchmark: ``fxopt bench --train`` (= ``python -m fxopt.bench.train``).

Times the reference training loop (``fxopt.testing.training.TrainLoop``: autocast, GradScaler with
float16, Adam, cross-entropy) with the model run by each backend: eager, Inductor (default mode
and ``reduce-overhead``) and fxopt, every backend through the same loop code, from the same
initial weights (one seeded model, deep-copied) on the same seeded batches (step ``i`` trains on
batch ``i mod --data-batches``). Per (model, batch, precision, backend) it records:

- the median step time (forward + backward + optimizer step, ``scaler.step`` + ``scaler.update``
  with float16) over ``--iters`` steps after ``--warmup`` steps (CUDA events around each step on
  CUDA, ``time.perf_counter`` on the CPU), spread over ``--rounds`` rounds in which the backends
  of a row take turns, as in the inference harness;
- the wall time of the first step (compile + one step; fxopt's own share from its reports);
- the first ``--losses`` losses (default 20) and their max relative difference from eager's, and
  with ``--final-steps N`` the final loss of a second training from the same initial weights (the
  compiled model, a fresh optimizer) on N fresh batches of a task the model learns
  (``fxopt.testing.training.LearningTask``): the mean loss over the last 50 steps against eager's
  (within 5%); with ``--final-tasks K`` the mean of that over K such trainings, each on its own
  task (its own seed), so that the comparison is of what a training reaches, not of where one
  chaotic training happened to end;
- on CUDA, with ``--profile-steps N`` (default none), over N steps under ``torch.profiler`` (right
  after the warm-up, before the next backend compiles; for every backend at the same step): GPU
  kernels launched per step, GPU kernel time per step (the rest of a step is time the GPU waits for
  the host) and host time per step (CPU time outside waits for the GPU; profiler overhead included:
  an upper bound);
- the peak memory: over the backend's compile, first step and warm-up (``peak_mem_mb``), and over
  two steps after them (``step_peak_mem_mb``: what training keeps needing once compiled);
- for fxopt: its graphs (forward/backward, per Dynamo graph), fallbacks, why CUDA graphs are off
  for them, what the partition saved for backward (``fxopt.training``) and, per graph and input
  signature, which way its CUDA-graph runner runs it and the times behind the choice.

Every step of a backend, timed or not, is a training step, and every backend runs the same number
of steps in the same order, so loss ``i`` of one backend compares with loss ``i`` of eager's.
Writes results.json, results.md, summary.md (and speedup.png) to ``--out``; exits 1 when a check
fails (a loss curve outside tolerance, fxopt falling back).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shlex
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from fxopt.modelspec import csv_list

__all__ = ["TRAIN_BACKENDS", "build_parser", "main", "parse_args", "run_training_benchmark", "render_markdown"]

#: the training suite on CUDA: model name -> batch
CUDA_SUITE = {"seedcnn2": 32, "resnet18": 64, "resnet50": 64, "mobilenet_v2": 64}
#: on the CPU: small batches (and --image-size 64 for the ImageNet models)
CPU_SUITE = {"seedcnn2": 8, "resnet18": 4}
CPU_IMAGE_SIZE = 64


# ---- backends: the model a backend trains ------------------------------------
def _eager(model, options, sink):
    return model


def _inductor(mode: Optional[str] = None):
    def wrap(model, options, sink):
        import torch

        return torch.compile(model, backend="inductor", **({"mode": mode} if mode else {}))

    return wrap


def _eager_channels_last(model, options, sink):
    """Eager with the model's weights in channels_last (the hand-tuned layout for convolutions on
    tensor cores): the first convolution turns the activations channels_last, the rest follow."""
    import torch

    return model.to(memory_format=torch.channels_last)


def _floor_aot_eager(model, options, sink):
    import torch

    return torch.compile(model, backend="aot_eager")


def _fxopt(extra: Dict[str, Any]):
    def wrap(model, options, sink):
        import torch

        from fxopt.backend import fxopt_backend

        opts = {**(options or {}), **extra}

        def backend(gm, example_inputs):  # backend="fxopt", keeping its reports
            return fxopt_backend(gm, example_inputs, options=opts, _sink=sink)

        return torch.compile(model, backend=backend)

    return wrap


#: name -> (wrap(model, fxopt options, report sink) -> the module to train, run by default)
TRAIN_BACKENDS: Dict[str, tuple] = {
    "eager": (_eager, True),
    "eager-channels-last": (_eager_channels_last, False),
    "inductor": (_inductor(), True),
    "inductor-reduce-overhead": (_inductor("reduce-overhead"), True),
    "inductor-max-autotune": (_inductor("max-autotune"), False),
    "fxopt": (_fxopt({}), True),
    "fxopt-default-partition": (_fxopt({"partitioner": "default"}), False),
    "fxopt-torch-executor": (_fxopt({"executor": "torch"}), False),  # ATen kernels, CUDA graphs
    "floor-aot-eager": (_floor_aot_eager, False),
}
DEFAULT_BACKENDS = [n for n, (_, default) in TRAIN_BACKENDS.items() if default]


# ---- arguments ----------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fxopt bench --train",
        description="Time training steps (autocast + GradScaler + Adam + cross-entropy) of eager, Inductor and fxopt.")
    p.add_argument("--models", help="comma list of MODEL or MODEL:BATCH (default on cuda: "
                   + ",".join(f"{m}:{b}" for m, b in CUDA_SUITE.items()) + "; on cpu: "
                   + ",".join(f"{m}:{b}" for m, b in CPU_SUITE.items()) + ")")
    p.add_argument("--batch", type=int, help="batch for models given without one (default: the suite's, else 32)")
    p.add_argument("--amp", default=None, choices=["float16", "bfloat16", "none"],
                   help="autocast dtype (default float16 with GradScaler on cuda, bfloat16 on cpu; "
                   "bfloat16 and none train without GradScaler)")
    p.add_argument("--backends", help=f"comma list (default {','.join(DEFAULT_BACKENDS)}; "
                   f"known: {','.join(TRAIN_BACKENDS)})")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cuda if available")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps after the first (default 10)")
    p.add_argument("--iters", type=int, default=50, help="timed steps (default 50)")
    p.add_argument("--rounds", type=int, help="spread the timed steps over this many rounds, the backends of a "
                   "row taking turns (default 5 on cuda, 1 on cpu)")
    p.add_argument("--rewarm", type=int, default=2, help="untimed steps at the start of every round (rounds > 1)")
    p.add_argument("--losses", type=int, default=20, help="losses compared with eager's (default 20)")
    p.add_argument("--final-steps", type=int, default=0, metavar="N",
                   help="train every backend's model again from the initial weights for N steps of a learning task "
                        "(fresh batches) and compare its final loss (mean of the last 50) with eager's (e.g. 200)")
    p.add_argument("--final-tasks", type=int, default=1, metavar="K",
                   help="with --final-steps: K such trainings, each on its own learning task (seeds seed .. "
                        "seed+K-1); the final loss is the mean of their final losses (default 1)")
    p.add_argument("--rounding-references", type=int, default=4, metavar="K",
                   help="per row, K untimed runs of eager with every gradient perturbed by one rounding of the "
                        "precision (one seed each): their largest distance from eager's losses bounds every "
                        "backend's (default 4; 0: the fixed tolerance and eager channels_last only)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="steps under torch.profiler on cuda (default 0: a profiler session tracing CUDA-graph "
                        "replays after other backends' graphs were captured and destroyed crashed the process, "
                        "see README)")
    p.add_argument("--data-batches", type=int, default=4, help="distinct batches the steps cycle through")
    p.add_argument("--image-size", type=int, help=f"input height/width of the ImageNet models (default 224; "
                   f"{CPU_IMAGE_SIZE} on cpu)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--fxopt-options", default=None, metavar="JSON", help="options for the fxopt backends")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no new row after S seconds (the rest are marked skipped)")
    p.add_argument("--out", default="bench_train_out", help="output directory (default bench_train_out/)")
    p.add_argument("--merge", nargs="+", metavar="RESULTS_JSON", help="measure nothing: merge the results.json "
                   "of runs split over several commands (one per model) into one report in --out")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    from . import models as M

    p = build_parser()
    a = p.parse_args(list(argv) if argv is not None else None)
    if a.device is None:
        import torch
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    suite = CUDA_SUITE if a.device == "cuda" else CPU_SUITE
    rows = []
    for item in (csv_list(a.models) if a.models else [f"{m}:{b}" for m, b in suite.items()]):
        name, _, batch = item.partition(":")
        if name not in M.MODELS:
            p.error(f"unknown model {name!r}; known: {', '.join(M.MODELS)}")
        try:
            b = int(batch) if batch else (a.batch or suite.get(name, 32))
        except ValueError:
            p.error(f"batch of {name} must be an int, got {batch!r}")
        if b < 2:
            p.error("batches must be >= 2 (BatchNorm in training mode needs two values per channel)")
        rows.append((name, b))
    a.rows = rows
    a.amp = a.amp or ("float16" if a.device == "cuda" else "bfloat16")
    a.backends = csv_list(a.backends) if a.backends else list(DEFAULT_BACKENDS)
    bad = [b for b in a.backends if b not in TRAIN_BACKENDS]
    if bad:
        p.error(f"unknown backend(s) {bad}; known: {', '.join(TRAIN_BACKENDS)}")
    if "eager" not in a.backends:
        a.backends.insert(0, "eager")  # the reference every loss curve is compared with
    a.rounds = a.rounds or (5 if a.device == "cuda" else 1)
    if min(a.iters, a.rounds, a.data_batches, a.final_tasks) < 1 or min(a.warmup, a.rewarm, a.losses, a.profile_steps,
                                                          a.rounding_references) < 0:
        p.error("--iters, --rounds, --data-batches, --final-tasks must be >= 1; --warmup, --rewarm, --losses, "
                "--profile-steps, --rounding-references >= 0")
    a.image_size = a.image_size or (CPU_IMAGE_SIZE if a.device == "cpu" else None)
    try:
        a.fxopt_options = json.loads(a.fxopt_options) if a.fxopt_options else {}
    except json.JSONDecodeError as exc:
        p.error(f"--fxopt-options is not valid JSON: {exc}")
    if not isinstance(a.fxopt_options, dict):
        p.error("--fxopt-options must be a JSON object")
    return a


# ---- one backend's run -----------------------------------------------------------
class Trainee:
    """One backend training its own copy of the model: the loop, its losses and its step times.
    ``device`` may name a device index (``cuda:1``); ``wrap_model`` wraps the copy before the
    backend compiles it (``DistributedDataParallel`` in ``fxopt.bench.ddp``). Step ``i`` starts from
    ``torch.manual_seed(seed + 1000 + i)`` (``fxopt.testing.training.run_steps``): the backends train in
    turns, and dropout draws the same masks at step ``i`` in each. ``grad_noise``: see ``TrainLoop``
    (the rounding references)."""

    def __init__(self, backend: str, base_model, batches, device: str, amp: str, lr: float = 1e-3,
                 fxopt_options: Optional[Dict[str, Any]] = None, wrap_model: Optional[Callable] = None,
                 seed: int = 0, grad_noise: Optional[tuple] = None):
        import torch

        self.backend, self.batches, self.seed = backend, batches, seed + 1000
        self.amp, self.lr, self.grad_noise = amp, lr, grad_noise
        self.final_losses: List = []  # per learning task, its losses
        self.device = torch.device(device).type
        self.cell: Dict[str, Any] = {"backend": backend, "status": "ok", "error": None}
        self.reports: List = []
        self.losses: List = []
        self.samples: List[float] = []
        self.round_medians: List[float] = []
        self.model = copy.deepcopy(base_model).to(device)
        self.module = wrap_model(self.model) if wrap_model is not None else self.model
        wrap, _ = TRAIN_BACKENDS[backend]
        self.trained = wrap(self.module, fxopt_options, self.reports)
        self.loop = self._new_loop()
        self.base_mem = 0
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.base_mem = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    def steps(self, n: int) -> None:
        from fxopt.testing.training import run_steps

        self.losses += run_steps(self.loop, self.batches, n, start=len(self.losses), seed=self.seed)

    def first_step(self) -> None:
        t0 = time.perf_counter()
        self.steps(1)
        _sync(self.device)
        self.cell["first_step_s"] = time.perf_counter() - t0
        if self.reports:
            self.cell["fxopt_compile_s"] = sum(r.compile_ms for r in self.reports) / 1e3

    def _new_loop(self):
        """The reference loop over the trained module, with a fresh optimizer (and GradScaler)."""
        from fxopt.testing.training import AMP_DTYPES, TrainLoop

        return TrainLoop(self.trained, self.module.parameters(), self.device, amp=AMP_DTYPES[self.amp], lr=self.lr,
                         grad_noise=self.grad_noise)

    def converge(self, base_model, tasks: Sequence) -> None:
        """Per learning task (``fxopt.testing.training.LearningTask``), train again from
        ``base_model``'s weights and buffers (copied in place: compiled graphs read the parameters
        where they live) with a fresh optimizer, one step per batch of the task; the losses of task
        ``j`` in ``final_losses[j]``."""
        from fxopt.testing.training import run_steps

        self.final_losses = []
        for j, task in enumerate(tasks):
            self.model.load_state_dict(base_model.state_dict())
            self.final_losses.append(run_steps(self._new_loop(), task, len(task),
                                               seed=self.seed + 10 ** 6 + j * 10 ** 4))

    def timed(self, n: int) -> None:
        got = _time_steps(self, n)
        self.samples += got
        self.round_medians.append(statistics.median(got))


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _time_steps(t: Trainee, n: int) -> List[float]:
    """Per-step times in ms (the inference harness's timing: CUDA events on CUDA, perf_counter on
    the CPU)."""
    from fxopt.testing.training import run_steps

    from .runners import time_calls

    def step(_):
        t.losses += run_steps(t.loop, t.batches, 1, start=len(t.losses), seed=t.seed)

    return time_calls(step, None, t.device, n)


#: CUDA runtime calls in which the host waits for the GPU
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
          "cudaMemcpyAsync")


def step_profile(t: Trainee, steps: int, trace: Optional[str] = None) -> Dict[str, float]:
    """GPU kernels per step, GPU kernel time per step and host time per step (CPU time of the step
    outside waits for the GPU), from ``steps`` steps under torch.profiler (CUDA only). NCCL's
    kernels (data parallel) are not counted there but as ``comm_kernel_ms``. ``trace``: also write
    the steps' timeline there (Chrome trace format)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        t.steps(steps)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    kernels, gpu_us, comm_us, wait_us = 0, 0.0, 0.0, 0.0
    for e in prof.events():
        kind = getattr(getattr(e, "device_type", None), "name", None)
        if kind == "CUDA":
            if e.name.startswith("nccl"):  # collectives (DDP): they overlap the compute kernels
                comm_us += e.time_range.elapsed_us()
            elif not e.name.startswith(("Memcpy", "Memset")):
                kernels += 1
                gpu_us += e.time_range.elapsed_us()
        elif e.name in _WAITS:
            wait_us += e.time_range.elapsed_us()
    out = {"kernels_per_step": kernels / steps, "gpu_kernel_ms": gpu_us / 1e3 / steps,
           "host_ms": max(0.0, wall * 1e3 - wait_us / 1e3) / steps}
    if comm_us:
        out["comm_kernel_ms"] = comm_us / 1e3 / steps
    return out


def _graph_summary(reports: List) -> Dict[str, Any]:
    """What fxopt's reports say about the graphs it compiled for training."""
    saved = [r.training.get("saved_for_backward") for r in reports if r.kind == "backward"]
    saved = [s for s in saved if s]
    return {
        "graphs": [r.kind for r in reports],
        "fallbacks": [r.fallback for r in reports if r.fallback],
        "cudagraphs": sorted({f"{r.kind}: {r.cudagraphs}" for r in reports}),
        "executors": sorted({r.executor for r in reports}),
        "partitioner": sorted({str(r.training.get("partitioner")) for r in reports if r.kind != "inference"}),
        "saved_activations": sum(s["activations"] for s in saved),
        "saved_activation_mb": sum(s["activation_bytes"] for s in saved) / 2 ** 20,
        "cudagraph_decisions": _runner_decisions(reports),
    }


#: what a CUDA-graph runner's decision (``CudaGraphRunner.decisions()``) the results keep
_DECISION_KEYS = ("runs", "graph_ms", "plain_ms", "baseline_graph_ms", "not_measured", "cached")


def _runner_decisions(reports: List) -> List[Dict[str, Any]]:
    """Per graph and input signature of fxopt's CUDA-graph runners: which way it runs (the optimized
    graph replayed or uncaptured, or the unoptimized graph replayed) and the times behind it."""
    out = []
    for r in reports:
        runner = (r.executor_details or {}).get("cudagraph_runner")
        for d in runner.decisions() if runner is not None else []:
            out.append({"graph": r.kind, **{k: d[k] for k in _DECISION_KEYS if k in d}})
    return out


def _fail(cell: Dict[str, Any], exc: BaseException, errors: List[str], what: str) -> None:
    import traceback

    first = (str(exc).strip().splitlines() or [""])[0][:300]
    cell.update(status="error", error=f"{type(exc).__name__}: {first}")
    errors.append(f"[{what}] " + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


def _guarded(t: Trainee, fn: Callable[[], None], errors: List[str], what: str) -> None:
    """Run one phase of a backend; a failure marks its cell and stops it (never the run)."""
    if t.cell["status"] != "ok":
        return
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        for w in caught:
            if "fallback" in w.category.__name__.lower():
                t.cell.setdefault("fallback", str(w.message).splitlines()[0][:200])
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # noqa: BLE001 - a failing backend is a result, not a crash
        _fail(t.cell, exc, errors, f"{t.backend} {what}")


# ---- the run ------------------------------------------------------------------------
def _build(name: str, a) -> tuple:
    """(model in train mode, per-sample input shape, classes), seeded."""
    import torch

    from . import models as M

    model, shape = M.build_model(name, a.seed)
    if a.image_size and len(shape) == 3 and shape[1:] == (224, 224):
        shape = (shape[0], a.image_size, a.image_size)
    with torch.no_grad():
        classes = model(torch.zeros((1, *shape))).shape[-1]  # eval mode: batch 1 is fine
    return model.train(), shape, classes


def _finish(t: Trainee, eager: Optional[Trainee], a, rounds: int) -> Dict[str, Any]:
    """The backend's cell: step time statistics, loss comparison, fxopt's graphs."""
    from fxopt.testing.training import FINAL_LOSS_STEPS, FINAL_LOSS_TOLERANCE, max_rel_diff

    from .runners import stats

    cell = t.cell
    losses = [float(x) for x in t.losses]
    cell["losses"] = losses[:max(a.losses, 1)]
    cell["steps"] = len(losses)
    if t.reports:
        cell["fxopt"] = _graph_summary(t.reports)
    if cell["status"] == "ok" and t.samples:
        st = stats(t.samples)
        cell.update({f"{k}_ms": v for k, v in st.items() if k != "n"})
        cell["n"], cell["rounds"] = st["n"], rounds
        cell["round_medians_ms"] = [round(s, 5) for s in t.round_medians]
        cell["samples_ms"] = [round(s, 5) for s in t.samples]
    ok = eager is not None and eager.cell["status"] == "ok"
    ref = [float(x) for x in eager.losses] if ok else None

    def final(runs):  # the mean over learning tasks of the mean loss over a task's last FINAL_LOSS_STEPS steps
        if not a.final_steps or not runs or any(len(xs) != a.final_steps for xs in runs):
            return None
        k = min(FINAL_LOSS_STEPS, a.final_steps)
        return [sum(float(x) for x in xs[-k:]) / k for xs in runs]

    cell["learning_task_steps"] = sum(len(xs) for xs in t.final_losses)
    mine = final(t.final_losses)
    if mine is not None:
        cell["final_loss"] = sum(mine) / len(mine)
        cell["final_loss_per_task"] = mine
    if ref is not None and t is not eager and cell["status"] == "ok":
        n = min(a.losses, len(losses), len(ref))
        cell["losses_max_rel_diff"] = max_rel_diff(losses[:n], ref[:n]) if n else None
        theirs = final(eager.final_losses)
        if "final_loss" in cell and theirs is not None and len(theirs) == len(mine):
            cell["eager_final_loss"] = sum(theirs) / len(theirs)
            cell["final_loss_rel_diff"] = abs(cell["final_loss"] - cell["eager_final_loss"]) / abs(
                cell["eager_final_loss"])
            cell["final_loss_tol"] = FINAL_LOSS_TOLERANCE
    return cell


def _rounding_references(base, batches, tasks, eager: Trainee, a, errors: List[str]) -> List[Dict[str, Any]]:
    """``a.rounding_references`` runs of eager whose gradients are perturbed by one rounding of the
    loop's precision at every step (``TrainLoop(grad_noise=...)``, one seed each), untimed, as many
    steps as the loss checks read (and the learning task): how far rounding alone moves eager's loss
    curve from eager's. The largest of their distances (and eager channels_last's) bounds every
    backend's."""
    from fxopt.testing.training import AMP_DTYPES, UNIT_ROUNDOFF

    eps = UNIT_ROUNDOFF[AMP_DTYPES[a.amp]]
    out = []
    for k in range(1, a.rounding_references + 1):
        t = Trainee("eager", base, batches, a.device, a.amp, a.lr, seed=a.seed, grad_noise=(eps, a.seed + k))
        _guarded(t, lambda: t.steps(a.losses), errors, f"rounding reference {k}")
        if a.final_steps:
            _guarded(t, lambda: t.converge(base, tasks), errors, f"rounding reference {k}, learning tasks")
        cell = _finish(t, eager, a, 0)
        out.append({"grad_noise": eps, "noise_seed": a.seed + k, "status": cell["status"],
                    **{key: cell.get(key) for key in ("losses_max_rel_diff", "final_loss", "final_loss_rel_diff")
                       if key in cell}})
    return out


def _eager_mean_final(cells: List[Dict[str, Any]]) -> None:
    """Eager's final loss as the mean over its trainings: eager's own and its rounding references'
    (each an equally valid eager training: one rounding per step apart, as eager on another
    device or with another cuDNN algorithm would be). One chaotic training's final loss is one draw;
    the mean of several is what eager reaches. Every backend's final loss gets its distance from
    that mean (``final_loss_rel_diff_eager_mean``), and eager's cell how far its own trainings lie
    from it (``eager_trainings_rel_diff``)."""
    eager = next((c for c in cells if c["backend"] == "eager" and c.get("final_loss") is not None), None)
    if eager is None:
        return
    runs = [eager["final_loss"]] + [r["final_loss"] for r in eager.get("rounding_references") or []
                                    if r.get("status") == "ok" and r.get("final_loss") is not None]
    if len(runs) < 2:
        return
    mean = sum(runs) / len(runs)
    eager["eager_mean_final_loss"], eager["eager_final_trainings"] = mean, len(runs)
    eager["eager_trainings_rel_diff"] = [abs(x - mean) / abs(mean) for x in runs]
    for c in cells:
        if c is not eager and c.get("final_loss") is not None:
            c["eager_mean_final_loss"] = mean
            c["final_loss_rel_diff_eager_mean"] = abs(c["final_loss"] - mean) / abs(mean)


def _tiny_model():
    """What each backend trains for one step before the suite, so that the one-time costs of a
    process (imports, Dynamo's and the compiler's first use) are not counted in the first row's
    compile time."""
    import torch.nn as nn

    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).train()


def _prime(a, errors: List[str]) -> Dict[str, float]:
    """One step of the tiny model per backend; seconds each took."""
    from fxopt.testing.training import make_batches

    batches = make_batches(1, 2, (3, 8, 8), 3, a.device, a.seed)
    took = {}
    for be in a.backends:
        cell: Dict[str, Any] = {"status": "ok"}
        t0 = time.perf_counter()
        try:
            t = Trainee(be, _tiny_model(), batches, a.device, a.amp, a.lr, a.fxopt_options, seed=a.seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t.steps(1)
            _sync(a.device)
        except Exception as exc:  # noqa: BLE001 - the backend fails again (and is reported) in the suite
            _fail(cell, exc, errors, f"{be} priming")
        took[be] = round(time.perf_counter() - t0, 3)
    return took


def run_training_benchmark(a: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    import torch
    from tqdm import tqdm

    from fxopt.testing.training import AMP_DTYPES, LOSS_TOLERANCE, LearningTask, make_batches

    from .environment import _device_info, _versions

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but torch.cuda.is_available() is False")
    if a.device == "cuda":
        torch.backends.cudnn.benchmark = True  # as the inference harness: cuDNN measures, every backend alike
    cfg = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):  # every backend of a row stays compiled
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(getattr(cfg, knob), 64))
    cmd = "fxopt bench --train " + shlex.join(list(argv) if argv is not None else sys.argv[1:])
    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "command": cmd,
            "kind": "training", "device_type": a.device, **_device_info(a.device), "versions": _versions(),
            "fxopt_options": a.fxopt_options, "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "loss_tolerance": LOSS_TOLERANCE[AMP_DTYPES[a.amp]],
            "config": {"rows": a.rows, "amp": a.amp, "grad_scaler": a.amp == "float16", "optimizer": "Adam",
                       "lr": a.lr, "backends": a.backends, "warmup": a.warmup, "iters": a.iters,
                       "rounds": a.rounds, "rewarm": a.rewarm, "losses": a.losses, "final_steps": a.final_steps,
                       "final_tasks": a.final_tasks,
                       "rounding_references": a.rounding_references,
                       "profile_steps": a.profile_steps if a.device == "cuda" else 0,
                       "data_batches": a.data_batches, "image_size": a.image_size, "seed": a.seed}}
    results: Dict[str, Any] = {"meta": meta, "cells": [], "checks": []}
    errors: List[str] = []
    dtype_label = f"amp-{a.amp}"
    per_round = -(-a.iters // a.rounds)
    meta["priming_s"] = _prime(a, errors)  # one-time process costs, per backend, outside the rows
    t_start = time.perf_counter()
    bar = tqdm(total=len(a.rows) * len(a.backends), desc="fxopt bench --train", unit="cell", file=sys.stderr,
               mininterval=0.5)
    try:
        for name, batch in a.rows:
            row = {"model": name, "batch": batch, "dtype": dtype_label}
            if a.time_budget and time.perf_counter() - t_start > a.time_budget:
                for be in a.backends:
                    results["cells"].append({**row, "backend": be, "status": "skipped", "error": "time budget"})
                bar.update(len(a.backends))
                continue
            torch._dynamo.reset()
            try:
                base, shape, classes = _build(name, a)
            except Exception as exc:  # noqa: BLE001
                for be in a.backends:
                    cell = {**row, "backend": be}
                    _fail(cell, exc, errors, f"{name} model")
                    results["cells"].append(cell)
                bar.update(len(a.backends))
                continue
            batches = make_batches(a.data_batches, batch, shape, classes, a.device, a.seed)
            trainees: List[Trainee] = []
            for be in a.backends:
                bar.set_postfix_str(f"{name} b{batch} {be}")
                try:
                    t = Trainee(be, base, batches, a.device, a.amp, a.lr, a.fxopt_options, seed=a.seed)
                except Exception as exc:  # noqa: BLE001
                    cell = {**row, "backend": be}
                    _fail(cell, exc, errors, f"{name} {be} setup")
                    results["cells"].append(cell)
                    continue
                _guarded(t, t.first_step, errors, "first step")
                _guarded(t, lambda: t.steps(a.warmup), errors, "warm-up")
                if a.device == "cuda":  # before the next backend allocates: this one's compile and steps
                    t.cell["peak_mem_mb"] = (torch.cuda.max_memory_allocated() - t.base_mem) / 2 ** 20
                    torch.cuda.reset_peak_memory_stats()  # then steps alone, compiled and warm
                    _guarded(t, lambda: t.steps(2), errors, "steady steps")
                    t.cell["step_peak_mem_mb"] = (torch.cuda.max_memory_allocated() - t.base_mem) / 2 ** 20
                if a.device == "cuda" and a.profile_steps:  # before the next backend compiles (README: profiling)
                    _guarded(t, lambda: t.cell.update(step_profile(t, a.profile_steps)), errors, "profile")
                trainees.append(t)
                bar.update(1)
            for _ in range(a.rounds):
                for t in trainees:
                    if a.rounds > 1:  # untimed steps first: this backend's code back in front of Dynamo's cache
                        _guarded(t, lambda: t.steps(a.rewarm), errors, "re-warm")
                    _guarded(t, lambda: t.timed(per_round), errors, "timed steps")
            for t in trainees:
                left = a.losses - len(t.losses)
                if left > 0:
                    _guarded(t, lambda: t.steps(left), errors, "further steps")
            tasks = [LearningTask(a.final_steps, batch, shape, classes, a.device, a.seed + j)
                     for j in range(a.final_tasks)] if a.final_steps else []
            if tasks:
                for t in trainees:
                    bar.set_postfix_str(f"{name} b{batch} {t.backend} learning tasks")
                    _guarded(t, lambda: t.converge(base, tasks), errors, "learning tasks")
            eager = next((t for t in trainees if t.backend == "eager"), None)
            cells = [{**row, **_finish(t, eager, a, a.rounds)} for t in trainees]
            if eager is not None and eager.cell["status"] == "ok" and a.rounding_references:
                bar.set_postfix_str(f"{name} b{batch} rounding references")
                eager_cell = next(c for c in cells if c["backend"] == "eager")
                eager_cell["rounding_references"] = _rounding_references(base, batches, tasks, eager, a, errors)
                _eager_mean_final(cells)
            results["cells"] += cells
            del trainees
            torch._dynamo.reset()
            if a.device == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        meta["interrupted"] = True
        print("\ninterrupted: writing the results so far", file=sys.stderr)
    finally:
        bar.close()
    results["checks"] = _checks(results["cells"], meta["loss_tolerance"])
    results["errors_logged"] = len(errors)
    if errors:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "errors.log"), "w") as f:
            f.write("\n\n".join(errors) + "\n")
    return results


def _checks(cells: List[Dict[str, Any]], tol: float) -> List[Dict[str, Any]]:
    """Per non-eager backend that ran: first losses within ``tol`` of eager's, the final loss within
    5%, and (fxopt) no fallback. Each bound is at least the row's rounding spread: the largest
    distance from eager of eager's rounding references (eager with every gradient perturbed by one
    rounding of the precision, per seed) and of ``eager-channels-last`` where it ran (other cuDNN
    kernels, other rounding). Training amplifies rounding at every optimizer step, so a curve that
    differs from eager's only in rounding lands anywhere inside that spread; ``tol`` in a check
    says which bound applied."""
    spread: Dict[tuple, tuple] = {}  # row -> largest reference distance from eager (first losses, final loss)

    def widen(key, c):
        first, final = spread.get(key, (0.0, 0.0))
        spread[key] = (max(first, c.get("losses_max_rel_diff") or 0.0), max(final, c.get("final_loss_rel_diff") or 0.0))

    for c in cells:
        key = (c["model"], c["batch"], c["dtype"])
        if c["backend"] == "eager-channels-last" and c["status"] == "ok":
            widen(key, c)
        for ref in c.get("rounding_references") or []:
            if ref["status"] == "ok":
                widen(key, ref)
    out = []
    for c in cells:
        if c["backend"] == "eager" or c["status"] == "skipped":
            continue
        if c["backend"] == "eager-channels-last" and c["status"] != "ok":
            continue  # a reference, not a compiler under test (a model may not run in channels_last)
        chk = {k: c[k] for k in ("model", "batch", "dtype", "backend")}
        first_spread, final_spread = spread.get((c["model"], c["batch"], c["dtype"]), (0.0, 0.0))
        row_tol = max(tol, first_spread)
        chk["tol"] = row_tol
        problems = []
        if c["status"] != "ok":
            problems.append(f"did not run: {c.get('error')}")
        elif c.get("losses_max_rel_diff") is None:
            problems.append("no loss comparison (eager did not run)")
        elif not c["losses_max_rel_diff"] <= row_tol:
            problems.append(f"losses differ from eager's by {c['losses_max_rel_diff']:.3g} > {row_tol:g}")
        final_tol = max(c.get("final_loss_tol") or 0.0, final_spread)
        if c.get("final_loss_rel_diff") is not None:
            chk["final_tol"] = final_tol
        if c.get("final_loss_rel_diff") is not None and not c["final_loss_rel_diff"] <= final_tol:
            problems.append(f"final loss {c['final_loss']:.4f} vs eager {c['eager_final_loss']:.4f}")
        if (c.get("fxopt") or {}).get("fallbacks") or c.get("fallback"):
            problems.append(f"fxopt fell back: {((c.get('fxopt') or {}).get('fallbacks') or [c.get('fallback')])[0]}")
        chk["ok"] = not problems
        if problems:
            chk["reason"] = "; ".join(problems)
        out.append(chk)
    return out


# ---- reports ------------------------------------------------------------------------
def _f(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "–"
    try:
        return format(v, spec)
    except (TypeError, ValueError):
        return str(v)


def _precision(amp: str) -> str:
    return {"float16": "autocast float16 + GradScaler", "bfloat16": "autocast bfloat16, no GradScaler",
            "none": "float32 (no autocast)"}[amp]


def render_markdown(results: Dict[str, Any], summary_only: bool = False) -> str:
    from fxopt.testing.training import FINAL_LOSS_STEPS

    from .report import _cell_text, _failed_checks, _is_fxopt, speedups

    m, cfg = results["meta"], results["meta"]["config"]
    v = m.get("versions", {})
    dev = m.get("device_name", "?") + (f" (compute capability {m['capability']})" if m.get("capability") else "")
    lines = ["# fxopt training benchmark", ""]
    if m.get("device_type") == "cpu":
        lines += ["> **CPU run — not a GPU performance result.**", ""]
    timer = "CUDA events around each step" if m.get("device_type") == "cuda" else "time.perf_counter around each step"
    amp = cfg["amp"]
    loop = _precision(amp) + \
        f", Adam (lr {cfg['lr']}), cross-entropy"
    lines += [f"- device: {dev}, `{m.get('device_type')}`",
              "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
              *([f"- {len(m['runs'])} runs on this device (merged):"]
                + [f"  - {r.get('date', '?')}: `{r.get('command', '?')}`" for r in m["runs"]]
                if len(m.get("runs") or []) > 1 else [f"- date: {m.get('date')}", f"- command: `{m.get('command')}`"]),
              f"- step: zero_grad, forward + loss, backward, optimizer step ({loop}); same initial weights and "
              f"the same {cfg['data_batches']} batches (cycled) for every backend"
              + (f"; ImageNet models at {cfg['image_size']}x{cfg['image_size']}" if cfg.get("image_size") else ""),
              f"- timing: median ms per step over {cfg['iters']} steps after the first step and {cfg['warmup']} "
              f"warm-up steps" + (f", in {cfg['rounds']} rounds, the backends of a row taking turns (each round after "
                                  f"{cfg.get('rewarm')} untimed steps)" if cfg["rounds"] > 1 else "") + f" ({timer}); ± is the IQR"
              + ("; cudnn.benchmark on for every backend" if m.get("cudnn.benchmark") else ""),
              f"- losses: the first {cfg['losses']} against eager's (max relative difference, tolerance "
              f"{m.get('loss_tolerance')})" + (f"; final loss: a second training from the initial weights, "
                                               f"{cfg['final_steps']} steps of a learning task (fresh batches, labels "
                                               f"from a fixed rule), mean loss of the last {FINAL_LOSS_STEPS} steps"
                                               + (f", averaged over {cfg['final_tasks']} such trainings (one task "
                                                  f"each)" if (cfg.get('final_tasks') or 1) > 1 else "")
                                               + " within 5% of eager's"
                                               if cfg.get("final_steps") else "")
              + "; each bound is at least the row's rounding spread: the largest distance from eager of "
                f"{cfg.get('rounding_references', 0)} runs of eager with every gradient perturbed by one rounding of "
                "the precision (one seed each) and of eager-channels-last where it ran; each step starts from the "
                "same seed for every backend",
              ""]
    if m.get("fxopt_options"):
        lines.insert(-1, f"- fxopt options: `{json.dumps(m['fxopt_options'])}`")
    cells = results.get("cells", [])
    backends = list(dict.fromkeys(c["backend"] for c in cells))
    fx = [b for b in backends if _is_fxopt(b)]
    bad = _failed_checks(results)
    sp = speedups(results)
    head = ["model", "batch", "precision"] + [f"{b} ms" for b in backends] + ["best peer"] + \
           [f"{b} vs eager" for b in fx] + [f"{b} vs best peer (paired)" for b in fx]
    lines += ["## Step time", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows: Dict[tuple, Dict[str, Dict[str, Any]]] = {}
    for c in cells:
        rows.setdefault((c["model"], int(c["batch"]), c["dtype"]), {})[c["backend"]] = c
    for key, by in rows.items():
        s = sp.get(key, {})
        vals = [key[0], str(key[1]), key[2]] + [_cell_text(by.get(b), (*key, b) in bad) for b in backends]
        vals.append(f"{s['best_peer']} ({s['best_peer_ms']:.3f})" if s.get("best_peer") else "–")
        for b in fx:
            e, f = by.get("eager", {}), by.get(b, {})
            vals.append(f"{f['median_ms'] / e['median_ms']:.2f}×" if e.get("median_ms") and f.get("median_ms")
                        else "–")
        for b in fx:
            o = s.get("fxopt", {}).get(b, {})
            paired = o.get("paired_over_best")
            vals.append((f"{1 / o['over_best']:.2f}×" if o.get("over_best") else "–")
                        + (f" ({1 / paired:.2f}×)" if paired else ""))
        lines.append("| " + " | ".join(vals) + " |")
    lines += ["", "fxopt vs X = fxopt's step time / X's (<1: fxopt faster); (paired) = the median over rounds of "
              "the ratio of the two backends' round medians (the backends of a row take turns, round by round); "
              "⚠ = failed a check.", ""]
    if summary_only:
        return "\n".join(lines) + "\n"
    checks = results.get("checks", [])
    failed = [c for c in checks if not c.get("ok")]
    lines += ["## Checks", "", f"{len(checks) - len(failed)}/{len(checks)} passed."]
    lines += [f"- FAILED {c['model']} b{c['batch']} {c['dtype']} {c['backend']}: {c.get('reason')}" for c in failed]
    spreads = [c for c in cells if c.get("rounding_references")]
    if spreads:
        lines += ["", "Rounding spread per row (relative distance from eager's: first losses, and final loss where "
                  "measured): eager with gradients perturbed by one rounding (per seed), eager-channels-last, and "
                  "the bound that applied."]
        for c in spreads:
            key = (c["model"], c["batch"], c["dtype"])
            cl = next((x for x in cells if (x["model"], x["batch"], x["dtype"]) == key
                       and x["backend"] == "eager-channels-last" and x.get("status") == "ok"), None)
            chk = next((x for x in checks if (x["model"], x["batch"], x["dtype"]) == key), {})
            for what, k, bound in (("first losses", "losses_max_rel_diff", "tol"),
                                   ("final loss", "final_loss_rel_diff", "final_tol")):
                if all(r.get(k) is None for r in c["rounding_references"]):
                    continue
                lines.append(f"- {c['model']} b{c['batch']}, {what}: " + ", ".join(
                    _f(r.get(k), ".3g") for r in c["rounding_references"])
                    + (f"; eager-channels-last {_f(cl.get(k), '.3g')}" if cl else "")
                    + (f"; bound {_f(chk[bound], '.3g')}" if chk.get(bound) is not None else ""))
            if c.get("eager_mean_final_loss") is not None:
                others = [x for x in cells if (x["model"], x["batch"], x["dtype"]) == key
                          and x.get("final_loss_rel_diff_eager_mean") is not None]
                lines.append(f"- {c['model']} b{c['batch']}, final loss against eager's mean over its "
                             f"{c['eager_final_trainings']} trainings (its own and the references', "
                             f"{c['eager_mean_final_loss']:.4f}): eager's trainings "
                             + ", ".join(_f(d, ".3g") for d in c["eager_trainings_rel_diff"]) + "; "
                             + ", ".join(f"{x['backend']} {_f(x['final_loss_rel_diff_eager_mean'], '.3g')}"
                                         for x in others))
    lines += ["", "## Where a step's time goes", "",
              "| model | batch | backend | median ms | first step s | fxopt compile s | kernels/step | "
              "GPU kernel ms/step | GPU idle ms/step | host ms/step | peak mem MiB (compile / step) | "
              "losses max rel diff | final loss (eager) |", "|" + "---|" * 13]
    for c in cells:
        idle = (c["median_ms"] - c["gpu_kernel_ms"]) if c.get("median_ms") and c.get("gpu_kernel_ms") else None
        final = (f"{c['final_loss']:.4f}" + (f" ({c['eager_final_loss']:.4f})" if c.get("eager_final_loss") else "")
                 if c.get("final_loss") is not None else "–")
        lines.append("| " + " | ".join([
            c["model"], str(c["batch"]), c["backend"],
            _f(c.get("median_ms")) if c.get("status") == "ok" else f"{c.get('status')}: {c.get('error') or ''}"[:60],
            _f(c.get("first_step_s"), ".2f"), _f(c.get("fxopt_compile_s"), ".2f"),
            _f(c.get("kernels_per_step"), ".0f"), _f(c.get("gpu_kernel_ms")), _f(idle), _f(c.get("host_ms")),
            f"{_f(c.get('peak_mem_mb'), '.0f')} / {_f(c.get('step_peak_mem_mb'), '.0f')}",
            _f(c.get("losses_max_rel_diff"), ".2e"), final]) + " |")
    lines += ["", "GPU kernel ms = kernel time per step under torch.profiler; GPU idle = median − kernel time "
              "(the GPU waiting for the host); host ms = CPU time of a step outside waits for the GPU, under "
              "the profiler (an upper bound). first step = compile + one step (each backend first trained a tiny "
              "model for one step, outside the rows: one-time process costs are not counted).", ""]
    fxc = [c for c in cells if c.get("fxopt")]
    if fxc:
        lines += ["## fxopt's training graphs", "",
                  "| model | batch | backend | graphs | partitioner | saved activations (MiB) | executor | "
                  "CUDA graphs | fallbacks |", "|" + "---|" * 9]
        for c in fxc:
            g = c["fxopt"]
            kinds = ", ".join(f"{g['graphs'].count(k)} {k}" for k in dict.fromkeys(g["graphs"]))
            lines.append("| " + " | ".join([
                c["model"], str(c["batch"]), c["backend"], kinds, ", ".join(g["partitioner"]),
                f"{g['saved_activations']} ({g['saved_activation_mb']:.1f})", ", ".join(g["executors"]),
                "; ".join(g["cudagraphs"]), "; ".join(g["fallbacks"]) or "none"]) + " |")
        lines += ["", "CUDA graphs in training (`backends/cuda/runtime/cudagraphs.py`): the forward and the backward "
                  "are each captured per input signature; the values the forward saves for backward are lent to "
                  "autograd and read in place by the backward's capture, parameters are read where they live, the "
                  "batch and the incoming gradient are copied into static buffers.", ""]
    return "\n".join(lines) + "\n"


def write_reports(results: Dict[str, Any], out_dir: str) -> Dict[str, str]:
    from .report import write_json, write_plot

    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": write_json(results, os.path.join(out_dir, "results.json"))}
    for name, summary in (("results.md", False), ("summary.md", True)):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(render_markdown(results, summary_only=summary))
        paths[name] = os.path.join(out_dir, name)
    try:
        paths["png"] = write_plot(results, os.path.join(out_dir, "speedup.png"))
    except Exception as exc:  # noqa: BLE001 - a broken matplotlib must not lose the numbers
        paths["png_error"] = f"{type(exc).__name__}: {exc}"
    return paths


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = parse_args(argv)
    if a.merge:
        from .report import merge_results

        parts = []
        for path in a.merge:
            with open(path) as f:
                parts.append(json.load(f))
        paths = write_reports(merge_results(parts), a.out)
        print(f"merged {len(parts)} runs into {', '.join(v for k, v in paths.items() if not k.endswith('_error'))}",
              file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    results = run_training_benchmark(a, argv)
    results["meta"]["wall_s"] = round(time.perf_counter() - t0, 2)
    paths = write_reports(results, a.out)
    print(f"wrote {', '.join(v for k, v in paths.items() if not k.endswith('_error'))} in "
          f"{results['meta']['wall_s']:.1f} s", file=sys.stderr)
    failed = [c for c in results["checks"] if not c.get("ok")]
    for c in failed:
        print(f"CHECK FAILED: {c['model']} b{c['batch']} {c['dtype']} {c['backend']}: {c.get('reason')}",
              file=sys.stderr)
    sys.stdout.write(render_markdown(results, summary_only=True))
    if results["meta"].get("interrupted"):
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
