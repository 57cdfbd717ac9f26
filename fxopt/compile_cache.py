"""The whole-compile cache: a second process compiling the same graph skips fxopt's passes.

``torch.compile(backend="fxopt")`` pays Dynamo, AOTAutograd and then fxopt's own work: the pass
pipeline (FakeTensor propagation after every rewrite, algorithm choice) and the lowering (kernel
generation, choices). Like Inductor's FX graph cache, fxopt keys the ATen graph AOTAutograd hands
it (its code, every placeholder's shape / strides / dtype / device and whether it is a frozen
parameter, the module paths the options may name, tensor constants' bytes), the options, the kind
of graph, the device fingerprint (GPU, torch, CUDA, cuDNN) and the versions (fxopt's version and a
hash of its source files, torch's). An entry holds the optimized graph (``fxopt.serialize``), the
pass records, the convolution choices and every autotuning entry the pipeline and the lowering
used (``fxopt.choices``). On a hit the optimized graph is read back, its metadata propagated from
AOTAutograd's fake inputs, and lowered with those choices first (the user's autotuning cache for
the rest, e.g. the CUDA-graph runner's decisions): no pass runs and nothing already measured is
measured again. ``report.graphs[i].executor_details["compile_cache"]`` says hit, stored or off.

Entries live in ``$FXOPT_CACHE_DIR/graphs`` (else the user cache dir), one file per key, written
atomically (temporary file + ``os.replace``) with a SHA-256 of their content in the first line: an
entry that does not check, does not parse or does not rebuild is ignored (the graph is compiled
and the entry rewritten), never trusted. Off with the option ``compile_cache=False``, while
``verify`` or ``dump_dir`` ask for the passes to run, and with ``autotune_cache=False`` (measure
afresh: nothing measured earlier is reused). Weights are not in an entry (they may change;
``fold_constants``' weight-only graph is kept as a graph and evaluated from the real parameters).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch
import torch.fx as fx

log = logging.getLogger("fxopt")
ENTRY_FORMAT = b"FXOPT-GRAPH-CACHE 1 "


def cache_dir() -> Path:
    from fxopt.autotune import default_cache_path

    return Path(os.path.dirname(default_cache_path())) / "graphs"


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """A hash of fxopt's own files (passes, executors, templates): an edited checkout is another
    version even where ``__version__`` did not move."""
    import fxopt.backends
    import fxopt.passes

    h = hashlib.sha256()
    roots = {os.path.dirname(os.path.abspath(__file__))}
    roots |= {os.path.dirname(m.__file__) for m in (fxopt.passes, fxopt.backends)}
    for root in sorted(roots):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".cu", ".cuh")):
                    path = os.path.join(folder, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def _meta_of(v) -> object:
    if isinstance(v, torch.Tensor):
        return [str(tuple(v.shape)), str(v.stride()), str(v.dtype), str(v.device), bool(v.requires_grad)]
    return repr(v)


def graph_key(gm: fx.GraphModule, ctx, kind: str) -> str:
    from fxopt.version import __version__
    from fxopt.autotune import device_fingerprint
    from fxopt.passinfra import module_path

    options = {k: v for k, v in dataclasses.asdict(dataclasses.replace(ctx.options, autotune_cache=None)).items()
               if k not in ("autotune_cache", "dump_dir", "verify", "compile_cache")}
    placeholders = [[n.name, _meta_of(n.meta.get("val")), n.name in ctx.const_placeholders,
                     ctx.param_qualnames.get(n.name)] for n in gm.graph.nodes if n.op == "placeholder"]
    attrs = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            v = getattr(gm, n.target, None) if "." not in n.target else gm.get_submodule(
                n.target.rsplit(".", 1)[0]).get_parameter(n.target.rsplit(".", 1)[1])
            if isinstance(v, torch.Tensor):
                raw = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b""
                attrs.append([n.target, _meta_of(v), hashlib.sha256(raw).hexdigest()])
            else:
                attrs.append([n.target, type(v).__name__])
    parts = {"fxopt": __version__, "source": source_hash(), "torch": torch.__version__,
             "device": device_fingerprint(ctx.device_type), "kind": kind, "mode": ctx.mode, "options": options,
             "code": gm.code, "placeholders": placeholders, "attrs": attrs,
             "paths": [module_path(n) for n in gm.graph.nodes if n.op == "call_function"],
             "grad": torch.is_grad_enabled()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def read_entry(path: Path) -> Optional[dict]:
    """The entry at ``path``, or None when absent or not one that checks."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head, _, payload = blob.partition(b"\n")
    if not head.startswith(ENTRY_FORMAT) or hashlib.sha256(payload).hexdigest().encode() != head[len(ENTRY_FORMAT):]:
        log.warning("fxopt: ignoring corrupt compile-cache entry %s", path)
        return None
    try:
        return json.loads(payload)
    except ValueError:
        log.warning("fxopt: ignoring unreadable compile-cache entry %s", path)
        return None


def write_entry(path: Path, entry: dict) -> None:
    payload = json.dumps(entry, separators=(",", ":")).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(ENTRY_FORMAT + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class CompileCache:
    """One graph's passage through the cache: ``run`` the pipeline (or restore it), lower with
    ``ctx.options`` as set here, then ``store``. ``status`` says what happened."""

    def __init__(self, gm: fx.GraphModule, ctx, kind: str):
        from fxopt.autotune import AutotuneCache
        from fxopt.choices import RecordingCache

        self.kind, self.key, self.entry, self.path = kind, None, None, None
        self.user_cache = AutotuneCache.for_option(ctx.options.autotune_cache)
        self.recording = None
        opts = ctx.options
        if not opts.compile_cache or opts.verify or opts.dump_dir or opts.autotune_cache is False:
            self.status = "off" + (" (verify / dump_dir / autotune_cache=False)" if opts.compile_cache else "")
            return
        try:
            self.key = graph_key(gm, ctx, kind)
        except Exception as e:  # noqa: BLE001 - an unhashable graph is simply compiled
            self.status = f"off (no key: {type(e).__name__}: {e})"
            return
        self.path = cache_dir() / self.key[:2] / f"{self.key}.json"
        self.entry = read_entry(self.path)
        self.status = "miss"
        if self.entry is None:  # record what this compile uses, for the entry
            self.recording = RecordingCache(self.user_cache)
            ctx.options = dataclasses.replace(opts, autotune_cache=self.recording)

    def run(self, gm: fx.GraphModule, ctx, fake_args: list, dump_prefix: str = ""):
        """(optimized graph, pass records, fallback): restored from the entry, else the pipeline's."""
        from fxopt.pipeline import run_pipeline

        if self.entry is not None:
            try:
                restored = self._restore(gm, ctx, fake_args)
                self.status = f"hit {self.key[:16]}"
                log.info("fxopt: compile cache hit for the %s graph (%s)", self.kind, self.key[:16])
                return restored
            except Exception as e:  # noqa: BLE001 - an entry that does not rebuild is not trusted
                log.warning("fxopt: ignoring compile-cache entry %s (%s: %s)", self.path, type(e).__name__, e)
                self.entry = None
                from fxopt.choices import RecordingCache

                self.recording = RecordingCache(self.user_cache)
                ctx.options = dataclasses.replace(ctx.options, autotune_cache=self.recording)
        return run_pipeline(gm, ctx, dump_prefix=dump_prefix)

    def _restore(self, gm: fx.GraphModule, ctx, fake_args: list):
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import FakeTensorMode

        from fxopt.autotune import ConvChoice
        from fxopt.choices import FixedChoices
        from fxopt.fakeprop import FakeProp
        from fxopt.report import PassRecord
        from fxopt.serialize import graph_from_json, rebuild_vals

        entry = self.entry
        if entry.get("key") != self.key:
            raise ValueError("entry of another key")
        optimized = graph_from_json(entry["graph"], owner=gm)
        mode = detect_fake_mode(fake_args) or FakeTensorMode(allow_non_fake_inputs=True)
        placeholders = [n for n in optimized.graph.nodes if n.op == "placeholder"]
        if not rebuild_vals(optimized, entry["graph"], mode) or len(placeholders) != len(fake_args):
            with mode, torch.set_grad_enabled(ctx.mode != "inference"):
                FakeProp(optimized, mode).propagate_dont_convert_inputs(*fake_args)
        else:  # AOTAutograd's own fake inputs (same metadata: it is in the key)
            for n, v in zip(placeholders, fake_args):
                n.meta["val"] = v
        records = [PassRecord(**r) for r in entry["records"]]
        ctx.conv_algorithms = {q: ConvChoice(**c) for q, c in entry["conv_algorithms"].items()}
        ctx.options = dataclasses.replace(ctx.options, autotune_cache=FixedChoices(entry["choices"],
                                                                                   fallback=self.user_cache))
        return optimized, records, None

    def store(self, optimized: fx.GraphModule, records: list, fallback, ctx) -> None:
        """Write the entry after a successful miss (a fallback is compiled again next time)."""
        from fxopt.serialize import graph_to_json

        if self.recording is None or self.path is None:
            return
        if fallback is not None:
            self.status = "miss (not stored: the pipeline fell back)"
            return
        try:
            entry = {"key": self.key, "kind": self.kind, "graph": graph_to_json(optimized, vals=True),
                     "records": [dataclasses.asdict(r) for r in records],
                     "conv_algorithms": {q: dataclasses.asdict(c) for q, c in ctx.conv_algorithms.items()},
                     "choices": self.recording.used}
            write_entry(self.path, entry)
            self.status = f"miss (stored {self.key[:16]})"
        except Exception as e:  # noqa: BLE001 - a graph without a JSON form is compiled every time
            self.status = f"miss (not stored: {type(e).__name__}: {e})"
            log.info("fxopt: compile cache: %s", self.status)
