"""eca_nfnet_l0 fp16 b1 compiled by fxopt in this process (option search_first as argv[1]); µs a call
(CUDA events, median of 200 after warm-up) and GPU µs a call of the conv kernels (profiler, 20 calls)."""
import sys, json, time, torch, timm
from collections import defaultdict
flag = sys.argv[1] == "1"
torch.manual_seed(0)
m = timm.create_model("eca_nfnet_l0", pretrained=False).eval().cuda().half()
x = torch.randn(1, 3, 224, 224, device="cuda", dtype=torch.half)
import fxopt
c = torch.compile(m, backend="fxopt", options={"search_first": flag})
t0 = time.perf_counter()
with torch.no_grad():
    for _ in range(3): c(x)
    torch.cuda.synchronize(); comp = time.perf_counter() - t0
    for _ in range(50): c(x)
    ts = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); c(x); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20): c(x)
        torch.cuda.synchronize()
agg = defaultdict(float)
for e in prof.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        agg[e.name] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
conv = sum(v for k, v in agg.items() if "xmma" in k or "cutlass" in k or "conv2d_grouped" in k) / 20
tot = sum(agg.values()) / 20
top = sorted(((v / 20, k[:60]) for k, v in agg.items() if "xmma" in k or "cutlass" in k), reverse=True)[:6]
print(json.dumps({"search_first": flag, "compile_s": round(comp, 1), "call_us": round(ts[100], 1),
                  "conv_gpu_us": round(conv, 1), "gpu_us": round(tot, 1), "top": [(round(a, 1), b) for a, b in top]}))
