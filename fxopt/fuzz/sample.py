"""A small sample of fuzzed graphs covering every kernel family, for the sanitizers
(``scripts/sanitize.sh``).

    python -m fxopt.fuzz.sample select --out sample.json [--per-family 1] [--max-draws 300]
    python -m fxopt.fuzz.sample run sample.json [--shared-only] [--device cuda] [--time-budget S]

``select`` draws programs (hypothesis, a fixed seed) and plans each with the cuda executor on CPU
tensors (``fxopt.explain``: the kernels are generated, nothing runs on a GPU) until every kernel
family of ``coverage.FAMILIES`` has ``--per-family`` programs or the draws are spent; each program
records whether one of its kernels uses shared memory or warp shuffles (what racecheck and
synccheck are for). Every family also gets ``--per-family`` such inference programs where the
draws reach one, for ``run --inference-only --shared-only`` (racecheck, which cannot run a training
step's cuBLAS products on an H200: ``scripts/sanitize.sh``). The sample is ordered so that its
first programs cover the most families;
the exit status is 3 where a family of ``FAMILIES`` (but those in ``coverage.NOT_LAUNCHED``) has no
program (the sample is written all the same).

``run`` runs the selected programs on the GPU through ``check.run_program`` (CUDA graphs off: the
sanitizers instrument launches), each compile measuring afresh (no autotuning cache: every
candidate kernel runs, under each tool) with one warm-up and two timed runs per candidate (the
choices do not matter here, the launches do: ``--full-timing`` keeps the usual counts). With
``--time-budget`` no program starts after that many seconds; the families of the programs left
out are named and the exit status is 1, as for a failing program.
"""
from __future__ import annotations

import argparse
import json
import sys

from .coverage import FAMILIES, NOT_LAUNCHED, kernel_family


def _plan(program) -> tuple:
    """(families, uses shared memory or shuffles) of ``program``'s kernels, planned on the CPU."""
    import fxopt

    from .check import build

    model, x = build(program, "cpu")
    opts = {**program.options, "executor": "cuda"}
    opts.pop("cudagraphs", None)
    training = program.mode == "training"
    report = fxopt.explain(model, x.detach().requires_grad_(training), options=opts, training=training)
    fams = {kernel_family(k.name) for k in report.kernels}
    fams |= {f"algorithm:{getattr(c, 'algorithm', c)}" for g in report.graphs for c in g.conv_algorithms.values()}
    shared = any("__shared__" in k.source or "__shfl" in k.source for k in report.kernels)
    return fams, shared


def select(per_family: int = 1, max_draws: int = 300, seed: int = 0, log=print) -> list:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from .graphs import programs

    chosen, counts, draws = [], {f: 0 for f in FAMILIES}, [0]
    inference = {f: 0 for f in FAMILIES}  # the same, over inference programs with shared memory or shuffles

    @hseed(seed)
    @settings(max_examples=max_draws, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(programs(max_batch=8, max_size=10, cudagraphs=(False,), executor="cuda"))
    def draw(program):
        if all(c >= per_family for c in counts.values()) and all(
                c >= per_family for f, c in inference.items() if f not in NOT_LAUNCHED):
            return  # (a family no inference program reaches draws on until the draws are spent)
        draws[0] += 1
        try:
            fams, shared = _plan(program)
        except Exception as e:  # noqa: BLE001 - a graph fxopt cannot plan is the fuzzer's business, not this sample's
            log(f"skipped ({type(e).__name__}: {str(e)[:120]})")
            return
        infer = program.mode == "inference" and shared  # what racecheck runs
        new = [f for f in fams if f in counts and (counts[f] < per_family or (infer and inference[f] < per_family))]
        if new:
            for f in fams & counts.keys():
                counts[f] += 1
                inference[f] += infer
            chosen.append({"program": program.to_json(), "families": sorted(fams), "shared": shared})
    draw()
    chosen = cover_order(chosen)
    log(f"{len(chosen)} programs from {draws[0]} draws; per family: {counts}")
    missing = [f for f, c in counts.items() if not c]
    if missing:
        log(f"never reached: {', '.join(missing)}")
    no_racecheck = [f for f, c in inference.items() if counts[f] and not c]
    if no_racecheck:
        log(f"no inference program with shared memory or shuffles: {', '.join(no_racecheck)}")
    return chosen


def cover_order(chosen: list) -> list:
    """The sample reordered greedily: each next program the one adding the most families not yet
    covered (ties: the sample's order), so that a run cut short covers the most families."""
    left, out, seen = list(chosen), [], set()
    while left:
        best = max(range(len(left)), key=lambda k: (len(set(left[k]["families"]) - seen), -k))
        seen |= set(left[best]["families"])
        out.append(left.pop(best))
    return out


def _quick_timing() -> None:
    """Measuring with one warm-up and two timed runs per candidate (every candidate still runs its
    check): under a sanitizer each launch costs 10-100x, and which candidate wins does not matter."""
    import fxopt.autotune as autotune

    full = autotune.time_ms

    def time_ms(fn, inputs, device_type, warmup=3, iters=10):
        return full(fn, inputs, device_type, min(warmup, 1), min(iters, 2))
    autotune.time_ms = time_ms


def _cuda_usable() -> bool:
    """Whether this process can still run CUDA work (a sticky error, such as an illegal address or a
    sanitizer's failure, ends it for the process)."""
    import torch

    try:
        return torch.zeros(1, device="cuda").add_(1).item() == 1.0
    except Exception:  # noqa: BLE001 - any error: unusable
        return False


def run(path: str, shared_only: bool = False, device: str = "cuda", log=print, time_budget: float | None = None,
        full_timing: bool = False, start_at: int = 0, inference_only: bool = False) -> int:
    """Run the sample's programs from ``start_at`` on; where one leaves the process unable to run
    CUDA work, the programs after it run in a fresh process (``--start``; a sanitizer follows it),
    so that one program's failure does not count as every later one's."""
    import subprocess
    import time

    from .check import run_program
    from .graphs import Program

    if not full_timing:
        _quick_timing()
    start, failed, ran, left = time.monotonic(), 0, 0, []
    entries = [e for e in json.loads(open(path).read()) if (e["shared"] or not shared_only)
               and (e["program"]["mode"] == "inference" or not inference_only)]
    for i, entry in enumerate(entries):
        if i < start_at:
            continue
        if time_budget is not None and time.monotonic() - start > time_budget:
            left.append(entry)
            continue
        program = Program.from_json(entry["program"])
        program.options["cudagraphs"] = False
        program.options["autotune_cache"] = False
        ran += 1
        try:
            run_program(program, device)
            log(f"[{i}] ok {entry['families']} ({time.monotonic() - start:.0f} s)")
        except Exception as e:  # noqa: BLE001 - every program runs; the failures are counted
            failed += 1
            log(f"[{i}] FAIL {type(e).__name__}: {str(e)[:300]}\n{program.source}")
            if device == "cuda" and i + 1 < len(entries) and not _cuda_usable():
                log(f"[{i}] left the process unable to run CUDA work: programs {i + 1}.. in a new process")
                cmd = [sys.executable, "-m", "fxopt.fuzz.sample", "run", path, "--start", str(i + 1),
                       "--device", device] + ["--shared-only"] * shared_only + ["--full-timing"] * full_timing
                cmd += ["--inference-only"] * inference_only
                if time_budget is not None:
                    cmd += ["--time-budget", str(max(0.0, time_budget - (time.monotonic() - start)))]
                subprocess.run(cmd, check=False)
                break
    done = {f for e in entries if e not in left for f in e["families"]}
    not_run = sorted({f for e in left for f in e["families"]} - done)
    log(f"ran {ran} of {len(entries)} programs in {time.monotonic() - start:.0f} s, {failed} failing"
        + (f"; out of time before {len(left)} programs (families not run: {', '.join(not_run) or 'none'})"
           if left else ""))
    return 1 if failed or left else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxopt.fuzz.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select")
    s.add_argument("--out", required=True)
    s.add_argument("--per-family", type=int, default=1)
    s.add_argument("--max-draws", type=int, default=300)
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("sample")
    r.add_argument("--shared-only", action="store_true")
    r.add_argument("--device", default="cuda")
    r.add_argument("--time-budget", type=float, default=None, help="start no program after SECONDS")
    r.add_argument("--full-timing", action="store_true", help="measure candidates with the usual run counts")
    r.add_argument("--start", type=int, default=0, help="the first program to run (0-based)")
    r.add_argument("--inference-only", action="store_true",
                   help="no training programs (racecheck: see scripts/sanitize.sh)")
    args = p.parse_args(argv)
    if args.cmd == "select":
        chosen = select(args.per_family, args.max_draws, args.seed)
        with open(args.out, "w") as f:
            json.dump(chosen, f, indent=1)
        reached = {f for e in chosen for f in e["families"]}
        missing = [f for f in FAMILIES if f not in reached and f not in NOT_LAUNCHED]
        return 1 if not chosen else (3 if missing else 0)  # 3: a sample without some family
    return run(args.sample, args.shared_only, args.device, time_budget=args.time_budget,
               full_timing=args.full_timing, start_at=args.start, inference_only=args.inference_only)


if __name__ == "__main__":
    sys.exit(main())
