"""bias + SiLU on a conv output, fp16 channels_last, batch 1 (eca_nfnet_l0's shapes): fxopt's epilogue kernel
(in place; variants of block, vector width, out of place) against Inductor's kernel for the same function
(max-autotune-no-cudagraphs). Each: 100 launches in a CUDA graph, median of 9 replays, µs a launch."""
import json, torch, torch.nn.functional as F
from fxopt.backends.cuda.codegen.epilogue import template_epilogue
from fxopt.backends.cuda.kernels.conv_epilogue import generate_conv_epilogue, launch_conv_epilogue
SH = [(1,64,112,112),(1,128,56,56),(1,128,28,28),(1,384,28,28),(1,384,14,14),(1,384,7,7),(1,1536,14,14),(1,1536,7,7)]
e = template_epilogue(True, False, "silu")
def graph_time(fn, n=100):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3): fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(n): fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(9):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1e3 / n)
    return round(sorted(ts)[4], 3)
ind = torch.compile(lambda y, b: F.silu(y + b.view(1, -1, 1, 1)), mode="max-autotune-no-cudagraphs", dynamic=False)
rows = []
for shp in SH:
    C = shp[1]
    y = torch.randn(shp, device="cuda", dtype=torch.half).to(memory_format=torch.channels_last)
    b = torch.randn(C, device="cuda", dtype=torch.half)
    out2 = torch.empty_like(y)
    r = {"shape": shp}
    for block in (128, 256, 512):
        for vec in (8, 4):
            ks = generate_conv_epilogue(f"b_silu_{block}_{vec}", e, torch.half, "nhwc", vec, block=block, fast_math=True)
            k = ks.compile()
            r[f"fx_b{block}_v{vec}"] = graph_time(lambda: launch_conv_epilogue(ks, {"y": y, "bias": b}, y, kernel=k))
    ks = generate_conv_epilogue("b_silu_oop", e, torch.half, "nhwc", 8, block=256, fast_math=True); k = ks.compile()
    r["fx_b256_v8_oop"] = graph_time(lambda: launch_conv_epilogue(ks, {"y": y, "bias": b}, out2, kernel=k))
    for _ in range(3): ind(y, b)
    r["inductor"] = graph_time(lambda: ind(y, b))
    rows.append(r); print(json.dumps(r), flush=True)
