"""The ``fxopt`` command: ``fxopt explain``, ``fxopt bench``, ``fxopt export``, ``fxopt package``, ``fxopt run``."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def load_model(spec: str) -> torch.nn.Module:
    """'package.module:ATTR' where ATTR is an nn.Module class or a factory function."""
    if ":" not in spec:
        raise SystemExit(f"fxopt: model must be MODULE:ATTR (e.g. torchvision.models:resnet18), got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    model = obj()
    if not isinstance(model, torch.nn.Module):
        raise SystemExit(f"fxopt: {spec} did not produce an nn.Module (got {type(model).__name__})")
    return model


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape must be comma-separated integers, got {text!r}") from None


def _model_and_input(args):
    model = load_model(args.model).eval().to(device=args.device, dtype=DTYPES[args.dtype])
    x = torch.randn(args.shape, device=args.device, dtype=DTYPES[args.dtype])
    return model, x


def cmd_explain(args) -> int:
    import fxopt

    model, x = _model_and_input(args)
    options = json.loads(args.options) if args.options else None
    report = fxopt.explain(model, x, options=options)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report)
    return 0


def cmd_export(args) -> int:
    import fxopt

    model, x = _model_and_input(args)
    options = json.loads(args.options) if args.options else None
    fxopt.export_onnx(model, (x,), args.output, options=options, dynamic_batch=not args.static)
    print(f"wrote {args.output}")
    return 0


def cmd_package(args) -> int:
    import fxopt

    model, x = _model_and_input(args)
    options = json.loads(args.options) if args.options else None
    summary = fxopt.package(model, (x,), args.output, options=options, dynamic_batch=not args.static)
    batch = summary["batch"]
    print(f"wrote {args.output} ({summary['bytes'] / 2**20:.1f} MiB, batch "
          f"{'dynamic' if batch['dynamic'] else 'fixed at ' + str(batch['example'])}) in {summary['timings']['total_s']:.1f} s")
    return 0


def cmd_run(args) -> int:
    """Load a package (no torch.compile), time its calls on random inputs of ``--shape``."""
    import time

    import fxopt

    t0 = time.perf_counter()
    module = fxopt.load(args.package, device=args.device)
    load_s = time.perf_counter() - t0
    spec = module.input_specs[0]
    x = torch.randn(args.shape, device=module.device, dtype=getattr(torch, spec["dtype"]))
    sync = torch.cuda.synchronize if module.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    module(x)
    sync()
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        module(x)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    print(module.summary())
    print(f"load {load_s:.3f} s, first call {first_s:.3f} s; {args.iters} calls: median {times[len(times) // 2]:.3f} ms"
          f" (min {times[0]:.3f}, max {times[-1]:.3f})" if times else f"load {load_s:.3f} s, first call {first_s:.3f} s")
    return 0


def _package_parsers(sub) -> None:
    p = sub.add_parser("package", help="write the optimized model as one file that fxopt run / fxopt.load run")
    p.add_argument("model", help="MODULE:ATTR, e.g. torchvision.models:resnet18")
    p.add_argument("--shape", type=parse_shape, required=True, help="example input shape, e.g. 1,3,224,224")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--options", help="fxopt options as JSON")
    p.add_argument("--static", action="store_true", help="fixed batch size (default: dynamic batch)")
    p.add_argument("-o", "--output", required=True, help="path of the package (.fxopt)")
    p = sub.add_parser("run", help="load a package (no torch.compile) and time it")
    p.add_argument("package", help="path of a .fxopt package")
    p.add_argument("--shape", type=parse_shape, required=True, help="input shape, e.g. 1,3,224,224")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: where it was packaged")
    p.add_argument("--iters", type=int, default=20, help="timed calls after the first (default 20)")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        from fxopt.bench import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="fxopt", description="fxopt: an optimizing compiler for CNNs")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in (("explain", "show what every pass does to a model"),
                           ("export", "write the optimized graph as ONNX")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", help="MODULE:ATTR, e.g. torchvision.models:resnet18")
        p.add_argument("--shape", type=parse_shape, required=True, help="input shape, e.g. 1,3,224,224")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        p.add_argument("--options", help="fxopt options as JSON, e.g. '{\"layout\": \"channels_last\"}'")
        if name == "explain":
            p.add_argument("--json", action="store_true", help="print the report as JSON")
        else:
            p.add_argument("-o", "--output", required=True, help="path of the .onnx file")
            p.add_argument("--static", action="store_true", help="fixed batch size (default: dynamic batch)")
    _package_parsers(sub)
    sub.add_parser("bench", help="benchmark against eager, Inductor and ONNX Runtime (fxopt bench --help)")
    args = parser.parse_args(argv)
    if getattr(args, "iters", 0) < 0:
        parser.error("--iters must be >= 0")
    with torch.no_grad():
        return {"explain": cmd_explain, "export": cmd_export, "package": cmd_package, "run": cmd_run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
