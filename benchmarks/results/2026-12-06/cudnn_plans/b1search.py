"""A timm model fp16 (NCHW input) compiled in this process alone, cudnn.benchmark on (as the harness).
argv: model, mode (heur: fxopt default; search: fxopt cudnn_search; ind: Inductor freezing +
reduce-overhead), batch. Prints first-call seconds and µs a call: `loop` 200 calls back to back,
median of 7 loops (CUDA events)."""
import sys, json, time, torch, timm
name, mode, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.backends.cudnn.benchmark = True
torch.manual_seed(0)
m = timm.create_model(name, pretrained=False).eval().cuda().half()
x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.half)
if mode == "ind":
    import torch._inductor.config as ic
    ic.freezing = True
    c = torch.compile(m, mode="reduce-overhead")
else:
    import fxopt
    c = torch.compile(m, backend="fxopt", options={"cudnn_search": mode == "search"})
with torch.no_grad():
    t0 = time.perf_counter(); c(x); torch.cuda.synchronize(); first = time.perf_counter() - t0
    for _ in range(50): c(x)
    ls = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(200): c(x)
        b.record(); b.synchronize(); ls.append(a.elapsed_time(b) * 1e3 / 200)
print(json.dumps({"model": name, "mode": mode, "batch": batch, "first_s": round(first, 2),
                  "loop_us": round(sorted(ls)[3], 1), "loops": [round(v, 1) for v in ls]}), flush=True)
