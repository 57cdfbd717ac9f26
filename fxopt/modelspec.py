"""Naming a model and its example input on the command line (``fxopt explain|export|diagnose``).

A model is ``MODULE:ATTR`` (an ``nn.Module`` class or a factory, e.g. ``torchvision.models:resnet18``)
with an input ``--shape``, or a model of the benchmark suite by name (``resnet50``: its input shape
is known and its weights are seeded as the benchmark's are, so a diagnostic sees what the benchmark
measured). Kept apart from ``fxopt.cli`` so that the subcommands' modules can use it without
importing the CLI back.
"""
from __future__ import annotations

import argparse
import importlib
import json

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


def csv_list(text: str) -> list[str]:
    """A comma list argument (``--models a,b``): its non-empty items, stripped."""
    return [p.strip() for p in text.split(",") if p.strip()]


def non_negative_int(text: str) -> int:
    """A count argument such as ``--iters``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def options_json(text: str) -> dict:
    """``--options``: fxopt options as a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"options must be JSON, e.g. '{{\"layout\": \"channels_last\"}}': {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"options must be a JSON object, got {text!r}")
    return value


def add_model_arguments(p: argparse.ArgumentParser, suite: bool = False, dtype: str = "float32",
                        device: str = "cpu") -> None:
    """The model, its input and where it runs; ``suite``: suite names and ``--batch`` accepted too."""
    if suite:
        p.add_argument("model", help="a benchmark suite model (seedcnn, resnet50, ...: python -m fxopt.bench "
                       "--help) or MODULE:ATTR with --shape")
        p.add_argument("--shape", type=parse_shape, help="input shape, e.g. 1,3,224,224 (suite models: "
                       "default batch,<the model's shape>)")
        p.add_argument("--batch", type=int, default=1, help="batch of a suite model's input (default 1)")
    else:
        p.add_argument("model", help="MODULE:ATTR, e.g. torchvision.models:resnet18")
        p.add_argument("--shape", type=parse_shape, required=True, help="input shape, e.g. 1,3,224,224")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=dtype, help=f"default {dtype}")
    p.add_argument("--device", choices=["cpu", "cuda"], default=device, help=f"default {device}")


def model_and_input(args) -> tuple[torch.nn.Module, torch.Tensor]:
    """The eval-mode model and a random input, on ``args.device`` in ``args.dtype``."""
    dtype = DTYPES[args.dtype]
    if ":" in args.model:
        if args.shape is None:
            raise SystemExit(f"fxopt: {args.model} needs --shape (e.g. --shape 1,3,224,224)")
        model, x = load_model(args.model), torch.randn(args.shape)
    else:
        from fxopt.bench.models import MODELS, build_model, make_input

        if args.model not in MODELS:
            raise SystemExit(f"fxopt: unknown model {args.model!r}: give MODULE:ATTR or one of {', '.join(MODELS)}")
        model, shape = build_model(args.model)
        if getattr(args, "batch", 1) < 1:
            raise SystemExit("fxopt: --batch must be >= 1")
        x = torch.randn(args.shape) if args.shape else make_input(shape, getattr(args, "batch", 1))
    return model.eval().to(device=args.device, dtype=dtype), x.to(device=args.device, dtype=dtype)
