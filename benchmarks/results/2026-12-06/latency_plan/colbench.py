"""Sweep column-reduction plans for bias+mean at batch 1 (ECA gates) against Inductor."""
import itertools, sys, time, torch, torch.nn as nn
import fxopt
import fxopt.backends.cuda.runtime.executor as ex
from fxopt.backends.cuda.kernels import column_reduction as cr
from fxopt.backends.cuda.kernels.region import launch_fused
from fxopt.backends.cuda.ir import ReductionKernel
from fxopt.backends.cuda import ir
dev = "cuda" if torch.cuda.is_available() else "cpu"
seen = []
orig = ex.parallel_variant
def pv(region, gen, fm=False):
    if isinstance(region.kernel, ReductionKernel) and region.kernel.strategy == "outer":
        seen.append(region)
    return orig(region, gen, fm)
ex.parallel_variant = pv

class Blk(nn.Module):
    def __init__(s, C):
        super().__init__(); s.conv = nn.Conv2d(C, C, 1, bias=True)
    def forward(s, x):
        y = s.conv(x); g = y.mean((2, 3))
        return y * torch.sigmoid(g)[:, :, None, None]

def fn(y, b):
    return (y + b[None, :, None, None]).mean((2, 3))

import os
QUICK = bool(os.environ.get("QUICK"))
SHAPES = [(256, 56), (512, 28), (1536, 14), (1536, 7), (2304, 7)]
def timed(f, n=200, reps=5):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): f()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): f()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); g.replay(); e1.record(); torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1) * 1000 / n)
    return sorted(out)[len(out) // 2]

for C, H in SHAPES:
    seen.clear()
    m = Blk(C).to(dev).half().eval().to(memory_format=torch.channels_last)
    x = torch.randn(1, C, H, H, device=dev, dtype=torch.half).to(memory_format=torch.channels_last)
    opts = {"executor": "cuda", "layout": "channels_last"} | ({} if dev == "cuda" else {"emulate_kernels": True})
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(m, backend="fxopt", options=opts)(x)
    if not seen:
        print(C, H, "no column region"); continue
    k = seen[0].kernel
    vec = cr.column_vector_width(k)
    print(f"== [1,{C},{H},{H}] rows {k.rows} R {k.row_size} ops {seen[0].ops} default {cr.column_plan(k, vec)} par {cr.column_plan(k, vec, 4)}", flush=True)
    if dev != "cuda":
        continue
    inputs = [torch.empty_strided(b.shape, b.strides, dtype=b.dtype, device=dev).normal_() for b in k.inputs]
    want = [torch.empty_strided(b.shape, b.strides, dtype=torch.float32, device=dev) for b in k.outputs]
    ir.evaluate(k, inputs, want)
    outs = [torch.empty_strided(b.shape, b.strides, dtype=b.dtype, device=dev) for b in k.outputs]
    groups = k.rows // vec
    plans = {"default": (cr.column_plan(k, vec), 1), "par4": (cr.column_plan(k, vec, 4), 4),
             "latency": (cr.column_plan(k, vec, cr.LATENCY_WORK), cr.LATENCY_WORK)}
    R = k.row_size
    for bx, by, splits, sh in [] if QUICK else itertools.product((1, 2, 4, 8, 16), (4, 8, 16, 32, 64), (1, 2, 4, 8, 16, 32), (False, True)):
        if bx * by < 32 or bx * by > 512 or not (R / 16 <= by * splits <= max(4, R / 2)):
            continue
        if sh and (bx > 16 or by < 2):
            continue
        chunk = -(-R // splits); sp = -(-R // chunk)
        plans[f"bx{bx}by{by}s{sp}" + "x" * sh] = (cr.ColumnPlan(vec, bx, by, sp, chunk, -(-groups // bx), 0, sh), 1)
    print("  variants", len(plans), flush=True)
    res = []
    for name, (p, w) in plans.items():
        try:
            ks = cr.generate_column_reduction(k, p, False, w)
            kern = ks.compile(); kept = {}
            outs[0].fill_(float("nan"))
            launch_fused(ks, inputs, outs, kern, tickets=kept)
            err = ((outs[0].double() - want[0].double()).abs().max()).item()
            t = timed(lambda: launch_fused(ks, inputs, outs, kern, tickets=kept))
            res.append((t, name, p.block, p.tiles * p.splits, err))
        except Exception as e:
            print("  fail", name, repr(e)[:200])
    y, b = inputs[0], inputs[1]
    ic = torch.compile(fn, mode="max-autotune-no-cudagraphs")
    ic(y, b); ic(y, b)
    ti = timed(lambda: ic(y, b))
    res.sort()
    print(f"  inductor {ti:.2f} us; eager {timed(lambda: fn(y, b)):.2f} us")
    for t, name, blk, nb, err in res[:12] + [r for r in res if r[1] in ("default", "par4", "latency")]:
        print(f"  {t:6.2f} us  {name:16s} block {blk:4d} blocks {nb:4d} err {err:.1e}")
    sys.stdout.flush()
