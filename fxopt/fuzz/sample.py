"""A small sample of fuzzed graphs covering every kernel family, for the sanitizers
(``scripts/sanitize.sh``).

    python -m fxopt.fuzz.sample select --out sample.json [--per-family 2] [--max-draws 300]
    python -m fxopt.fuzz.sample run sample.json [--shared-only] [--device cuda]

``select`` draws programs (hypothesis, a fixed seed) and plans each with the cuda executor on CPU
tensors (``fxopt.explain``: the kernels are generated, nothing runs on a GPU) until every kernel
family of ``coverage.FAMILIES`` has ``--per-family`` programs or the draws are spent; each program
records whether one of its kernels uses shared memory or warp shuffles (what racecheck and
synccheck are for). ``run`` runs the selected programs on the GPU through ``check.run_program``
(CUDA graphs off: the sanitizers instrument launches).
"""
from __future__ import annotations

import argparse
import json
import sys

from .coverage import FAMILIES, kernel_family


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


def select(per_family: int = 2, max_draws: int = 300, seed: int = 0, log=print) -> list:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    from .graphs import programs

    chosen, counts, draws = [], {f: 0 for f in FAMILIES}, [0]

    @hseed(seed)
    @settings(max_examples=max_draws, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(programs(max_batch=8, max_size=10, cudagraphs=(False,), executor="cuda"))
    def draw(program):
        if all(c >= per_family for c in counts.values()):
            return
        draws[0] += 1
        try:
            fams, shared = _plan(program)
        except Exception as e:  # noqa: BLE001 - a graph fxopt cannot plan is the fuzzer's business, not this sample's
            log(f"skipped ({type(e).__name__}: {str(e)[:120]})")
            return
        new = [f for f in fams if f in counts and counts[f] < per_family]
        if new:
            for f in fams & counts.keys():
                counts[f] += 1
            chosen.append({"program": program.to_json(), "families": sorted(fams), "shared": shared})
    draw()
    log(f"{len(chosen)} programs from {draws[0]} draws; per family: {counts}")
    missing = [f for f, c in counts.items() if not c]
    if missing:
        log(f"never reached: {', '.join(missing)}")
    return chosen


def run(path: str, shared_only: bool = False, device: str = "cuda", log=print) -> int:
    from .check import run_program
    from .graphs import Program

    failed = 0
    for i, entry in enumerate(json.loads(open(path).read())):
        if shared_only and not entry["shared"]:
            continue
        program = Program.from_json(entry["program"])
        program.options["cudagraphs"] = False
        try:
            run_program(program, device)
            log(f"[{i}] ok {entry['families']}")
        except Exception as e:  # noqa: BLE001 - every program runs; the failures are counted
            failed += 1
            log(f"[{i}] FAIL {type(e).__name__}: {str(e)[:300]}\n{program.source}")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxopt.fuzz.sample", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("select")
    s.add_argument("--out", required=True)
    s.add_argument("--per-family", type=int, default=2)
    s.add_argument("--max-draws", type=int, default=300)
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("sample")
    r.add_argument("--shared-only", action="store_true")
    r.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    if args.cmd == "select":
        chosen = select(args.per_family, args.max_draws, args.seed)
        with open(args.out, "w") as f:
            json.dump(chosen, f, indent=1)
        return 0 if chosen else 1
    return run(args.sample, args.shared_only, args.device)


if __name__ == "__main__":
    sys.exit(main())
