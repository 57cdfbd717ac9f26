"""What other compiled backends in the same process cost fxopt's measured latency (GPU machine).

    python3 scripts/neighbour_probe.py seedcnn:float32:1 [--neighbours a,b,...] [--iters 100]

The benchmark harness keeps every backend of a row alive and times them in interleaved rounds.
This script prepares fxopt alone and times it the harness's way (``time_round`` with re-warm
calls), then adds the neighbours one at a time (same preparation as the harness) and, after each,
times a few alternating rounds of (neighbour, fxopt) again. Printed per step: fxopt's median and
quartiles of the CUDA-event samples, its host time per call, and the neighbour's own median; a
step that moves fxopt's median names the neighbour that costs it.
"""
import argparse
import gc

import torch

from fxopt.bench import models as M
from fxopt.bench import runners as R

DEFAULT = ("onnxruntime-cudagraph,inductor-reduce-overhead,inductor-freezing-reduce-overhead,"
           "fxopt-no-cudagraphs,inductor,inductor-freezing,onnxruntime,eager")


def _us(samples):
    s = sorted(samples)
    return s[len(s) // 2] * 1e3, s[len(s) // 4] * 1e3, s[(3 * len(s)) // 4] * 1e3


def rounds(live, others, iters, rewarm, n_rounds):
    """n_rounds of: every live neighbour, then fxopt; returns fxopt's and the neighbours' samples."""
    live.samples = []
    for o in others:
        o.samples = []
    for _ in range(n_rounds):
        for o in others:
            R.time_round(o, "cuda", iters, rewarm=rewarm)
        R.time_round(live, "cuda", iters, rewarm=rewarm)
    return live.samples, {o.backend: list(o.samples) for o in others}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("--neighbours", default=DEFAULT)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rewarm", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    name, dtype, batch = a.config.split(":")
    base, shape = M.build_model(name)
    x_cpu = M.make_input(shape, int(batch), 0)
    dt = getattr(torch, dtype)
    fx = R.start_cell("fxopt", base, x_cpu, None, "cuda", dt, 10)
    others = []

    def report(step):
        fx_s, nb = rounds(fx, others[-1:], a.iters, a.rewarm, a.rounds)
        with torch.no_grad():
            host = min(R.host_ms_per_call(fx.prepared.fn, fx.prepared.inputs, 200) for _ in range(3)) * 1e3
        med, q1, q3 = _us(fx_s)
        nb_txt = " ".join(f"{k}={_us(v)[0]:.1f}" for k, v in nb.items())
        print(f"{step:<40} fxopt median {med:6.1f} us [{q1:.1f}, {q3:.1f}] host {host:5.1f} us  {nb_txt}",
              flush=True)

    report("fxopt alone")
    report("fxopt alone (again)")
    for nb in a.neighbours.split(","):
        live = R.start_cell(nb, base, x_cpu, None, "cuda", dt, 10, reset=False)
        if live.prepared is None:
            print(f"{nb}: {live.cell.get('status')} {live.cell.get('error')}", flush=True)
            continue
        others.append(live)
        report(f"+ {nb} ({len(others)} live)")
    others.clear()
    gc.collect()
    report("neighbours released")
    print(f"dynamo cache entries on forward: {len(torch._dynamo.eval_frame._debug_get_cache_entry_list(type(base).forward.__code__))}")


if __name__ == "__main__":
    main()
