"""``fxopt fuzz --jobs N``: the N shards of one run as N processes at once, then their merge.

Each shard is ``fxopt fuzz --shard i/N`` (``python -m fxopt.cli``) with the run's own arguments,
so it draws the graphs that ``--shard i/N`` run alone would (the same seeds) and writes under
``out/shard-i-of-N`` (its own hypothesis database, summary, coverage and reproducers). A shard's
whole output goes to ``out/shard-i-of-N/log.txt``; its ``progress`` lines (one at most every
``progress`` seconds), ``FAIL`` lines and final line are echoed here, prefixed with the shard.

Every process gets ``threads`` CPU threads (torch's intra-op pool, OpenMP and MKL; default: the
machine's cores shared out among the jobs), so that N processes beside one GPU do not each start a
thread per core. The NVRTC compiles take no lock between the processes: the kernels' disk cache
(``FXOPT_CACHE_DIR``, shared) is written atomically (a temporary file renamed into place) and a
file is used only where its checksum holds, so two shards compiling one kernel at once both write
a whole file and either wins.

A shard whose process a failure left unable to run CUDA work (its summary says ``poisoned``) is
started again in a new process (``--restart K``: other seeds, output under
``out/shard-i-of-N/restart-K``) with the time left of the run's budget, at most ``MAX_RESTARTS``
times.

At the end the N summaries are merged (``runner.merge``: the coverage table, ``out/merged.json``);
the exit status is 1 where a program failed or a shard ended without writing its summary.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from .runner import merge

#: how often one shard is started again after its process was left unusable
MAX_RESTARTS = 8
#: seconds of the budget a restarted shard needs at least to be worth starting
MIN_RESTART_S = 20.0

#: lines of a shard's output echoed by the parent (the rest stays in the shard's log.txt)
_ECHO = re.compile(r"^(progress |FAIL |\d+ examples in )")


def default_threads(jobs: int) -> int:
    """CPU threads per process: the cores shared out among ``jobs`` processes, at least one."""
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def shard_command(i: int, jobs: int, args: list, threads: int, progress: float) -> list:
    """The command line of shard ``i`` of ``jobs``; ``args``: the run's fuzz arguments (no --shard)."""
    return [sys.executable, "-m", "fxopt.cli", "fuzz", *args, "--shard", f"{i}/{jobs}", "--threads", str(threads),
            "--progress", f"{progress:g}"]


def _relay(i: int, jobs: int, proc: subprocess.Popen, log_path: Path, lock: threading.Lock, log) -> None:
    with open(log_path, "a") as f:
        for line in proc.stdout:
            f.write(line)
            f.flush()
            if _ECHO.match(line):
                with lock:
                    log(f"[shard {i}/{jobs}] {line.rstrip()}")


def _budget(args: list) -> float | None:
    return float(args[args.index("--time-budget") + 1]) if "--time-budget" in args else None


def _shard(i, jobs, args, threads, progress, env, d: Path, lock, log, procs: list, start: float,
           codes: dict) -> None:
    """Shard ``i``'s process, and its restarts while its summary says ``poisoned`` and time is left."""
    budget = _budget(args)
    for k in range(MAX_RESTARTS + 1):
        left = None if budget is None else budget - (time.monotonic() - start)
        if k and left is not None and left < MIN_RESTART_S:
            return
        run_args = list(args)
        if k:
            if left is not None:
                at = run_args.index("--time-budget")
                run_args[at + 1] = f"{left:.0f}"
            run_args += ["--restart", str(k)]
            with lock:
                log(f"[shard {i}/{jobs}] restart {k}: its process could not run CUDA work any more")
        p = subprocess.Popen(shard_command(i, jobs, run_args, threads, progress), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        with lock:
            procs.append(p)
        _relay(i, jobs, p, d / "log.txt", lock, log)
        codes.setdefault(i, p.wait())
        summary = (d / f"restart-{k}" if k else d) / "summary.json"
        try:
            poisoned = json.loads(summary.read_text()).get("poisoned", False)
        except (OSError, ValueError):
            return
        if not poisoned:
            return


def run_jobs(jobs: int, out, args: list, threads: int | None = None, progress: float = 30.0, log=print) -> int:
    """Run shards ``0/jobs`` .. ``jobs-1/jobs`` of ``fxopt fuzz <args>`` at once, writing under
    ``out``; merge their summaries; 0 where every shard passed, else 1."""
    out = Path(out)
    threads = threads or default_threads(jobs)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    lock, procs, dirs, codes = threading.Lock(), [], [], {}
    start = time.monotonic()
    log(f"{jobs} shards, {threads} CPU threads each, under {out}")
    main = threading.current_thread() is threading.main_thread()
    old_handler = signal.getsignal(signal.SIGTERM) if main else None
    if main:  # terminated: the shards started here end too (below)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for i in range(jobs):
            d = out / f"shard-{i}-of-{jobs}"
            d.mkdir(parents=True, exist_ok=True)
            for old in [d / "summary.json", *d.glob("restart-*/summary.json")]:
                old.unlink(missing_ok=True)  # an earlier run's summaries are not this run's
            (d / "log.txt").write_text("")
            dirs.append(d)
        workers = [threading.Thread(target=_shard, args=(i, jobs, args, threads, progress, env, dirs[i], lock, log,
                                                         procs, start, codes), daemon=True) for i in range(jobs)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        for p in procs:  # interrupted: the shards started here end with the run
            if p.poll() is None:
                p.terminate()
        if main and old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    missing = [i for i, d in enumerate(dirs) if not (d / "summary.json").exists()]
    merged = merge([d for d in dirs if (d / "summary.json").exists()], out=out, log=log)
    for i in missing:
        log(f"shard {i}/{jobs} ended without a summary (exit status {codes.get(i)}): {dirs[i] / 'log.txt'}")
    log(f"{jobs} shards in {time.monotonic() - start:.0f} s; merged: {out / 'merged.json'}")
    return 1 if merged["failures"] or missing else 0
