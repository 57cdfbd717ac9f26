"""CPU tests of the zoo benchmark (fxopt.bench.zoo, fxopt.bench.zoo_report): the table, part
selection, a part measured with eager and fxopt on tiny models, resume, merge, the statistics
against hand-computed values and the chart."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch import nn

import fxopt.bench as B
from fxopt.bench import peers as P
from fxopt.bench import zoo as Z
from fxopt.bench import zoo_report as ZR


class _Tiny(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _refused():
    raise RuntimeError("Unknown model (no_such_net)")


FAKE = [Z.ZooEntry("tiny_a", "test", "tiny", (3, 8, 8), ("fp32-b1", "fp32-b2"), _Tiny),
        Z.ZooEntry("tiny_b", "test", "tiny", (3, 8, 8), ("fp32-b1",), lambda: _Tiny(4)),
        Z.ZooEntry("no_such_net", "test", "tiny", (3, 8, 8), ("fp32-b1",), _refused)]
CPU = ["--device", "cpu", "--peers", "eager"]


def _doc(out):
    with open(os.path.join(out, "zoo.json")) as f:
        return json.load(f)


# --------------------------------------------------------------------------
# the zoo table
# --------------------------------------------------------------------------
FAMILIES = {"resnet", "resnet-d", "resnext", "res2net", "resnest", "sknet", "dpn", "densenet", "dla", "hrnet",
            "vovnet", "csp", "regnet", "efficientnet", "efficientnet-lite", "efficientnetv2", "mobilenetv2",
            "mobilenetv3", "ghostnet", "rexnet", "mixnet", "mnasnet", "fbnet", "lcnet", "convnext", "repvgg",
            "inception", "xception", "nfnet", "selecsls", "tresnet", "segmentation"}


def test_zoo_table_is_broad_and_well_formed():
    timm = [e for e in Z.ZOO if e.source == "timm"]
    seg = [e for e in Z.ZOO if e.source == "torchvision-seg"]
    assert len(timm) >= 40
    assert {"deeplabv3_resnet50", "fcn_resnet50", "lraspp_mobilenet_v3_large"} <= {e.name for e in seg}
    assert FAMILIES <= {e.family for e in Z.ZOO}, FAMILIES - {e.family for e in Z.ZOO}
    assert len({e.key for e in Z.ZOO}) == len(Z.ZOO)
    for e in Z.ZOO:
        assert e.family and e.factory is None and len(e.input) == 3 and e.input[0] == 3
        assert e.cells and len(set(e.cells)) == len(e.cells)
        for c in e.cells:
            dtype, batch = Z.parse_cell(c)
            assert dtype in ("float16", "float32") and batch >= 1
    for e in timm:
        assert {"fp16-b1", "fp16-b32"} <= set(e.cells) <= {"fp16-b1", "fp16-b32", "fp32-b8"}
    for e in seg:
        assert e.input == (3, 520, 520) and max(Z.parse_cell(c)[1] for c in e.cells) <= 2
    fp32 = sum("fp32-b8" in e.cells for e in timm)
    assert abs(fp32 - len(timm) / 3) <= 2


def test_peers_groups_and_aliases():
    assert Z.expand_peers("eager,inductor-ro") == ["eager", "inductor-reduce-overhead"]
    assert Z.expand_peers("cheap,inductor-fro")[-1] == "inductor-freezing-reduce-overhead"
    for name in Z.PEER_GROUPS["all"]:
        assert name in P.BACKENDS and Z._is_peer(name)
    assert not Z._is_peer("fxopt") and not Z._is_peer("floor-aot-eager")
    for name in ("inductor-cudnn-default", "inductor-freezing-cudnn-default"):
        assert not P.BACKENDS[name].default  # the harness's default suite keeps its peers


def test_parts_split_the_zoo_and_cells_filter():
    parts = [Z.select(Z.ZOO, part=(i, 3)) for i in range(3)]
    keys = [(e.key, c) for p in parts for e, c in p]
    assert len(keys) == len(set(keys)) == sum(len(e.cells) for e in Z.ZOO)
    fp16 = Z.select(Z.ZOO, cells="fp16")
    assert fp16 and all(c.startswith("fp16-") for _, c in fp16)
    only = Z.select(Z.ZOO, models="resnet50,timm/convnext_tiny", cells="fp32-b8")
    assert [(e.name, c) for e, c in only] == [("resnet50", "fp32-b8"), ("convnext_tiny", "fp32-b8")]
    with pytest.raises(ValueError, match="not in the zoo"):
        Z.select(Z.ZOO, models="resnet5O")
    with pytest.raises(ValueError):
        Z.parse_cell("fp16-32")


def test_harness_argv_passes_the_thread_choice_on():
    a = Z.build_parser().parse_args(["--device", "cuda", "--same-thread"])
    argv = Z._harness_argv(a, "resnet50", "fp16-b1", ["eager", "fxopt"], "/tmp/x")
    assert argv[-1] == "--same-thread" and B.parse_args(argv).backend_threads is False
    a = Z.build_parser().parse_args(["--device", "cuda"])
    argv = Z._harness_argv(a, "resnet50", "fp16-b1", ["eager", "fxopt"], "/tmp/x")
    assert "--same-thread" not in argv and B.parse_args(argv).backend_threads is True


def test_list_and_cli_wiring(capsys):
    from fxopt.cli import main as cli_main

    assert cli_main(["bench", "--zoo", "--list"]) == 0
    out = capsys.readouterr().out
    assert "timm/resnet50" in out and "torchvision-seg/deeplabv3_resnet50" in out and "3x520x520" in out


# --------------------------------------------------------------------------
# a part on the CPU, resume, merge
# --------------------------------------------------------------------------
def test_part_resume_and_merge(tmp_path, monkeypatch):
    p0, p1, merged = (str(tmp_path / d) for d in ("p0", "p1", "merged"))
    # part 0/2: tiny_a (two cells) and the refused model; part 1/2: tiny_b
    assert Z.main(["--zoo", *CPU, "--part", "0/2", "--out", p0], zoo=FAKE, harness=B) == 0
    doc = _doc(p0)
    recs = {(r["name"], r["cell"]): r for r in doc["zoo"]}
    assert set(recs) == {("tiny_a", "fp32-b1"), ("tiny_a", "fp32-b2"), ("no_such_net", "fp32-b1")}
    for cell in ("fp32-b1", "fp32-b2"):
        r = recs[("tiny_a", cell)]
        assert r["status"] == "ok" and r["best_peer"] == "eager" and r["accuracy_ok"] is True
        assert r["speedup"] == pytest.approx(r["best_peer_ms"] / r["fxopt_ms"])
        assert r["peers"] == ["eager"] and r["tol"] == pytest.approx(1e-4)
    skipped = recs[("no_such_net", "fp32-b1")]
    assert skipped["status"] == "skipped" and "Unknown model (no_such_net)" in skipped["reason"]
    assert {c["backend"] for c in doc["cells"] if c["model"] == "test/tiny_a"} == {"eager", "fxopt"}
    assert doc["left"] == [] and not doc["meta"]["interrupted"]
    for name in ("zoo.md", "zoo.png", "results.md"):
        assert os.path.getsize(os.path.join(p0, name)) > 0
    assert "skipped" in open(os.path.join(p0, "zoo.md")).read()

    # resume: every cell of part 0 is there, nothing runs again
    def no_run(*a, **k):
        raise AssertionError("a finished cell ran again")
    monkeypatch.setattr(B, "run_benchmark", no_run)
    assert Z.main([*CPU, "--part", "0/2", "--out", p0], zoo=FAKE, harness=B) == 0
    again = _doc(p0)
    assert len(again["zoo"]) == 3 and len(again["meta"]["resumed"]) == 1
    monkeypatch.undo()

    assert Z.main([*CPU, "--part", "1/2", "--out", p1], zoo=FAKE, harness=B) == 0
    assert B.main(["--zoo-merge", p0, p1, "--out", merged]) == 0
    m = _doc(merged)
    assert sorted((r["name"], r["cell"]) for r in m["zoo"]) == [
        ("no_such_net", "fp32-b1"), ("tiny_a", "fp32-b1"), ("tiny_a", "fp32-b2"), ("tiny_b", "fp32-b1")]
    assert len(m["meta"]["runs"]) == 2
    s = m["summary"]
    sp = [r["speedup"] for r in m["zoo"] if r["status"] == "ok"]
    assert s["counted"] == 3 and s["skipped"] == 1
    assert s["geomean"] == pytest.approx(math.prod(sp) ** (1 / 3))
    assert s["min"] == pytest.approx(min(sp)) and s["below_1"] == sum(x < 1 for x in sp)
    md = open(os.path.join(merged, "zoo.md")).read()
    assert "test/tiny_b" in md and "geometric mean" in md
    with open(os.path.join(merged, "zoo.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _fake_results(key, batch, dtype, ms, fx_ms, interrupted=False):
    cells = [{"model": key, "batch": batch, "dtype": dtype, "backend": b, "status": "ok", "median_ms": t,
              "max_rel_err": 1e-6} for b, t in (("eager", ms), ("fxopt", fx_ms))]
    chk = [{"model": key, "batch": batch, "dtype": dtype, "backend": "fxopt", "ok": True, "tol": 1e-4,
            "max_rel_err": 1e-6}]
    meta = {"interrupted": interrupted, "config": {"warmup": 1, "iters": 1, "rounds": 1, "rewarm": 1,
                                                   "backends": ["eager", "fxopt"]}}
    return {"meta": meta, "peak": {}, "flops": {}, "cells": cells, "checks": chk}


def test_time_budget_and_interruption_keep_what_was_measured(tmp_path, monkeypatch):
    out = str(tmp_path / "p")
    calls, cut_at = [], [2]

    def fake_run(a, argv):
        calls.append(a.models[0])
        return _fake_results(a.models[0], a.batch[0], a.dtype[0], 2.0, 1.0, interrupted=len(calls) == cut_at[0])
    monkeypatch.setattr(B, "run_benchmark", fake_run)
    # the second cell is cut off (SIGTERM): the first is kept, the second is left for the next call
    assert Z.main([*CPU, "--out", out], zoo=FAKE, harness=B) == 130
    doc = _doc(out)
    assert [(r["name"], r["cell"], r["speedup"]) for r in doc["zoo"]] == [("tiny_a", "fp32-b1", 2.0)]
    assert doc["meta"]["interrupted"] and doc["left"][0] == "test/tiny_a fp32-b2"
    # a budget already spent starts nothing
    assert Z.main([*CPU, "--out", out, "--time-budget", "1e-9"], zoo=FAKE, harness=B) == 0
    assert len(calls) == 2 and _doc(out)["meta"]["stopped"] == "time budget"
    # resumed: the rest only
    calls.clear()
    cut_at[0] = 0
    assert Z.main([*CPU, "--out", out], zoo=FAKE, harness=B) == 0
    assert calls == ["test/tiny_a", "test/tiny_b", "test/no_such_net"]
    assert len(_doc(out)["zoo"]) == 4 and _doc(out)["left"] == []


# --------------------------------------------------------------------------
# statistics and chart
# --------------------------------------------------------------------------
def _rec(model, cell, speedup, status="ok", accuracy_ok=True):
    return {"model": model, "cell": cell, "status": status, "speedup": speedup, "accuracy_ok": accuracy_ok,
            "best_peer": "eager", "input": [3, 8, 8]}


RECS = [_rec("a", "fp16-b1", 2.0), _rec("a", "fp16-b32", 0.5), _rec("b", "fp16-b1", 1.0),
        _rec("b", "fp16-b32", 4.0), _rec("c", "fp32-b8", 0.8),
        _rec("d", "fp16-b1", 10.0, accuracy_ok=False),          # wrong outputs: not counted
        _rec("e", "fp16-b1", None, status="skipped", accuracy_ok=None),
        _rec("f", "fp16-b1", None, status="failed", accuracy_ok=None)]


def test_summary_against_hand_computed_values():
    s = ZR.summarize(RECS)
    # (2 * 0.5 * 1 * 4 * 0.8) ** (1/5) = 3.2 ** 0.2
    assert s["geomean"] == pytest.approx(1.2619146889603865)
    assert s["min"] == 0.5 and s["min_cell"] == "a fp16-b32" and s["max"] == 4.0
    assert s["below_1"] == 2 and s["counted"] == 5
    assert (s["cells"], s["ok"], s["skipped"], s["failed"], s["accuracy_failed"]) == (8, 6, 1, 1, 1)
    assert [r["speedup"] for r in s["lowest"]] == [0.5, 0.8, 1.0, 2.0, 4.0]
    assert s["by_cell"]["fp16-b1"] == {"n": 2, "geomean": pytest.approx(2 ** 0.5), "below_1": 0}
    assert s["by_cell"]["fp16-b32"]["geomean"] == pytest.approx(1.4142135623730951)
    assert ZR.geomean([]) is None


def test_report_and_chart(tmp_path):
    doc = {"meta": {"device_name": "test", "device_type": "cuda", "config": {}}, "zoo": RECS,
           "left": ["x/y fp16-b1"]}
    md = ZR.render_zoo_markdown(doc)
    assert "**1.26×** over 5 cells" in md and "cells below 1.0×: **2** of 5" in md
    assert "Not measured yet: x/y fp16-b1" in md and "| a |  | fp16-b32 | 3x8x8 | eager |" in md
    path = ZR.write_chart(doc, str(tmp_path / "zoo.png"))
    assert os.path.getsize(path) > 1000
    empty = ZR.write_chart({"meta": {}, "zoo": []}, str(tmp_path / "empty.png"))
    assert os.path.getsize(empty) > 0


def test_a_cell_whose_eager_result_is_not_finite_is_not_checkable():
    """Random weights can overflow eager's own float16 result; the bound (4x eager's error) is then
    inf and 'inf <= inf' checks nothing: the cell says its accuracy is not checkable."""
    from fxopt.bench.zoo import ZooEntry, cell_record

    entry = ZooEntry("tiny", "test", "tiny", (3, 8, 8), ("fp16-b1",))
    res = _fake_results(entry.key, 1, "float16", 2.0, 1.0)
    ok = cell_record(entry, "fp16-b1", res)
    assert ok["accuracy_ok"] is True and ok["speedup"] == pytest.approx(2.0)
    res["checks"][0].update(tol=float("inf"), max_rel_err=float("inf"))
    rec = cell_record(entry, "fp16-b1", res)
    assert rec["accuracy_ok"] is None and rec["accuracy_reason"].startswith("not checkable")
    assert ZR._accuracy(rec) == "not checkable"
    s = ZR.summarize([rec, ok])
    assert s["accuracy_unchecked"] == 1 and s["counted"] == 2  # still timed, its accuracy unknown
    md = ZR.render_zoo_markdown({"meta": {"config": {}}, "zoo": [rec, ok]})
    assert "1 whose accuracy is not checkable" in md


def test_a_cell_names_the_peers_that_failed_and_the_report_counts_it():
    """A peer that ran into an error (Inductor's CUDA-graph trees on a thread without their state)
    is no peer of the cell: its speed-up is over the peers that ran, and the note and the summary
    say that a peer failed, so that such a speed-up is not read as one over every peer."""
    from fxopt.bench.zoo import ZooEntry, cell_record

    entry = ZooEntry("tiny", "test", "tiny", (3, 8, 8), ("fp16-b1",))
    res = _fake_results(entry.key, 1, "float16", 2.0, 1.0)
    assert cell_record(entry, "fp16-b1", res)["peers_failed"] == {}
    res["cells"].append({**res["cells"][0], "backend": "inductor-fro", "status": "error", "median_ms": None,
                         "error": "AssertionError: "})
    rec = cell_record(entry, "fp16-b1", res)
    assert rec["speedup"] == pytest.approx(2.0) and rec["peers_failed"] == {"inductor-fro": "AssertionError: "}
    s = ZR.summarize([rec])
    assert s["peer_failed"] == 1 and s["counted"] == 1
    md = ZR.render_zoo_markdown({"meta": {"config": {}}, "zoo": [rec]})
    assert "peer failed: inductor-fro (AssertionError)" in md and "1 measured while a peer failed" in md


def test_variants_are_timed_beside_fxopt_not_as_peers(capsys, tmp_path):
    """--variants: fxopt variants in the same rows, each with its time and fxopt's time over it; the
    speed-up stays fxopt's over the best peer; a peer or an unknown name is refused as a variant, and
    a variant as a peer."""
    from fxopt.bench.zoo import ZooEntry, cell_record

    entry = ZooEntry("tiny", "test", "tiny", (3, 8, 8), ("fp16-b1",))
    res = _fake_results(entry.key, 1, "float16", 2.0, 1.0)
    res["cells"].append({**res["cells"][1], "backend": "fxopt-streams", "median_ms": 0.8})
    rec = cell_record(entry, "fp16-b1", res)
    assert rec["speedup"] == pytest.approx(2.0) and rec["best_peer"] == "eager"
    assert rec["variants"] == {"fxopt-streams": {"ms": 0.8, "status": "ok", "over_fxopt": pytest.approx(1.25)}}
    assert "variants" not in cell_record(entry, "fp16-b1", _fake_results(entry.key, 1, "float16", 2.0, 1.0))
    for argv, message in ((["--variants", "eager"], "not an fxopt variant: eager"),
                          (["--variants", "fxopt-nope"], "not an fxopt variant: fxopt-nope"),
                          (["--peers", "fxopt-streams"], "not a peer: fxopt-streams")):
        with pytest.raises(SystemExit):
            Z.main(["--zoo", "--device", "cpu", "--models", "tiny_a", *argv], zoo=FAKE, harness=B)
        assert message in capsys.readouterr().err
    out = str(tmp_path / "v")
    assert Z.main(["--zoo", *CPU, "--models", "tiny_b", "--variants", "fxopt-no-fusion", "--out", out],
                  zoo=FAKE, harness=B) == 0
    (r,) = _doc(out)["zoo"]
    assert r["status"] == "ok" and r["best_peer"] == "eager" and r["peers"] == ["eager"]
    v = r["variants"]["fxopt-no-fusion"]
    assert v["status"] == "ok" and v["over_fxopt"] == pytest.approx(r["fxopt_ms"] / v["ms"])
    md = open(os.path.join(out, "zoo.md")).read()
    assert "| model | cell | fxopt ms | fxopt-no-fusion |" in md and "| test/tiny_b | fp32-b1 |" in md


def test_skip_measured_leaves_out_cells_earlier_runs_measured(tmp_path, monkeypatch):
    import gzip

    earlier = tmp_path / "results" / "day"
    earlier.mkdir(parents=True)
    rec = {"model": "test/tiny_a", "cell": "fp32-b1", "speedup": 1.2}
    with gzip.open(earlier / "zoo_a.json.gz", "wt") as f:  # as benchmarks/results keeps them
        json.dump({"zoo": [rec, {"model": "test/tiny_b", "cell": "fp32-b1", "speedup": None, "status": "failed"}]}, f)
    assert Z.measured_cells([str(tmp_path / "results")]) == {("test/tiny_a", "fp32-b1")}
    ran = []
    real = B.run_benchmark

    def spy(args, argv):
        ran.append((argv[argv.index("--models") + 1], argv[argv.index("--batch") + 1]))
        return real(args, argv)
    monkeypatch.setattr(B, "run_benchmark", spy)
    out = str(tmp_path / "out")
    assert Z.main([*CPU, "--models", "tiny_a,tiny_b", "--out", out, "--skip-measured", str(tmp_path / "results")],
                  zoo=FAKE, harness=B) == 0
    assert sorted((r["name"], r["cell"]) for r in _doc(out)["zoo"]) == [("tiny_a", "fp32-b2"), ("tiny_b", "fp32-b1")]
    assert len(ran) == 2
    with pytest.raises(SystemExit):  # a path that is not there is the user's mistake, said at once
        Z.main([*CPU, "--out", out, "--skip-measured", str(tmp_path / "nowhere")], zoo=FAKE, harness=B)


def test_merge_takes_each_cells_latest_measurement_gzipped_or_not(tmp_path):
    """Screens of one zoo over several sessions: the parts merge in the order they were measured
    (their dates), whatever order the paths come in, and a part kept gzipped reads as well."""
    import gzip
    import json

    from fxopt.bench.zoo_report import measured_at, merge_parts

    def part(date, speedup, cell="fp16-b1"):
        rec = {"model": "timm/m", "cell": cell, "status": "ok", "speedup": speedup}
        return {"meta": {"date": date, "device_name": "gpu", "command": "c"}, "cells": [], "zoo": [rec]}

    new, old = part("2026-12-04T10:41:47+00:00", 1.5), part("2026-11-27T19:21:48+00:00", 0.9)
    old["zoo"].append(part("", 1.1, "fp16-b32")["zoo"][0])
    p_new, p_old = str(tmp_path / "new.json.gz"), str(tmp_path / "old.json")
    with gzip.open(p_new, "wt") as f:
        json.dump(new, f)
    with open(p_old, "w") as f:
        json.dump(old, f)
    m = merge_parts([p_new, p_old])
    got = {r["cell"]: r["speedup"] for r in m["zoo"]}
    assert got == {"fp16-b1": 1.5, "fp16-b32": 1.1}
    assert [r["date"] for r in m["meta"]["runs"]] == [old["meta"]["date"], new["meta"]["date"]]
    merged = {"meta": {"date": "2026-01-01", "runs": [{"date": "2026-01-01"}, {"date": "2026-03-01"}]}}
    assert measured_at(merged) == "2026-03-01"
