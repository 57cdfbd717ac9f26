"""Where does fxopt's time go on one model? (GPU machine)

    python3 scripts/diagnose_gpu.py resnet50 --batch 1 --dtype float16
Prints the epilogue choices of the cuda executor, the CUDA-graph replay-vs-plain decision, and
the median latency of fxopt with executor cuda / torch and with CUDA graphs off.
"""
import argparse
import collections

import torch
import torchvision

from fxopt.autotune import time_ms
from fxopt.testing import compile_with_fxopt


def median_ms(fn, x, iters=50):
    with torch.no_grad():
        return time_ms(fn, [x], "cuda", warmup=10, iters=iters)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float16")
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, a.dtype)
    m = getattr(torchvision.models, a.model)(weights=None).eval().cuda().to(dtype)
    x = torch.randn(a.batch, 3, 224, 224, device="cuda", dtype=dtype)
    for label, opts in (("cuda", {}), ("torch", {"executor": "torch", "cudagraphs": True}),
                        ("cuda-nographs", {"cudagraphs": False})):
        graphs = []
        c = compile_with_fxopt(m, dict(opts, autotune_cache=False), graphs)
        ms = median_ms(c, x)
        g = graphs[0]
        det = g.executor_details
        epi = det.get("conv_epilogues", {})
        choices = collections.Counter(e["choice"] for e in epi.values())
        runner = det.get("cudagraph_runner")
        print(f"{label}: {ms:.3f} ms  compile {g.compile_ms / 1e3:.1f} s  cudagraphs={g.cudagraphs} "
              f"decisions={runner.decisions() if runner is not None else '-'}  epilogue choices={dict(choices)}")
        for name, e in list(epi.items())[:4]:
            print("   ", name, {k: round(v, 4) for k, v in e["ms"].items()})


if __name__ == "__main__":
    main()
