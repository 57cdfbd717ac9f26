"""A timm model fp16 b1 compiled by fxopt in this process; argv: model, small (1: conv epilogues of at most
1 MiB run 8-byte vectors in blocks of 128, the tree's default; 0: SMALL_EPILOGUE_BYTES = 0, every epilogue
16-byte vectors in blocks of 256, as before). µs a call: `call` synchronized each call (median of 200),
`loop` 200 calls back to back (median of 7 loops), both CUDA events."""
import sys, json, time, torch, timm
name, small = sys.argv[1], sys.argv[2] == "1"
import fxopt
from fxopt.backends.cuda.kernels import conv_epilogue
if not small:
    conv_epilogue.SMALL_EPILOGUE_BYTES = 0
torch.manual_seed(0)
m = timm.create_model(name, pretrained=False).eval().cuda().half()
x = torch.randn(1, 3, 224, 224, device="cuda", dtype=torch.half)
c = torch.compile(m, backend="fxopt")
with torch.no_grad():
    for _ in range(3): c(x)
    for _ in range(50): c(x)
    ts = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); c(x); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3)
    ls = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(200): c(x)
        b.record(); b.synchronize(); ls.append(a.elapsed_time(b) * 1e3 / 200)
print(json.dumps({"model": name, "small": small, "call_us": round(sorted(ts)[100], 1), "loop_us": round(sorted(ls)[3], 1)}))
