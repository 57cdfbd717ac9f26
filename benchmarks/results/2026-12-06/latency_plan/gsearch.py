"""One fresh process: cuDNN's search for a grouped conv's first call (as library_conv does), then the chosen plan timed."""
import sys, time, torch, torch.nn.functional as F
mode = sys.argv[1]  # cold | warm | heur
shapes = [((1, 384, 14, 14), (384, 64, 3, 3), 1, 6), ((1, 384, 7, 7), (384, 64, 3, 3), 1, 6), ((1, 128, 28, 28), (128, 64, 3, 3), 1, 2)]
torch.backends.cudnn.benchmark = False
dev = "cuda"
args = []
for xs, ws, st, g in shapes:
    x = torch.randn(xs, device=dev, dtype=torch.half).to(memory_format=torch.channels_last)
    w = torch.randn(ws, device=dev, dtype=torch.half).to(memory_format=torch.channels_last)
    args.append((x, w, st, g))
torch.cuda.synchronize()
time.sleep(2.0)  # the GPU idles, as between a compile's steps
for x, w, st, g in args:
    if mode == "warm":
        a = torch.randn(4096, 4096, device=dev, dtype=torch.half)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.05:
            a @ a
        torch.cuda.synchronize()
    torch.backends.cudnn.benchmark = mode != "heur"
    F.conv2d(x, w, None, st, 1, 1, g)
    torch.backends.cudnn.benchmark = False
    torch.cuda.synchronize()
res = []
for x, w, st, g in args:
    f = lambda: F.conv2d(x, w, None, st, 1, 1, g)
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): f()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(100): f()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); gr.replay(); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1) * 10)
    res.append(sorted(ts)[2])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
    for x, w, st, g in args:
        F.conv2d(x, w, None, st, 1, 1, g)
    torch.cuda.synchronize()
names = [e.name[:60] for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
print(mode, " ".join(f"{r:.2f}" for r in res), "|", " ; ".join(n[:45] for n in names))
