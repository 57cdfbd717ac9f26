"""GPU time of the split-attention sum over the radix, x [16, 2, 256, 56, 56] float16 (a channels_last
[16, 512, 56, 56] viewed as 5-D) summed over dim 1: the column reduction of ``kernels/column_reduction.py``
against the mapping it replaced (``reduction.py`` as of the commit before, read from git) and eager.
Each kernel is replayed in a CUDA graph (20 launches per replay), so launch overhead does not count.

    python scripts/bench_column_reduction.py [OLD_REV]
"""
import subprocess
import sys
import types

import torch

sys.path.insert(0, "tests")
from test_column_reduction import layout  # noqa: E402

from fxopt.backends.cuda.kernels.pointwise import vector_width  # noqa: E402
from fxopt.backends.cuda.kernels.region import generate_kernel  # noqa: E402

rev = sys.argv[1] if len(sys.argv) > 1 else subprocess.check_output(
    ["git", "log", "-1", "--format=%H", "-S", "tr = 32 if tiles", "--", "backends/cuda/kernels/reduction.py"],
    text=True).strip() + "^"
old = sys.modules["old_reduction"] = types.ModuleType("old_reduction")
exec(subprocess.check_output(["git", "show", f"{rev}:backends/cuda/kernels/reduction.py"], text=True), old.__dict__)


def gpu_us(fn, reps=20) -> float:
    fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        g.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / (10 * reps)


print(torch.cuda.get_device_name())
for name, c, what in (("cl", 256, "NCHW out (eager's)"), ("cl_nhwc", 256, "NHWC out"), ("ncr", 256 * 3136, "contiguous in")):
    k = layout(name, 2, c, torch.float16, 16, 3136)
    xb, ob = k.inputs[0], k.outputs[0]
    x = torch.empty_strided(xb.shape, xb.strides, dtype=xb.dtype, device="cuda").normal_()
    out = torch.empty_strided(ob.shape, ob.strides, dtype=ob.dtype, device="cuda")
    nbytes = (x.numel() + out.numel()) * 2
    for tag, ks in (("old", old.generate_reduction_kernel(k)), ("new", generate_kernel(k, vector_width(k)))):
        kern = ks.compile()
        us = gpu_us(lambda: kern.launch(ks.meta["grid"], ks.block, [x, out]))
        print(f"{what:20} {tag}  {ks.name:40} {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s")
    us = gpu_us(lambda: torch.sum(x, 1))
    print(f"{what:20} eager {'torch.sum':39} {us:8.1f} us  {nbytes / us / 1e3:6.0f} GB/s")
