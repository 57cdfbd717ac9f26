"""Single-convolution benchmarks for algorithm selection (``python -m fxopt.bench.convs``).

1. Large-kernel and long 1-D convolutions: eager cuDNN vs ``torch.compile(backend="fxopt")``
   with ``conv_algorithm="auto"``; prints the algorithm auto chose and the speed-up.
2. Winograd vs cuDNN on the 3x3 layers of VGG-16 and ResNet-18 (fp32 and fp16, batch 1 and 32):
   the algorithm implementations timed directly, no graph around them.
3. Grouped 3x3 convolutions with few, wide groups (2-8 groups of 32-256 channels; ResNeXt's,
   ResNeSt's radix convs, DPN's), fp16 channels_last + ReLU at batch 1 and 32: eager cuDNN (its
   search on, and PyTorch's default without it) vs fxopt, with the candidates fxopt measured for the
   conv and the one it kept, and the kernels one call launches.

Timings: CUDA events, warm-up, median of `--iters` runs, inputs rotated between 3 tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn as nn

LARGE = [  # (label, ndim, n, c, size, k)
    ("replknet 31x31 dw n32 c128 56", 2, 32, 128, 56, 31),
    ("replknet 31x31 dw n32 c256 28", 2, 32, 256, 28, 31),
    ("dw 7x7 n32 c384 56", 2, 32, 384, 56, 7),
    ("dw 31x31 n1 c128 56", 2, 1, 128, 56, 31),
]
VGG16_3x3 = [(3, 64, 224), (64, 64, 224), (64, 128, 112), (128, 128, 112), (128, 256, 56), (256, 256, 56),
             (256, 512, 28), (512, 512, 28), (512, 512, 14)]
RESNET18_3x3 = [(64, 64, 56), (128, 128, 28), (256, 256, 14), (512, 512, 7)]


def time_ms(fn, inputs, warmup=5, iters=30) -> float:
    from fxopt.autotune import time_ms as _timed

    return _timed(fn, inputs, "cuda", warmup=warmup, iters=iters)


def large_kernel_rows(iters: int) -> list[dict]:
    import fxopt  # noqa: F401

    rows = []
    cases = [(label, nd, n, c, s, k) for label, nd, n, c, s, k in LARGE]
    cases.append(("conv1d 1024 taps n8 c64 L16384", 1, 8, 64, 16384, 1024))
    for label, nd, n, c, size, k in cases:
        torch.compiler.reset()
        if nd == 2:
            conv = nn.Conv2d(c, c, k, padding=k // 2, groups=c)
            shape = (n, c, size, size)
        else:
            conv = nn.Conv1d(c, c, k, padding=k // 2)
            shape = (n, c, size)
        conv = conv.cuda().eval()
        xs = [torch.randn(shape, device="cuda") for _ in range(3)]
        graphs = []
        from fxopt.testing import compile_with_fxopt

        compiled = compile_with_fxopt(conv, {"conv_algorithm": "auto", "autotune_cache": False}, graphs)
        with torch.no_grad():
            ref = conv(xs[0])
            out = compiled(xs[0])
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            t_eager = time_ms(conv, xs, iters=iters)
            t_fx = time_ms(compiled, xs, iters=iters)
        choice = next(iter(graphs[0].conv_algorithms.values())) if graphs and graphs[0].conv_algorithms else None
        rows.append({"case": label, "eager_cudnn_ms": t_eager, "fxopt_ms": t_fx, "speedup": t_eager / t_fx,
                     "algorithm": choice.algorithm if choice else "?", "rel_error": err,
                     "candidates": choice.candidates if choice else {}})
    return rows


FEW_GROUPS = [(2, 64, 56), (4, 64, 28), (8, 32, 28), (2, 128, 28), (4, 128, 14), (8, 64, 14), (2, 256, 14),
              (32, 8, 28)]  # (groups, channels per group, side); the last: ResNeXt's 32x8 for comparison


def few_group_rows(iters: int) -> list[dict]:
    from fxopt.testing import compile_with_fxopt

    rows = []
    for groups, width, side in FEW_GROUPS:
        for batch in (1, 32):
            torch.compiler.reset()
            c = groups * width
            model = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, groups=groups), nn.ReLU())
            model = model.cuda().half().eval().to(memory_format=torch.channels_last)
            xs = [torch.randn(batch, c, side, side, device="cuda", dtype=torch.float16)
                  .contiguous(memory_format=torch.channels_last) for _ in range(3)]
            graphs: list = []
            compiled = compile_with_fxopt(model, {"autotune_cache": False}, graphs)
            with torch.no_grad():
                ref = model(xs[0]).float()
                out = compiled(xs[0]).float()
                err = ((out - ref).abs().max() / ref.abs().max()).item()
                t_eager = time_ms(model, xs, iters=iters)
                t_fx = time_ms(compiled, xs, iters=iters)
                kernels = {k: _kernels_per_call(f, xs[0]) for k, f in (("eager", model), ("fxopt", compiled))}
                with torch.backends.cudnn.flags(enabled=True, benchmark=False):  # PyTorch's default setting
                    t_default = time_ms(model, xs, iters=iters)
                    kernels["eager_default"] = _kernels_per_call(model, xs[0])
            choices = {k: v for g in graphs for k, v in g.executor_details.get("node_choices", {}).items()}
            conv = next((v for k, v in choices.items() if "conv" in k), {})
            rows.append({"case": f"g{groups}x{width} @{side} b{batch}", "eager_cudnn_ms": t_eager,
                         "eager_default_ms": t_default, "fxopt_ms": t_fx,
                         "speedup": t_eager / t_fx, "choice": conv.get("choice", "?"),
                         "candidates": conv.get("ms", {}), "rel_error": err,
                         "kernels": kernels})
    return rows


def _kernels_per_call(fn, x) -> list:
    """The names of the GPU kernels one call of ``fn(x)`` launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(x)
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


def winograd_rows(iters: int) -> list[dict]:
    from fxopt.conv_algorithms import ConvSig, get_algorithm

    rows = []
    for net, layers in (("vgg16", VGG16_3x3), ("resnet18", RESNET18_3x3)):
        for dtype in (torch.float32, torch.float16):
            for batch in (1, 32):
                for cin, cout, size in layers:
                    x = [torch.randn(batch, cin, size, size, device="cuda", dtype=dtype)
                         .contiguous(memory_format=torch.channels_last) for _ in range(3)]
                    w = torch.randn(cout, cin, 3, 3, device="cuda", dtype=dtype) * 0.05
                    sig = ConvSig.from_tensors(x[0], w, 1, 1, 1, 1)
                    row = {"net": net, "dtype": str(dtype).replace("torch.", ""), "batch": batch,
                           "layer": f"{cin}->{cout} @{size}"}
                    with torch.no_grad():
                        ref = get_algorithm("direct").run(x[0], w, None, None, sig).float()
                        for name in ("direct", "winograd_2x2_3x3", "winograd_4x4_3x3"):
                            algo = get_algorithm(name)
                            packed = algo.prepare(w, sig)
                            out = algo.run(x[0], w, packed, None, sig).float()
                            row[f"{name}_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
                            row[f"{name}_ms"] = time_ms(lambda t: algo.run(t, w, packed, None, sig), x, iters=iters)
                    rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fxopt.bench.convs")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default=None, help="write JSON here")
    p.add_argument("--skip-winograd", action="store_true")
    p.add_argument("--only", choices=("large", "winograd", "few-groups"), default=None, help="one section")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version()}
    want = (lambda s: args.only in (None, s))
    if want("large"):
        result["large"] = large_kernel_rows(args.iters)
    if want("winograd") and not args.skip_winograd:
        result["winograd"] = winograd_rows(args.iters)
    if want("few-groups"):
        result["few_groups"] = few_group_rows(args.iters)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"\n{result['device']} torch {result['torch']} cuDNN {result['cudnn']}")
    print("| case | cuDNN ms | fxopt ms | speed-up | auto chose | rel err |\n|---|---|---|---|---|---|")
    for r in result.get("large", []):
        print(f"| {r['case']} | {r['eager_cudnn_ms']:.3f} | {r['fxopt_ms']:.3f} | {r['speedup']:.2f}x | "
              f"{r['algorithm']} | {r['rel_error']:.1e} |")
    if "winograd" in result:
        print("\n| net | dtype | batch | layer | direct ms | wino2x2 ms (err) | wino4x4 ms (err) |\n|---|---|---|---|---|---|---|")
        for r in result["winograd"]:
            print(f"| {r['net']} | {r['dtype']} | {r['batch']} | {r['layer']} | {r['direct_ms']:.3f} | "
                  f"{r['winograd_2x2_3x3_ms']:.3f} ({r['winograd_2x2_3x3_err']:.0e}) | "
                  f"{r['winograd_4x4_3x3_ms']:.3f} ({r['winograd_4x4_3x3_err']:.0e}) |")
    if "few_groups" in result:
        print("\n| grouped 3x3, fp16 CL + ReLU | cuDNN ms (default) | fxopt ms | speed-up | kept | measured ms | "
              "kernels a call eager (default) / fxopt | rel err |\n|---|---|---|---|---|---|---|---|")
        for r in result["few_groups"]:
            cands = ", ".join(f"{k} {v:.3f}" for k, v in r["candidates"].items() if isinstance(v, (int, float)))
            k = r["kernels"]
            print(f"| {r['case']} | {r['eager_cudnn_ms']:.3f} ({r['eager_default_ms']:.3f}) | {r['fxopt_ms']:.3f} | "
                  f"{r['speedup']:.2f}x | {r['choice']} | {cands} | {len(k['eager'])} ({len(k['eager_default'])}) / "
                  f"{len(k['fxopt'])} | {r['rel_error']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
