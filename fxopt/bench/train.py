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

This module holds the arguments and the run over the rows; one backend's run and its cell are in
``fxopt.bench.trainee``, the backends in ``fxopt.bench.train_peers``, the checks in
``fxopt.bench.train_checks`` and the report in ``fxopt.bench.train_report``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence

from fxopt.modelspec import csv_list

from .train_checks import _checks, _eager_mean_final, _rounding_references
from .train_peers import DEFAULT_BACKENDS, TRAIN_BACKENDS
from .train_report import render_markdown, write_reports
from .trainee import _graph_summary  # noqa: F401 - fxopt.bench.train._graph_summary, as before the split
from .trainee import Trainee, _fail, _finish, _guarded, _sync, step_profile

__all__ = ["TRAIN_BACKENDS", "build_parser", "main", "parse_args", "run_training_benchmark", "render_markdown"]

#: the training suite on CUDA: model name -> batch
CUDA_SUITE = {"seedcnn2": 32, "resnet18": 64, "resnet50": 64, "mobilenet_v2": 64}
#: on the CPU: small batches (and --image-size 64 for the ImageNet models)
CPU_SUITE = {"seedcnn2": 8, "resnet18": 4}
CPU_IMAGE_SIZE = 64

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
