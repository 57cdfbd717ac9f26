"""A public zoo of CNNs: ``fxopt bench --zoo`` (= ``python -m fxopt.bench --zoo``).

Architectures nobody here wrote: timm models built without pretrained weights
(``timm.create_model(name, pretrained=False)``) across the families in use, and torchvision's
segmentation nets at 520x520 (``weights=None, weights_backbone=None``). Every (model, cell) is one
row of the harness (``fxopt.bench.run_benchmark``: the same peers, timing, accuracy check and
tolerances as ``fxopt bench``): fxopt against the peers chosen with ``--peers`` in the same command,
the fastest of them counting. A cell is ``<dtype>-b<batch>``: fp16 at batch 1 and 32 for every
classifier, fp32 at batch 8 for about a third, the segmentation nets at batch 1-2.

The zoo is meant to run in parts (``--part i/n``: every n-th model from the i-th), each within one
command's time limit: a part writes ``zoo.json`` into ``--out`` after every cell, skips the cells
already there when started again (resume), and ``--time-budget S`` stops it from starting new cells
after S seconds. ``fxopt bench --zoo-merge PATH... --out DIR`` merges the parts into one report
(``fxopt.bench.zoo_report``; parts of several sessions too: each cell's latest measurement). A
model its library refuses (unknown name, missing package, a constructor that raises) becomes a
skipped cell with the reason.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shlex
import shutil
import signal
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from fxopt.modelspec import csv_list

__all__ = ["ZOO", "ZooEntry", "PEER_GROUPS", "build_parser", "main", "parse_cell", "run_part", "select"]

CELL_RE = re.compile(r"^(fp16|fp32|bf16)-b([1-9][0-9]*)$")
CELL_DTYPES = {"fp16": "float16", "fp32": "float32", "bf16": "bfloat16"}
CLASSIFIER_CELLS = ("fp16-b1", "fp16-b32")
WITH_FP32 = CLASSIFIER_CELLS + ("fp32-b8",)
SEGMENTATION_CELLS = ("fp16-b1", "fp16-b2", "fp32-b2")
JSON_NAME = "zoo.json"

#: the peers fxopt is compared with: every inference peer of the harness (eager, Inductor default /
#: freezing / reduce-overhead at both cuDNN settings, ONNX Runtime); ``cheap`` for a first pass
PEER_GROUPS: Dict[str, List[str]] = {
    "all": ["eager", "eager-cudnn-default", "inductor", "inductor-cudnn-default", "inductor-freezing",
            "inductor-freezing-cudnn-default", "inductor-reduce-overhead", "inductor-reduce-overhead-cudnn-default",
            "inductor-freezing-reduce-overhead", "inductor-freezing-reduce-overhead-cudnn-default",
            "onnxruntime", "onnxruntime-cudagraph"],
    "cheap": ["eager", "inductor-reduce-overhead", "inductor-freezing-reduce-overhead"],
}
PEER_ALIASES = {"inductor-ro": "inductor-reduce-overhead", "inductor-fro": "inductor-freezing-reduce-overhead",
                "ort": "onnxruntime", "ort-cudagraph": "onnxruntime-cudagraph"}


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    """One architecture: ``source`` is ``timm`` or ``torchvision-seg`` (or anything else with a
    ``factory``), ``family`` a coarse tag, ``input`` the per-sample shape, ``cells`` its cells."""
    name: str
    source: str
    family: str
    input: Tuple[int, int, int] = (3, 224, 224)
    cells: Tuple[str, ...] = CLASSIFIER_CELLS
    factory: Optional[Callable[[], Any]] = None

    @property
    def key(self) -> str:
        """The model's name in the harness and the reports: ``source/name``."""
        return f"{self.source}/{self.name}"


def _timm(name: str, family: str, side: int = 224, fp32: bool = False) -> ZooEntry:
    return ZooEntry(name, "timm", family, (3, side, side), WITH_FP32 if fp32 else CLASSIFIER_CELLS)


def _seg(name: str, family: str = "segmentation") -> ZooEntry:
    return ZooEntry(name, "torchvision-seg", family, (3, 520, 520), SEGMENTATION_CELLS)


#: the zoo: a benchmark list, nothing in fxopt depends on it (names as timm registers them)
ZOO: List[ZooEntry] = [
    _timm("resnet18", "resnet"), _timm("resnet50", "resnet", fp32=True), _timm("resnetv2_50", "resnet"),
    _timm("resnet50d", "resnet-d"), _timm("ecaresnet50d", "resnet-d"),
    _timm("resnext50_32x4d", "resnext", fp32=True), _timm("seresnext50_32x4d", "resnext"),
    _timm("res2net50_26w_4s", "res2net", fp32=True),
    _timm("resnest50d", "resnest"),
    _timm("skresnet34", "sknet"),
    _timm("dpn68", "dpn", fp32=True),
    _timm("densenet121", "densenet", fp32=True),
    _timm("dla34", "dla"),
    _timm("hrnet_w18_small", "hrnet", fp32=True),
    _timm("ese_vovnet19b_dw", "vovnet"), _timm("ese_vovnet39b", "vovnet"),
    _timm("cspresnet50", "csp"), _timm("cspdarknet53", "csp", fp32=True),
    _timm("regnetx_016", "regnet"), _timm("regnety_016", "regnet"), _timm("regnetz_b16", "regnet"),
    _timm("efficientnet_b0", "efficientnet", fp32=True), _timm("efficientnet_b3", "efficientnet", 288),
    _timm("tf_efficientnet_lite0", "efficientnet-lite"),
    _timm("tf_efficientnetv2_s", "efficientnetv2", 300, fp32=True),
    _timm("mobilenetv2_100", "mobilenetv2", fp32=True),
    _timm("mobilenetv3_large_100", "mobilenetv3"), _timm("mobilenetv4_conv_small", "mobilenetv4"),
    _timm("ghostnet_100", "ghostnet"), _timm("ghostnetv2_100", "ghostnet"),
    _timm("rexnet_100", "rexnet"),
    _timm("mixnet_m", "mixnet", fp32=True),
    _timm("mnasnet_100", "mnasnet"), _timm("fbnetc_100", "fbnet"),
    _timm("lcnet_100", "lcnet"),
    _timm("convnext_tiny", "convnext", fp32=True),
    _timm("repvgg_a2", "repvgg"), _timm("mobileone_s1", "mobileone"),
    _timm("inception_v3", "inception", 299, fp32=True), _timm("inception_resnet_v2", "inception", 299),
    _timm("xception41", "xception", 299, fp32=True),
    _timm("eca_nfnet_l0", "nfnet", fp32=True), _timm("nf_resnet50", "nfnet"),
    _timm("selecsls42b", "selecsls"),
    _timm("tresnet_m", "tresnet", fp32=True),
    _timm("gernet_s", "byobnet"), _timm("hgnet_tiny", "hgnet"),
    _seg("deeplabv3_resnet50"), _seg("fcn_resnet50"), _seg("lraspp_mobilenet_v3_large"),
    _seg("deeplabv3_mobilenet_v3_large"),
]


def parse_cell(cell: str) -> Tuple[str, int]:
    """``fp16-b32`` -> ("float16", 32)."""
    m = CELL_RE.match(cell)
    if not m:
        raise ValueError(f"bad cell {cell!r}: expected <fp16|fp32|bf16>-b<batch>, e.g. fp16-b32")
    return CELL_DTYPES[m.group(1)], int(m.group(2))


def factory(entry: ZooEntry) -> Callable[[], Any]:
    """A zero-argument constructor of the entry's model (fresh random weights)."""
    from .models import ModelUnavailable

    if entry.factory is not None:
        return entry.factory

    def build():
        try:
            if entry.source == "timm":
                import timm

                return timm.create_model(entry.name, pretrained=False)
            if entry.source == "torchvision-seg":
                from torchvision.models import segmentation

                return getattr(segmentation, entry.name)(weights=None, weights_backbone=None)
        except ImportError as exc:
            raise ModelUnavailable(f"{entry.source.split('-')[0]} not importable ({exc})") from exc
        raise ModelUnavailable(f"unknown source {entry.source!r}")

    build.__name__ = f"zoo_{entry.name}"
    return build


@contextlib.contextmanager
def registered(entries: Sequence[ZooEntry]) -> Iterator[None]:
    """The entries in the harness's model registry (``fxopt.bench.models.MODELS``) under their keys."""
    from . import models as M

    saved = {e.key: M.MODELS.get(e.key) for e in entries}
    for e in entries:
        M.MODELS[e.key] = M.ModelSpec(factory(e), e.input, f"{e.source} {e.name} ({e.family})")
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                M.MODELS.pop(k, None)
            else:
                M.MODELS[k] = v


def expand_peers(text: str) -> List[str]:
    """``--peers``: group names (all, cheap), aliases (inductor-ro, inductor-fro, ort) and backends."""
    out: List[str] = []
    for p in csv_list(text):
        out += PEER_GROUPS.get(p, [PEER_ALIASES.get(p, p)])
    return list(dict.fromkeys(out))


def select(zoo: Sequence[ZooEntry], models: Optional[str] = None, cells: Optional[str] = None,
           part: Tuple[int, int] = (0, 1)) -> List[Tuple[ZooEntry, str]]:
    """The (entry, cell) pairs of part ``i/n`` (every n-th model from the i-th, in the zoo's order)
    of the models named (a name or a ``source/name`` key) and the cells named (``fp16-b32``, or a
    dtype ``fp16`` for all of its cells)."""
    entries = list(zoo)
    if models:
        want = csv_list(models)
        known = {e.name for e in entries} | {e.key for e in entries}
        bad = [m for m in want if m not in known]
        if bad:
            raise ValueError(f"not in the zoo: {', '.join(bad)} (fxopt bench --zoo --list)")
        entries = [e for e in entries if e.name in want or e.key in want]
    i, n = part
    entries = entries[i::n]
    toks = csv_list(cells) if cells else None
    return [(e, c) for e in entries for c in e.cells
            if toks is None or c in toks or c.split("-")[0] in toks]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fxopt bench --zoo", description=__doc__.split("\n\n")[0],
                                epilog="Cells: " + ", ".join(CLASSIFIER_CELLS) + " for every classifier, "
                                "fp32-b8 for a third of them; segmentation: " + ", ".join(SEGMENTATION_CELLS))
    p.add_argument("--list", action="store_true", help="print the zoo (and, where timm is importable, "
                   "whether it knows each name) and exit")
    p.add_argument("--part", default="0/1", metavar="I/N", help="every N-th model from the I-th (0 <= I < N)")
    p.add_argument("--models", help="comma list of zoo names (default: the whole zoo)")
    p.add_argument("--cells", help="comma list of cells (fp16-b1,fp16-b32,fp32-b8,...) or dtypes (fp16,fp32); "
                   "default: each model's own")
    p.add_argument("--peers", default="all", help="comma list of peers, groups (all: " + ",".join(PEER_GROUPS["all"])
                   + "; cheap: " + ",".join(PEER_GROUPS["cheap"]) + ") or aliases ("
                   + ", ".join(f"{k}={v}" for k, v in PEER_ALIASES.items()) + "); default all")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cuda if available")
    p.add_argument("--time-budget", type=float, metavar="S", help="start no new cell after S seconds")
    p.add_argument("--out", default="zoo_out", help="the part's directory (zoo.json, zoo.md, zoo.png)")
    p.add_argument("--skip-measured", nargs="+", metavar="PATH", help="leave out the cells measured (with a "
                   "speed-up) in earlier runs: their zoo.json / *.json.gz files, or folders holding them")
    p.add_argument("--zoo-merge", nargs="+", metavar="PATH", help="measure nothing: merge the parts (DIR/zoo.json, "
                   "or zoo.json / *.json.gz files) into one report in --out, each cell's latest measurement")
    p.add_argument("--fxopt-options", metavar="JSON", help="passed to the fxopt backend (as fxopt bench)")
    p.add_argument("--variants", default="", help="comma list of fxopt variants timed in the same rows (e.g. "
                   "fxopt-streams; --fxopt-options apply to them too): each cell records their times against "
                   "fxopt's; the speed-up stays fxopt's over the best peer")
    for opt in ("--warmup", "--iters", "--rounds"):
        p.add_argument(opt, type=int, help=f"as fxopt bench {opt}")
    p.add_argument("--same-thread", action="store_true", help="as fxopt bench --same-thread")
    p.add_argument("--seed", type=int, default=0)
    return p


def _harness_argv(a: argparse.Namespace, key: str, cell: str, backends: List[str], scratch: str) -> List[str]:
    dtype, batch = parse_cell(cell)
    argv = ["--device", a.device, "--models", key, "--batch", str(batch), "--dtype", dtype,
            "--backends", ",".join(backends), "--out", scratch, "--seed", str(a.seed)]
    for opt in ("warmup", "iters", "rounds"):
        if getattr(a, opt) is not None:
            argv += [f"--{opt}", str(getattr(a, opt))]
    if a.fxopt_options:
        argv += ["--fxopt-options", a.fxopt_options]
    if a.same_thread:
        argv.append("--same-thread")
    return argv


def _finite(v) -> bool:
    try:
        return math.isfinite(float(v))
    except (TypeError, ValueError):
        return False


def cell_record(entry: ZooEntry, cell: str, results: Dict[str, Any], fx: str = "fxopt") -> Dict[str, Any]:
    """One zoo cell from the harness's results of its row: status ok (a speed-up), skipped (the
    model was not built) or failed (fxopt or every peer did not run), best peer, accuracy."""
    from .report import speedups

    dtype, batch = parse_cell(cell)
    rec: Dict[str, Any] = {"model": entry.key, "name": entry.name, "source": entry.source, "family": entry.family,
                           "cell": cell, "dtype": dtype, "batch": batch, "input": list(entry.input),
                           "status": "ok", "reason": None}
    cells = [c for c in results.get("cells", []) if c["model"] == entry.key]
    if cells and all(c["status"] == "error" and str(c.get("error")).startswith("model: ") for c in cells):
        return {**rec, "status": "skipped", "reason": cells[0]["error"][len("model: "):]}
    sp = speedups(results).get((entry.key, batch, dtype), {})
    got = sp.get("fxopt", {}).get(fx)
    rec.update(best_peer=sp.get("best_peer"), best_peer_ms=sp.get("best_peer_ms"),
               peers_ok=sorted(c["backend"] for c in cells if c["status"] == "ok" and c["backend"] != fx))
    # a peer that ran into an error is no peer of this cell: its speed-up is over the peers that ran
    # (the report names the failed ones beside it, and counts such cells)
    rec["peers_failed"] = {c["backend"]: str(c.get("error"))[:200] for c in cells
                           if c["status"] == "error" and c["backend"] != fx and not _is_variant(c["backend"])}
    fxc = next((c for c in cells if c["backend"] == fx), {})
    rec["fxopt_ms"] = fxc.get("median_ms") if fxc.get("status") == "ok" else None
    chk = next((c for c in results.get("checks", []) if c["model"] == entry.key and c["backend"] == fx), None)
    if chk:
        rec.update(accuracy_ok=chk["ok"], max_rel_err=chk.get("max_rel_err"), tol=chk.get("tol"))
        if not chk["ok"]:
            rec["accuracy_reason"] = chk.get("reason")
        elif not _finite(chk.get("tol")):  # the bound is 4x eager's own error, and eager's is not finite
            rec.update(accuracy_ok=None, accuracy_reason="not checkable: eager's own result in this dtype is not "
                                                         "finite (random weights overflow), so the bound is inf")
    if fxc.get("fallback"):
        rec["fxopt_fallback"] = fxc["fallback"]
    if fxc.get("status") != "ok":
        return {**rec, "status": "failed", "reason": f"{fx} {fxc.get('status', 'missing')}: {fxc.get('error')}"}
    if not rec["best_peer"]:
        errs = "; ".join(f"{c['backend']}: {c.get('error')}" for c in cells if c["backend"] != fx)
        return {**rec, "status": "failed", "reason": f"no peer ran ({errs[:300]})"}
    rec.update(speedup=got["over_best"], paired_speedup=got.get("paired_over_best"))
    variants = {c["backend"]: c for c in cells if _is_variant(c["backend"]) and c["backend"] != fx}
    if variants:  # --variants: each one's time and fxopt's time over it (> 1: the variant is faster)
        rec["variants"] = {b: {"ms": c.get("median_ms"), "status": c["status"],
                               "over_fxopt": rec["fxopt_ms"] / c["median_ms"] if c.get("median_ms") else None}
                           for b, c in variants.items()}
    return rec


def _new_doc(a: argparse.Namespace, argv: Sequence[str], backends: List[str]) -> Dict[str, Any]:
    from .environment import _device_info, _versions

    meta = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": "fxopt bench --zoo " + shlex.join(argv), "device_type": a.device, **_device_info(a.device),
            "versions": _versions(), "cudnn.benchmark": a.device == "cuda",
            "fxopt_options": json.loads(a.fxopt_options) if a.fxopt_options else {},
            "config": {"part": a.part, "models": a.models, "cells": a.cells, "backends": backends, "seed": a.seed}}
    return {"meta": meta, "peak": {}, "flops": {}, "cells": [], "checks": [], "errors_logged": 0, "zoo": []}


def measured_cells(paths: Sequence[str]) -> set:
    """(model key, cell) of every cell that has a speed-up in the zoo results under ``paths`` (a
    part's zoo.json, a gzipped copy, or a folder searched for ``zoo*.json`` / ``zoo*.json.gz``)."""
    import glob
    import gzip

    files = []
    for p in paths:
        if os.path.isdir(p):
            files += [f for pat in ("zoo*.json", "zoo*.json.gz")
                      for f in glob.glob(os.path.join(p, "**", pat), recursive=True)]
        elif os.path.exists(p):
            files.append(p)
        else:
            raise ValueError(f"--skip-measured: no such file or folder: {p}")
    out = set()
    for f in sorted(set(files)):
        with (gzip.open(f, "rt") if f.endswith(".gz") else open(f)) as fh:
            doc = json.load(fh)
        out |= {(r["model"], r["cell"]) for r in doc.get("zoo", []) if r.get("speedup") is not None}
    return out


def run_part(a: argparse.Namespace, argv: Sequence[str], zoo: Sequence[ZooEntry], B) -> Dict[str, Any]:
    """Measure the part's cells not yet in ``--out``/zoo.json, one harness row each (``B``: the
    harness, ``fxopt.bench``, with ``parse_args`` and ``run_benchmark``), writing the file after
    every cell; stops at the time budget or a SIGTERM/Ctrl-C (the cell under way is lost)."""
    from .zoo_report import write_atomic

    i, n = (int(v) for v in a.part.split("/"))
    todo = select(zoo, a.models, a.cells, (i, n))
    backends = expand_peers(a.peers) + ["fxopt"] + csv_list(a.variants or "")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, JSON_NAME)
    if os.path.exists(path):
        with open(path) as f:
            doc = json.load(f)
        doc["meta"].setdefault("resumed", []).append(
            {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
             "command": "fxopt bench --zoo " + shlex.join(argv)})
    else:
        doc = _new_doc(a, argv, backends)
    done = {(r["model"], r["cell"]) for r in doc["zoo"]} | getattr(a, "measured", set())
    todo = [(e, c) for e, c in todo if (e.key, c) not in done]
    scratch = os.path.join(a.out, "cell")
    t0 = time.perf_counter()
    left, stop = list(todo), None
    try:
        with registered([e for e, _ in todo]):
            if todo:  # the harness checks the options (peers, counts) before anything runs
                B.parse_args(_harness_argv(a, todo[0][0].key, todo[0][1], backends, scratch))
            for entry, cell in todo:
                if a.time_budget and time.perf_counter() - t0 > a.time_budget:
                    stop = "time budget"
                    break
                print(f"[zoo] {entry.key} {cell} ({len(todo) - len(left) + 1}/{len(todo)})", file=sys.stderr,
                      flush=True)
                hargv = _harness_argv(a, entry.key, cell, backends, scratch)
                t_cell = time.perf_counter()
                res = B.run_benchmark(B.parse_args(hargv), hargv)
                _keep_errors(scratch, a.out, entry.key, cell)
                if res["meta"].get("interrupted"):  # the cell under way is not kept
                    stop = "interrupted"
                    break
                _add_cell(doc, cell_record(entry, cell, res), res, time.perf_counter() - t_cell)
                write_atomic(doc, path)
                left.pop(0)
    except KeyboardInterrupt:
        stop = "interrupted"
    doc["meta"]["interrupted"] = stop == "interrupted"
    doc["meta"]["stopped"] = stop
    doc["left"] = [f"{e.key} {c}" for e, c in left]
    write_atomic(doc, path)
    shutil.rmtree(scratch, ignore_errors=True)
    return doc


def _add_cell(doc: Dict[str, Any], rec: Dict[str, Any], res: Dict[str, Any], wall_s: float) -> None:
    """A measured cell into the part: its zoo record and the harness's cells, checks and FLOPs."""
    rec["wall_s"] = round(wall_s, 1)
    hm = res["meta"]
    rec["peers"] = [b for b in hm["config"]["backends"] if _is_peer(b)]
    doc["meta"]["config"].update({k: hm["config"][k] for k in ("warmup", "iters", "rounds", "rewarm")})
    doc["meta"]["backend_threads"] = hm.get("backend_threads")
    doc["meta"]["fxopt_available"] = hm.get("fxopt_available")
    doc["cells"] += [{k: v for k, v in c.items() if k != "samples_ms"} for c in res["cells"]]
    doc["checks"] += res["checks"]
    doc["flops"].update(res["flops"])
    doc["peak"].update({k: v for k, v in res["peak"].items() if k not in doc["peak"]})
    doc["errors_logged"] += res.get("errors_logged", 0)
    doc["zoo"].append(rec)
    doc["meta"]["wall_s"] = round(doc["meta"].get("wall_s", 0) + rec["wall_s"], 2)


def _keep_errors(scratch: str, out: str, key: str, cell: str) -> None:
    """The harness's errors.log of a cell, appended to the part's."""
    log = os.path.join(scratch, "errors.log")
    if os.path.exists(log):
        with open(log) as src, open(os.path.join(out, "errors.log"), "a") as dst:
            dst.write(f"==== {key} {cell}\n{src.read()}\n")
        os.remove(log)


def list_zoo(zoo: Sequence[ZooEntry]) -> str:
    try:
        import timm

        known = set(timm.list_models())
        head = f"timm {timm.__version__}"
    except Exception:
        known, head = None, "timm not importable: names not checked"
    lines = [f"{'model':44} {'family':18} {'input':12} cells" + ("  timm knows it" if known is not None else "")]
    for e in zoo:
        mark = ("  yes" if e.name in known else "  NO") if known is not None and e.source == "timm" else ""
        lines.append(f"{e.key:44} {e.family:18} {'x'.join(map(str, e.input)):12} {','.join(e.cells)}{mark}")
    n_timm = sum(e.source == "timm" for e in zoo)
    lines.append(f"{len(zoo)} models ({n_timm} timm, {len(zoo) - n_timm} other), "
                 f"{sum(len(e.cells) for e in zoo)} cells, {len({e.family for e in zoo})} families; {head}")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None, zoo: Optional[Sequence[ZooEntry]] = None, harness=None) -> int:
    """``fxopt bench --zoo``; ``harness``: ``fxopt.bench`` (which calls this with itself, so that
    this module does not import its package)."""
    from .zoo_report import merge_parts, write_zoo_reports

    argv = [x for x in (sys.argv[1:] if argv is None else argv) if x != "--zoo"]
    zoo = ZOO if zoo is None else zoo
    p = build_parser()
    a = p.parse_args(argv)
    if a.list:
        sys.stdout.write(list_zoo(zoo))
        return 0
    if a.zoo_merge:
        try:
            doc = merge_parts(a.zoo_merge)
        except (OSError, ValueError) as exc:  # a part without zoo.json, parts from different devices
            p.error(f"--zoo-merge: {exc}")
        paths = write_zoo_reports(doc, a.out)
        print(f"merged {len(a.zoo_merge)} parts into {a.out}: {len(doc['zoo'])} cells", file=sys.stderr)
        return 0
    if not re.match(r"^\d+/[1-9]\d*$", a.part) or int(a.part.split("/")[0]) >= int(a.part.split("/")[1]):
        p.error(f"--part {a.part}: expected I/N with 0 <= I < N")
    try:
        select(zoo, a.models, a.cells)
        a.measured = measured_cells(a.skip_measured or [])  # --skip-measured, read once
    except (ValueError, OSError) as exc:  # (a results file that is not JSON: json's ValueError)
        p.error(str(exc))
    bad = [b for b in expand_peers(a.peers) if not _is_peer(b)]
    if bad:
        p.error(f"not a peer: {', '.join(bad)}")
    bad = [b for b in csv_list(a.variants or "") if not _is_variant(b)]
    if bad:
        p.error(f"not an fxopt variant: {', '.join(bad)}")
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"

    def _on_term(signum, frame):  # a killed part keeps the cells it finished
        raise KeyboardInterrupt
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, _on_term)
    doc = run_part(a, argv, zoo, harness)
    paths = write_zoo_reports(doc, a.out)
    if doc["left"]:
        print(f"{len(doc['left'])} cells left: run the same command again to go on", file=sys.stderr)
    print(f"wrote {', '.join(v for k, v in paths.items() if k != 'png_error')}", file=sys.stderr)
    if "png_error" in paths:
        print(paths["png_error"], file=sys.stderr)
    return 130 if doc["meta"].get("interrupted") else 0


def _is_variant(backend: str) -> bool:
    from .peers import BACKENDS

    spec = BACKENDS.get(backend)
    return spec is not None and spec.is_fxopt and backend != "fxopt"


def _is_peer(backend: str) -> bool:
    from .peers import BACKENDS

    spec = BACKENDS.get(backend)
    return spec is not None and not spec.is_fxopt and not backend.startswith("floor-")
