"""cuDNN's search for eca_nfnet_l0's grouped convs (b1 fp16 CL), quiet host or while NVRTC compiles on
15 threads; then each searched conv timed in a CUDA graph (200 launches). One process per run."""
import os, sys, threading, time, json
import torch, torch.nn.functional as F
mode = sys.argv[1]
SH = [((1,128,56,56),128,2,2,1),((1,128,28,28),128,2,1,3),((1,384,28,28),384,6,2,1),((1,384,14,14),384,6,1,11),
      ((1,384,14,14),384,6,2,1),((1,384,7,7),384,6,1,5)]
stop = threading.Event()
def load(i):
    from fxopt.backends.cuda.compiler import compile_kernel
    n = 0
    while not stop.is_set():
        n += 1
        src = f'extern "C" __global__ void k{i}_{n}(float* x) {{ float a = x[threadIdx.x]; for (int j = 0; j < 64; ++j) a = a * 1.0001f + {n}.0f; x[threadIdx.x] = a; }} // {time.time()}'
        try: compile_kernel(src, f"k{i}_{n}")
        except Exception as e: print(e); return
torch.cuda.init(); x0 = torch.zeros(1, device="cuda")
convs = []
for shape, c, g, s, cnt in SH:
    x = torch.randn(shape, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    w = torch.randn(c, c // g, 3, 3, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    convs.append((x, w, g, s, cnt))
threads = []
if mode == "busy":
    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(15)]
    for t in threads: t.start()
    time.sleep(1.0)
torch.backends.cudnn.benchmark = True
for x, w, g, s, cnt in convs:
    F.conv2d(x, w, None, s, 1, 1, g)
torch.cuda.synchronize()
torch.backends.cudnn.benchmark = False
stop.set()
for t in threads: t.join()
res = []
for x, w, g, s, cnt in convs:
    st = torch.cuda.Stream()
    with torch.cuda.stream(st):
        for _ in range(3): F.conv2d(x, w, None, s, 1, 1, g)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr, stream=st):
            for _ in range(200): F.conv2d(x, w, None, s, 1, 1, g)
    torch.cuda.synchronize()
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); gr.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / 200)
    res.append(round(sorted(ts)[3], 2))
tot = sum(r * c[4] for r, c in zip(res, SH))
print(json.dumps({"mode": mode, "us": res, "weighted_total_us": round(tot, 1)}))
