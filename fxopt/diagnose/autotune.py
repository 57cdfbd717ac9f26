"""``fxopt diagnose autotune``: where a cold compile's autotuning goes, and what pruning would skip.

    FXOPT_CACHE_DIR=$(mktemp -d) fxopt diagnose autotune resnet50 --dtype float16 --device cuda

Compiles the model with fxopt in this process (an empty ``FXOPT_CACHE_DIR`` makes every choice
measured) and times, for this call only, the measuring of the ``select_conv_algorithm`` pass and
of the CUDA executor (synchronizing around each step, so the figures include the device's work).
Prints per convolution the measured candidates beside the cost model's estimates, per executor
node its candidates, the time by step (float64 reference, ``prepare``/``run`` of each algorithm,
the timing loops), and for pruning factors F how many candidates the rule "estimate > F x the best
estimate" (``conv_prune``) would skip and which measured winners it would lose. ``conv_algorithm``
is ``auto`` (measure) and ``conv_prune`` 0 (every legal candidate measured, so that the pruning
table is complete) unless ``--options`` say otherwise, on the CPU too. ``--json PATH`` writes the
records.
"""
from __future__ import annotations

import collections
import json
import math
import time

import torch

from fxopt.diagnose.timing import first_call_s, sync
from fxopt.modelspec import add_model_arguments, model_and_input, options_json

HELP = "where a cold compile's autotuning goes, and what pruning would skip"
FACTORS = (2, 4, 8, 16, 64)


def add_arguments(p) -> None:
    add_model_arguments(p, suite=True, device="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--options", type=options_json, default={}, help="fxopt options as JSON")
    p.add_argument("--json", metavar="PATH", help="write the records as JSON")


class Recorder:
    """Wraps the measuring functions for one compile and puts every original back afterwards."""

    def __init__(self, device: str):
        self.device = device
        self.steps: dict = collections.defaultdict(float)
        self.counts: collections.Counter = collections.Counter()
        self.convs: list = []
        self.nodes: list = []
        self.active = False  # only inside the conv pass's measuring (a sync is illegal during a capture)
        self._undo: list = []

    def patch(self, obj, name: str, value) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def restore(self) -> None:
        while self._undo:
            obj, name, value = self._undo.pop()
            setattr(obj, name, value)

    def timed(self, label_fn, fn):
        def wrapper(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                label = label_fn(*args, **kwargs)
                self.steps[label] += time.perf_counter() - t0
                self.counts[label] += 1
        return wrapper

    def install(self) -> None:
        import fxopt.autotune as autotune
        import fxopt.backends.cuda.runtime.measure as node_measure
        import fxopt.passes.select_conv_algorithm as sca
        from fxopt.conv_algorithms import ALGORITHMS

        seen_run: set = set()
        for name, algo in ALGORITHMS.items():
            def run_label(x, weight, prepacked, bias, sig, _n=name):
                if sig.dtype == torch.float64:
                    return "reference float64 (direct)"
                first = (_n, sig) not in seen_run
                seen_run.add((_n, sig))
                return f"{_n}.run ({'first' if first else 'again'})"
            self.patch(algo, "run", self.timed(run_label, algo.run))
            self.patch(algo, "prepare", self.timed(lambda weight, sig, _n=name: f"{_n}.prepare", algo.prepare))
        self.patch(autotune, "time_ms", self.timed(lambda *a, **k: "timing loops (conv algorithms)",
                                                   autotune.time_ms))
        inner_conv, inner_node = sca.measure, node_measure.measure

        def measure_conv(sig, batch, candidates, device):
            t0 = time.perf_counter()
            self.active = True
            try:
                choice = inner_conv(sig, batch, candidates, device)
            finally:
                self.active = False
            self.convs.append({
                "sig": f"x={sig.x_shape} w={sig.w_shape} s={sig.stride} p={sig.padding} g={sig.groups} "
                       f"{'NHWC' if sig.channels_last else 'NCHW'}", "batch": batch,
                "measured": choice.candidates, "chosen": choice.algorithm, "rejected": choice.rejected,
                "estimate": {n: ALGORITHMS[n].estimate_ms(sig, batch) for n in candidates},
                "wall_s": time.perf_counter() - t0})
            return choice

        def measure_node(node, candidates, graphed):
            t0 = time.perf_counter()
            r = inner_node(node, candidates, graphed)
            self.nodes.append({"node": node.name, "candidates": sorted(candidates), "ms": r["ms"],
                               "choice": r["choice"], "wall_s": time.perf_counter() - t0})
            return r

        self.patch(sca, "measure", measure_conv)
        self.patch(node_measure, "measure", measure_node)


def pruning_lines(convs: list) -> list[str]:
    """What "estimate > F x the best estimate" would have skipped (direct is always kept)."""
    lines = []
    for f in FACTORS:
        skipped, lost = 0, []
        for r in convs:
            best = min(r["estimate"].values())
            keep = {n for n, v in r["estimate"].items() if n == "direct" or v <= f * best}
            skipped += len(r["estimate"]) - len(keep)
            if r["chosen"] not in keep:
                kept = [v for n, v in r["measured"].items() if v is not None and n in keep]
                lost.append(f"{r['sig']}: {r['chosen']} {r['measured'][r['chosen']]:.3f} -> "
                            f"{min(kept):.3f} ms" if kept else f"{r['sig']}: {r['chosen']} -> nothing measured")
        lines.append(f"  F={f}: skips {skipped} of {sum(len(r['estimate']) for r in convs)} candidates; "
                     f"winners lost: {len(lost)}")
        lines += [f"      {line}" for line in lost]
    return lines


def run(args) -> int:
    from fxopt.testing import compile_with_fxopt

    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    options = {"conv_algorithm": "auto", "conv_prune": 0, **args.options}
    model, x = model_and_input(args)
    graphs: list = []
    rec = Recorder(args.device)
    rec.install()
    try:
        compiled = compile_with_fxopt(model, options, graphs)
        with torch.no_grad():
            first = first_call_s(compiled, x, args.device)
    finally:
        rec.restore()
        torch.compiler.reset()
    print(f"{args.model} {args.dtype} {tuple(x.shape)} {args.device}: first call {first:.2f} s")
    for g in graphs:
        for r in g.passes:
            print(f"  {r.name:24s} {r.ms:8.1f} ms")
        for k, v in g.executor_details.items():
            if k.endswith("_s"):
                print(f"  {k:24s} {v}")
    print("\nconvolutions measured (ms; estimate in brackets):")
    for r in rec.convs:
        cells = " ".join(f"{n}={'-' if r['measured'].get(n) is None else format(r['measured'][n], '.3f')}"
                         f"[{r['estimate'][n]:.3f}]" for n in r["estimate"])
        print(f"  {r['sig']} -> {r['chosen']}  {cells}  ({r['wall_s'] * 1e3:.0f} ms)")
    print(f"  total {sum(r['wall_s'] for r in rec.convs):.2f} s over {len(rec.convs)} convolutions")
    print("\nexecutor nodes measured:")
    for r in rec.nodes:
        ms = ", ".join(f"{k}={v:.4f}" for k, v in sorted(r["ms"].items(), key=lambda kv: kv[1]))
        print(f"  {r['node']}: {r['choice']} of {len(r['candidates'])} ({r['wall_s'] * 1e3:.0f} ms) {ms}")
    print(f"  total {sum(r['wall_s'] for r in rec.nodes):.2f} s over {len(rec.nodes)} nodes")
    print("\nsteps (wall s, calls):")
    for label, s in sorted(rec.steps.items(), key=lambda kv: -kv[1]):
        print(f"  {label:36s} {s:7.3f}  {rec.counts[label]}")
    print("\npruning rule 'estimate > F x best estimate' (direct always measured):")
    print("\n".join(pruning_lines(rec.convs)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "dtype": args.dtype, "shape": list(x.shape), "device": args.device,
                       "first_call_s": first, "convs": rec.convs, "nodes": rec.nodes,
                       "steps": {k: [v, rec.counts[k]] for k, v in rec.steps.items()}}, fh, indent=1,
                      default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    return 0
