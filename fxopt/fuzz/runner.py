"""The fuzz loop: hypothesis draws ``Program``s, ``check.run_program`` runs each; a failure is
shrunk by hypothesis to a minimal program and written as a reproducer; coverage is counted.

Hypothesis's own search and shrinking run it (``@given`` called programmatically, a settings
object with a directory database under ``out``): one round runs until the examples or the time
budget are spent or a failure is found and shrunk; the fuzzer then writes its reproducer and starts
another round with the next seed, so that one bug does not end the run. ``shard i/n`` derives the
seeds of shard ``i`` (so shards draw different graphs) and writes under ``out/shard-i-of-n``;
``merge`` adds the shards' coverage and failures up; ``parallel.run_jobs`` runs the shards as
processes at once (``fxopt fuzz --jobs N``). With ``progress`` seconds, one ``progress`` line
(examples run, passed, failing programs, seconds) is logged at most that often.
"""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

from .coverage import Coverage

#: executors each device runs (the cuda executor on the CPU: its CPU-checkable part)
EXECUTORS = {"cpu": ("cpu", "torch", "cuda"), "cuda": ("cuda",)}


#: most seconds spent shrinking a failure found once the budget is spent (at most half the budget)
SHRINK_SECONDS = 90.0


class _BudgetSpent(BaseException):
    """Raised inside the test once the time budget is spent: not a failure, hypothesis lets it through."""


class _Poisoned(BaseException):
    """Raised inside the test after a failure that left the process unusable (``process_ok``)."""


def process_ok(device: str) -> bool:
    """Whether this process still runs CUDA work correctly: no stream left capturing, the default
    generator draws (not held by a capture that never ended), a kernel runs and synchronizes."""
    if device != "cuda":
        return True
    import torch

    try:
        if torch.cuda.is_current_stream_capturing():
            return False
        total = (torch.rand(256, device="cuda") * 2).sum().item()
        torch.cuda.synchronize()
        return 0.0 <= total <= 512.0
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False


def _strategy(device: str, executors, max_batch: int, max_size: int, max_layers: int, dtypes, modes):
    from hypothesis import strategies as st

    from .graphs import ALGORITHMS, FUZZ_KINDS, programs

    def one(executor):
        cudagraphs = (None, False, True) if device == "cuda" else (None,)
        ex_modes = tuple(m for m in modes if not (executor == "cpu" and m == "training"))
        return programs(dtypes=dtypes, modes=ex_modes or ("inference",), max_layers=max_layers, max_batch=max_batch,
                        max_size=max_size, algorithms=ALGORITHMS, cudagraphs=cudagraphs, executor=executor,
                        kinds=FUZZ_KINDS)
    return st.one_of([one(e) for e in executors]).map(_fuzz_options)


def _fuzz_options(program):
    # every graph measures its candidates afresh (in memory): no choice reused from an earlier graph
    # or run, no autotuning file rewritten at every entry, no compile-cache entry written per graph,
    # and a reproducer does not depend on the cache of the machine it runs on
    program.options.setdefault("autotune_cache", False)
    if program.options.get("executor") == "cpu":
        program.options.setdefault("cpu_onnxruntime", False)  # timing ONNX Runtime sessions: seconds a graph
    return program


def _keep_unshrunk(program, message: str, out_dir: Path, device: str, graphs: list) -> None:
    """The failing program as drawn, written at once (``out/shard-i-of-n/unshrunk/``): shrinking may
    outlast what the caller allows (a device time limit kills the process), and the shrunk
    reproducer is written only when shrinking ends."""
    from .check import tolerance_for
    from .repro import write_repro

    try:
        write_repro(program, message, out_dir, device, tolerance_for(program, device, graphs))
    except Exception as e:  # noqa: BLE001 - keeping it is a courtesy; the search goes on
        print(f"fxopt fuzz: could not write the unshrunk reproducer: {type(e).__name__}: {e}")


def run_fuzz(device: str = "cpu", examples: int = 100, seed: int = 0, time_budget: float | None = None,
             out="fuzz-out", shard: tuple = (0, 1), executors=None, max_batch: int | None = None,
             max_size: int = 12, max_layers: int = 5, dtypes=("float32", "float16", "bfloat16"),
             modes=("inference", "training"), log=print, progress: float | None = None, restart: int = 0) -> dict:
    """Fuzz ``examples`` graphs (this shard's share) on ``device``; returns the summary written to
    ``out/shard-i-of-n/summary.json`` (``restart`` K > 0: ``.../restart-K/summary.json``, other
    seeds). A failure found is shrunk for at most ``SHRINK_SECONDS`` (and half the budget) past the
    time budget, its program as drawn written at once to ``.../unshrunk/``; one that leaves the
    process unusable ends the shard (``summary["poisoned"]``)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.database import DirectoryBasedExampleDatabase

    from .check import run_program, tolerance_for
    from .repro import write_repro

    i, n = shard
    out_dir = Path(out) / f"shard-{i}-of-{n}"
    out_dir = out_dir / f"restart-{restart}" if restart else out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    share = examples // n + (1 if i < examples % n else 0)
    executors = tuple(executors or EXECUTORS[device])
    strategy = _strategy(device, executors, max_batch or (64 if device == "cuda" else 8), max_size, max_layers,
                         tuple(dtypes), tuple(modes))
    cov, failures = Coverage(), []
    start = time.monotonic()
    state = {"ran": 0, "failed": None, "said": start, "poisoned": None}
    extra = 0.0 if time_budget is None else min(SHRINK_SECONDS, 0.5 * time_budget)

    def test(program):
        now = time.monotonic()
        if time_budget is not None:  # a failure being shrunk gets some more time
            if now - start > time_budget + (extra if state["failed"] else 0.0):
                raise _BudgetSpent
        if progress is not None and now - state["said"] >= progress:
            state["said"] = now
            log(f"progress {i}/{n}: {state['ran']}/{share} examples, {cov.graphs} passed, {len(failures)} failing "
                f"programs{', shrinking one' if state['failed'] else ''}, {now - start:.0f} s")
        state["ran"] += 1
        state["graphs"], outcome = [], {}
        shrinking = state["failed"] is not None  # after a round's first failure hypothesis only shrinks it
        cov.shrink_runs += shrinking
        try:
            graphs = run_program(program, device, state["graphs"], outcome=outcome)
        except Exception as e:
            if state["failed"] is None:  # as drawn, before shrinking: kept should the process be killed meanwhile
                _keep_unshrunk(program, f"{type(e).__name__}: {e}", out_dir / "unshrunk", device, state["graphs"])
            state["failed"] = (program, f"{type(e).__name__}: {e}", traceback.format_exc())
            cov.shrink_failed += shrinking
            if not process_ok(device):
                state["poisoned"] = state["failed"]
                raise _Poisoned from e
            raise
        if not shrinking:  # the coverage of the search: shrinking's small programs would swamp it
            cov.add(program, graphs, eager_error=outcome.get("eager_error"), upstream=outcome.get("upstream"),
                    eager_overflow=outcome.get("eager_overflow"))

    db = DirectoryBasedExampleDatabase(str(out_dir / "hypothesis-db"))
    rnd = 0
    while state["ran"] < share:
        cfg = settings(max_examples=share - state["ran"], database=db, deadline=None, derandomize=False,
                       suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
                       report_multiple_bugs=False, print_blob=True)
        fn = hseed(seed * 7919 + i * 104729 + rnd + 1_000_003 * restart)(settings(cfg)(given(strategy)(test)))
        state["failed"] = None
        try:
            fn()
            break
        except (_BudgetSpent, _Poisoned, Exception) as e:  # noqa: BLE001 - the shrunk failure: its reproducer, then the next round
            if isinstance(e, _BudgetSpent) and state["failed"] is None:
                break
            # (out of time while shrinking: the smallest failing program so far; a poisoning one as drawn)
            program, message, tb = (state["poisoned"] or state["failed"]
                                    or (None, f"{type(e).__name__}: {e}", traceback.format_exc()))
            if state["poisoned"] is not None:
                message = f"{message} [left the process unable to run CUDA work: not shrunk, shard ended]"
            entry = {"error": message[:2000], "traceback": tb[-4000:], "poisoned": state["poisoned"] is not None}
            if program is not None:
                tol = tolerance_for(program, device, state.get("graphs", []))
                path = write_repro(program, message, out_dir, device, tol)
                entry.update(repro=str(path), program=program.to_json())
                log(f"FAIL ({message.splitlines()[0][:200]}): reproducer {path}")
            failures.append(entry)
            rnd += 1
            if state["poisoned"] is not None:
                break
        if time_budget is not None and time.monotonic() - start > time_budget:
            break
    cov.failures = len(failures)
    summary = {"device": device, "shard": [i, n], "seed": seed, "examples": share, "ran": state["ran"],
               "seconds": round(time.monotonic() - start, 1), "coverage": cov.to_json(), "failures": failures,
               "failing_programs": len(failures), "searched": cov.graphs, "shrink_runs": cov.shrink_runs,
               "poisoned": state["poisoned"] is not None, "restart": restart}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    cov.write(out_dir / "coverage.json")
    log(cov.table())
    log(f"{state['ran']} examples in {summary['seconds']} s: {cov.graphs} programs passed, {len(failures)} failing "
        f"programs (reproducers), {cov.shrink_runs} examples run while shrinking; {out_dir}")
    return summary


def merge(dirs, out=None, log=print) -> dict:
    """Add up the summaries (``summary.json``, searched recursively) under ``dirs``."""
    cov, failures, ran, found = Coverage(), [], 0, []
    for d in dirs:
        for path in sorted(Path(d).rglob("summary.json")):
            s = json.loads(path.read_text())
            cov.merge(Coverage.from_json(s["coverage"]))
            failures += s["failures"]
            ran += s["ran"]
            found.append(str(path))
    merged = {"shards": found, "ran": ran, "coverage": cov.to_json(), "failures": failures}
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "merged.json").write_text(json.dumps(merged, indent=1, sort_keys=True))
    log(cov.table())
    log(f"{len(found)} shards, {ran} examples, {cov.graphs} programs passed, {len(failures)} failing programs")
    for f in failures:
        log(f"  {f.get('repro', '-')}: {f['error'].splitlines()[0][:200] if f['error'] else ''}")
    return merged
