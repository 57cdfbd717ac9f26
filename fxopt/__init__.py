"""fxopt: a graph-level optimizing compiler for convolutional networks.

    model = torch.compile(model, backend="fxopt")      # no import needed after pip install
    report = fxopt.explain(model, x)                    # what every pass did
"""
from __future__ import annotations

import logging
import os

from fxopt import ops  # noqa: F401  (registers the fxopt:: custom ops)
from fxopt.config import Options
from fxopt.explain import explain
from fxopt.package_file import PackageCorruptError, PackageError, PackageVersionError
from fxopt.pipeline import PASS_NAMES, FxoptFallbackWarning, PassFailure
from fxopt.version import __version__
__all__ = ["__version__", "explain", "export_onnx", "package", "load", "Options", "PASS_NAMES", "FxoptFallbackWarning", "PassFailure",
           "PackageError", "PackageVersionError", "PackageCorruptError"]


def export_onnx(model, example_inputs, path, options=None, dynamic_batch=True):
    """Run the pipeline and write the rewritten graph as ONNX (see fxopt.onnx_export)."""
    from fxopt.onnx_export import export_onnx as _export

    return _export(model, example_inputs, path, options=options, dynamic_batch=dynamic_batch)


def package(model, example_inputs, path, options=None, dynamic_batch=True) -> dict:
    """Optimize `model` and write it to one file that ``fxopt.load`` runs without torch.compile
    (see fxopt.packaging). Returns the package's summary."""
    from fxopt.packaging import package as _package

    return _package(model, example_inputs, path, options=options, dynamic_batch=dynamic_batch)


def load(path, device=None):
    """The package at `path` as a callable module: no Dynamo, nothing measured (see fxopt.packaging)."""
    from fxopt.packaging import load as _load

    return _load(path, device=device)


def _configure_logging() -> None:
    level = os.environ.get("FXOPT_LOG", "").strip().upper()
    if not level:
        return
    logger = logging.getLogger("fxopt")
    logger.setLevel(getattr(logging, level, logging.INFO))
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[fxopt %(levelname)s] %(message)s"))
        logger.addHandler(handler)


_configure_logging()
