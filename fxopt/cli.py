"""The ``fxopt`` command: ``fxopt explain``, ``fxopt bench``, ``fxopt export``."""
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
    sub.add_parser("bench", help="benchmark against eager, Inductor and ONNX Runtime (fxopt bench --help)")
    args = parser.parse_args(argv)
    with torch.no_grad():
        return {"explain": cmd_explain, "export": cmd_export}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
