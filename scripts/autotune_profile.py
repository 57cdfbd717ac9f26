"""Where a cold compile's autotuning time goes, and what the cost model would have pruned (GPU machine).

    FXOPT_CACHE_DIR=$(mktemp -d) python3 scripts/autotune_profile.py resnet50 --dtype float16 --batch 1

Compiles one model with fxopt in this process (use an empty ``FXOPT_CACHE_DIR`` so that every
choice is measured) and wraps, for this run only, the measuring functions of the
``select_conv_algorithm`` pass and of the CUDA executor to time them (with a synchronize around
each, so the figures are wall time of the GPU work too). Prints per convolution the measured
candidates next to the cost model's estimates, then the time by step (float64 reference,
``prepare``/``run`` of each algorithm, the timing loops) and, for pruning factors F, how many
candidates an "estimate > F x the best estimate" rule would have skipped and which measured
winners it would have lost. ``--json PATH`` writes the records.
"""
import argparse
import collections
import json
import math
import time

import torch

from fxopt.bench.models import build_model, make_input
from fxopt.testing import compile_with_fxopt

STEPS = collections.defaultdict(float)
COUNTS = collections.Counter()
ACTIVE = [False]  # only inside the conv pass's measuring (not at capture time, where a sync is illegal)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(label_fn, fn):
    def wrapper(*args, **kwargs):
        if not ACTIVE[0]:
            return fn(*args, **kwargs)
        sync()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            label = label_fn(*args, **kwargs)
            STEPS[label] += time.perf_counter() - t0
            COUNTS[label] += 1
    return wrapper


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--dtype", default="float16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", default="")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--options", default="{}", help="fxopt options as JSON")
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    import fxopt.autotune as autotune
    import fxopt.backends.cuda.runtime.measure as exec_measure
    import fxopt.passes.select_conv_algorithm as sca
    from fxopt.backends.conv_algorithms import ALGORITHMS

    seen_run: set = set()

    for name, algo in ALGORITHMS.items():
        def run_label(x, weight, prepacked, bias, sig, _n=name):
            if sig.dtype == torch.float64:
                return "reference float64 (direct)"
            first = (_n, sig) not in seen_run
            seen_run.add((_n, sig))
            return f"{_n}.run ({'first' if first else 'again'})"
        algo.run = timed(run_label, algo.run)
        algo.prepare = timed(lambda weight, sig, _n=name: f"{_n}.prepare", algo.prepare)

    autotune.time_ms = timed(lambda *a, **k: "timing loops (conv algorithms)", autotune.time_ms)
    records = []
    inner = sca.measure

    def measure(sig, batch, candidates, device):
        t0 = time.perf_counter()
        ACTIVE[0] = True
        try:
            choice = inner(sig, batch, candidates, device)
        finally:
            ACTIVE[0] = False
        est = {n: ALGORITHMS[n].estimate_ms(sig, batch) for n in candidates}
        records.append({"sig": f"x={sig.x_shape} w={sig.w_shape} s={sig.stride} p={sig.padding} g={sig.groups} "
                               f"{'NHWC' if sig.channels_last else 'NCHW'}", "batch": batch,
                        "measured": choice.candidates, "estimate": est, "chosen": choice.algorithm,
                        "rejected": choice.rejected, "wall_s": time.perf_counter() - t0})
        return choice
    sca.measure = measure
    node_records = []
    inner_node = exec_measure.measure

    def node_measure(node, candidates, graphed):
        t0 = time.perf_counter()
        r = inner_node(node, candidates, graphed)
        node_records.append({"node": node.name, "candidates": sorted(candidates), "ms": r["ms"],
                             "choice": r["choice"], "wall_s": time.perf_counter() - t0})
        return r
    exec_measure.measure = node_measure

    dtype = getattr(torch, a.dtype)
    model, shape = build_model(a.model)
    model = model.eval().to(device=a.device, dtype=dtype)
    x = make_input(shape, a.batch).to(device=a.device, dtype=dtype)
    torch.ones(1, device=a.device).add_(1)
    graphs: list = []
    fn = compile_with_fxopt(model, json.loads(a.options), graphs)
    with torch.no_grad():
        t0 = time.perf_counter()
        fn(x)
        sync()
        first = time.perf_counter() - t0
    print(f"{a.model} {a.dtype} b{a.batch}: first call {first:.2f} s")
    for g in graphs:
        for r in g.passes:
            print(f"  {r.name:24s} {r.ms:8.1f} ms")
        for k, v in g.executor_details.items():
            if k.endswith("_s"):
                print(f"  {k:24s} {v}")
    print("\nconvolutions measured (ms; estimate in brackets):")
    for r in records:
        cells = " ".join(f"{n}={'-' if r['measured'].get(n) is None else format(r['measured'][n], '.3f')}"
                         f"[{r['estimate'][n]:.3f}]" for n in r["estimate"])
        print(f"  {r['sig']} -> {r['chosen']}  {cells}  ({r['wall_s'] * 1e3:.0f} ms)")
    print(f"  total {sum(r['wall_s'] for r in records):.2f} s over {len(records)} convolutions")
    print("\nexecutor nodes measured:")
    for r in node_records:
        print(f"  {r['node']}: {r['choice']} of {len(r['candidates'])} "
              f"({r['wall_s'] * 1e3:.0f} ms) {', '.join(f'{k}={v:.4f}' for k, v in sorted(r['ms'].items(), key=lambda kv: kv[1]))}")
    print(f"  total {sum(r['wall_s'] for r in node_records):.2f} s over {len(node_records)} nodes")
    print("\nsteps (wall s, calls):")
    for label, s in sorted(STEPS.items(), key=lambda kv: -kv[1]):
        print(f"  {label:36s} {s:7.3f}  {COUNTS[label]}")
    print("\npruning rule 'estimate > F x best estimate' (direct always measured):")
    for f in (2, 4, 8, 16, 64):
        skipped, lost = 0, []
        for r in records:
            best = min(v for v in r["estimate"].values())
            keep = {n for n, v in r["estimate"].items() if n == "direct" or v <= f * best}
            skipped += len(r["estimate"]) - len(keep)
            if r["chosen"] not in keep:
                timed_ = {n: v for n, v in r["measured"].items() if v is not None and n in keep}
                lost.append(f"{r['sig']}: {r['chosen']} {r['measured'][r['chosen']]:.3f} -> "
                            f"{min(timed_.values()):.3f} ms")
        print(f"  F={f}: skips {skipped} of {sum(len(r['estimate']) for r in records)} candidates; "
              f"winners lost: {len(lost)}")
        for line in lost:
            print(f"      {line}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model": a.model, "dtype": a.dtype, "batch": a.batch, "first_call_s": first,
                       "convs": records, "nodes": node_records,
                       "steps": {k: [v, COUNTS[k]] for k, v in STEPS.items()}}, fh, indent=1,
                      default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))


if __name__ == "__main__":
    main()
