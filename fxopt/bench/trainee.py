"""One backend's run in the training benchmark: :class:`Trainee` trains its own copy of the model
through the reference loop and keeps its losses and step times; ``_finish`` turns it into
the backend's cell (step-time statistics, its losses against eager's, what fxopt compiled).
Also the step profile under ``torch.profiler`` and the guard that turns a failing phase into a
failed cell. Used by ``fxopt.bench.train`` and ``fxopt.bench.ddp``."""
from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

from .train_peers import TRAIN_BACKENDS

__all__ = ["Trainee", "step_profile"]


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

    from .measure import time_calls

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


def _finish(t: Trainee, eager: Optional[Trainee], a, rounds: int) -> Dict[str, Any]:
    """The backend's cell: step time statistics, loss comparison, fxopt's graphs."""
    from fxopt.testing.training import FINAL_LOSS_STEPS, FINAL_LOSS_TOLERANCE, max_rel_diff

    from .measure import stats

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
