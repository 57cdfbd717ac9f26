"""Programmatic dependent launch on and off, side by side in one process (GPU machine).

    python3 scripts/pdl_ab.py seedcnn:float32:1 mobilenet_v2:float16:1 [--rounds 10]

Per config the model is compiled twice with the same autotuning cache (so both copies run the same
kernels): first with ``FXOPT_PDL=0``, then, after dropping the in-memory kernel objects, with PDL
on. The two CUDA-graph replays and the two compiled calls are then timed in alternating rounds
(CUDA events, medians in microseconds).
"""
import argparse
import copy
import os
import tempfile

import torch

from fxopt.backends.cuda import compiler as nvrtc
from fxopt.bench.models import build_model
from fxopt.bench.runners import time_calls
from fxopt.testing import compile_with_fxopt


def compiled(model, x, cache, pdl: bool):
    os.environ["FXOPT_PDL"] = "1" if pdl else "0"
    nvrtc.clear_memory_cache()  # new kernel objects: loaded (and their PDL attribute decided) anew
    graphs = []
    c = compile_with_fxopt(copy.deepcopy(model), {"autotune_cache": cache}, graphs)
    with torch.no_grad():
        for _ in range(20):
            c(x)
    runner = graphs[0].executor_details.get("cudagraph_runner")
    graph = runner._fast[0].graph if runner is not None and runner._fast is not None else None
    return c, graph


def main():
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="+")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    cache = os.path.join(tempfile.mkdtemp(prefix="fxopt_pdl_ab_"), "autotune.json")
    for cfg in a.configs:
        name, dtype, batch = cfg.split(":")
        model, shape = build_model(name)
        model = model.eval().cuda().to(getattr(torch, dtype))
        x = torch.randn(int(batch), *shape, device="cuda", dtype=getattr(torch, dtype))
        off_c, off_g = compiled(model, x, cache, False)
        on_c, on_g = compiled(model, x, cache, True)
        with torch.no_grad():
            torch.testing.assert_close(on_c(x), off_c(x), rtol=0, atol=0)
        t = {k: [] for k in ("replay_off", "replay_on", "call_off", "call_on")}
        with torch.no_grad():
            for _ in range(a.rounds):
                if off_g is not None and on_g is not None:
                    t["replay_off"] += time_calls(lambda _: off_g.replay(), x, "cuda", a.iters)
                    t["replay_on"] += time_calls(lambda _: on_g.replay(), x, "cuda", a.iters)
                t["call_off"] += time_calls(off_c, x, "cuda", a.iters)
                t["call_on"] += time_calls(on_c, x, "cuda", a.iters)
        med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in t.items() if v}
        print(f"{cfg}: " + " ".join(f"{k}={v:.1f}us" for k, v in med.items()), flush=True)
        torch.compiler.reset()


if __name__ == "__main__":
    main()
