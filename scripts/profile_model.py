"""Kernel-time breakdown of one model under fxopt and Inductor (GPU machine).

    python3 scripts/profile_model.py mobilenet_v2 --batch 64 --dtype float16
Prints the top CUDA kernels by total time for each backend (torch.profiler, 20 timed calls).
"""
import argparse

import torch
import torchvision
from torch.profiler import ProfilerActivity, profile


def top_kernels(fn, x, n=20, rows=15):
    with torch.no_grad():
        for _ in range(5):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn(x)
            torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dtype", default="float16")
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    dtype = getattr(torch, a.dtype)
    m = getattr(torchvision.models, a.model)(weights=None).eval().cuda().to(dtype)
    x = torch.randn(a.batch, 3, 224, 224, device="cuda", dtype=dtype)
    for name, opts in (("fxopt", {"cudagraphs": False}),):
        torch.compiler.reset()
        print(f"=== {name} ===")
        print(top_kernels(torch.compile(m, backend="fxopt", options=opts), x))
    torch.compiler.reset()
    with torch._inductor.config.patch(freezing=True):
        print("=== inductor (freezing) ===")
        print(top_kernels(torch.compile(m), x))


if __name__ == "__main__":
    main()
