"""Backends that are built once and loaded without ``torch.compile``: ``fxopt-package`` (a package
written by ``fxopt.package`` and run by ``fxopt.load``) and its peer ``aotinductor``
(``torch._inductor.aoti_compile_and_package`` + ``aoti_load_package``).

``prepare`` builds the artefact into a temporary folder and loads it, so the cell's first call
time is build + load + first call. For ``--cold``, ``FXOPT_BENCH_ARTEFACT`` names where the
artefact is written and ``FXOPT_BENCH_LOAD_ONLY=1`` makes ``prepare`` only load it: the fresh
process then times what deploying costs, load + first call (``load_first_call_s``).
"""
from __future__ import annotations

import os
import tempfile

import torch

ARTEFACT_ENV, LOAD_ONLY_ENV = "FXOPT_BENCH_ARTEFACT", "FXOPT_BENCH_LOAD_ONLY"


def _path(suffix: str) -> tuple[str, bool]:
    """(where the artefact goes, whether it is only to be loaded)."""
    path = os.environ.get(ARTEFACT_ENV)
    if path:  # with the backend's suffix (AOTInductor insists on .pt2)
        path += suffix
        return path, os.environ.get(LOAD_ONLY_ENV) == "1" and os.path.exists(path)
    return os.path.join(tempfile.mkdtemp(prefix="fxopt_bench_deploy_"), f"model{suffix}"), False


def prepare_package(model, x, device, dtype, options):
    import fxopt

    from .spec import Prepared

    path, load_only = _path(".fxopt")
    if not load_only:
        fxopt.package(model, (x,), path, options=options)
    module = fxopt.load(path, device=device)
    b = module.manifest["batch"]
    return Prepared(module, x, note=f"fxopt.load of a {os.path.getsize(path) / 2**20:.0f} MiB package "
                    f"({'dynamic' if b['dynamic'] else 'fixed'} batch)")


def prepare_aotinductor(model, x, device, dtype, options):
    from .spec import BackendUnavailable, Prepared

    try:
        from torch._inductor import aoti_compile_and_package, aoti_load_package
    except ImportError as e:
        raise BackendUnavailable(f"AOTInductor not in this torch ({e})")
    path, load_only = _path(".pt2")
    if not load_only:
        with torch.no_grad():
            ep = torch.export.export(model, (x,), strict=False)
        path = aoti_compile_and_package(ep, package_path=path)
    runner = aoti_load_package(path)
    return Prepared(lambda inp: runner(inp), x, tracks_memory=False,
                    note=f"aoti_load_package of a {os.path.getsize(path) / 2**20:.0f} MiB package")
