"""``fxopt diagnose timeline``: reading a profiler trace, choosing the replay and the rows, the
picture (CPU); the whole diagnostic on a GPU."""
from __future__ import annotations

import json

import pytest
import torch

from fxopt.cli import main
from fxopt.diagnose import timeline as T


def _event(name, stream, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"stream": stream, "device": 0}}


def _trace(replays=3, gap=100.0, spans=(10.0, 12.0, 30.0)):
    """Each replay: a conv on stream 7 beside a generated kernel on stream 13, then a join kernel;
    replay i's join lasts ``spans[i]`` - 6 µs; a memcpy and a CPU op that are not kernels."""
    events = [_event("aten::cat", 0, 0.0, 1.0, cat="cpu_op"), _event("Memcpy HtoD", 7, 0.5, 1.0, cat="gpu_memcpy")]
    for i in range(replays):
        t = 1000.0 + i * gap
        events += [_event("sm90_xmma_fprop_implicit_gemm", 7, t, 4.0),
                   _event("fx_pw_relu_cat", 13, t + 1.0, 5.0),
                   _event("void at::native::elementwise_kernel", 7, t + 6.0, spans[i] - 6.0)]
    return {"traceEvents": events}


def test_trace_gives_the_kernels_by_start_with_their_streams():
    ks = T.kernels_from_trace(_trace())
    assert len(ks) == 9 and [k.start_us for k in ks] == sorted(k.start_us for k in ks)
    assert {k.stream for k in ks} == {7, 13} and not any("Memcpy" in k.name or "aten" in k.name for k in ks)
    named = T.kernels_from_trace({"traceEvents": [{**_event("k", 0, 1.0, 1.0), "args": {}, "tid": "stream 21"}]})
    assert named[0].stream == 21


def test_the_median_replay_is_drawn_from_its_own_start():
    ks = T.kernels_from_trace(_trace(spans=(10.0, 30.0, 12.0)))
    run = T.median_replay(ks, 3)
    assert len(run) == 3 and min(k.start_us for k in run) == 0.0
    assert T.span_us(run) == pytest.approx(12.0)
    with pytest.raises(ValueError, match="not 2 replays"):
        T.split_replays(ks, 2)


def test_rows_per_stream_or_packed_where_one_stream_is_named():
    run = T.median_replay(T.kernels_from_trace(_trace()), 3)
    rows, kind = T.lanes(run)
    assert kind == "stream" and [len(r) for r in rows] == [2, 1]
    assert {k.stream for k in rows[0]} == {7} and rows[1][0].name.startswith("fx_")
    one = [T.Kernel(k.name, 0, k.start_us, k.dur_us) for k in run]
    rows, kind = T.lanes(one)
    # the conv and the generated kernel overlap: two rows; the join starts after the conv ends
    assert kind == "overlap row" and [[k.name[:5] for k in r] for r in rows] == [
        ["sm90_", "void "], ["fx_pw"]]
    serial = [T.Kernel("a", 0, 0.0, 2.0), T.Kernel("b", 0, 2.0, 1.0), T.Kernel("c", 0, 3.5, 1.0)]
    assert len(T.lanes(serial)[0]) == 1


def test_summary_overlap_and_categories():
    run = T.median_replay(T.kernels_from_trace(_trace()), 3)
    s = T.summary(run)
    assert s == {"kernels": 3, "span_us": 12.0, "busy_us": 15.0, "overlap": 1.25, "streams": 2}  # the median replay
    assert T.summary([])["overlap"] == 0.0
    assert T.category("fx_red_mean_cols64")[0] == "fxopt generated"
    assert T.category("cutlass_80_tensorop_s1688gemm")[0] == "library conv / GEMM"
    assert T.category("void at::native::vectorized_elementwise_kernel")[0] == "other"


@pytest.mark.parametrize("suffix,magic", [("png", b"\x89PNG"), ("svg", b"<?xml")])
def test_picture_written(tmp_path, suffix, magic):
    run = T.median_replay(T.kernels_from_trace(_trace()), 3)
    single = [T.Kernel(k.name, 7, t, k.dur_us) for k, t in zip(run, (0.0, 4.0, 9.0))]
    path = tmp_path / f"t.{suffix}"
    T.draw([("one stream", single), ("up to 4 streams", run)], str(path), "a title")
    data = path.read_bytes()
    assert data.startswith(magic) and len(data) > 1000
    if suffix == "svg":
        text = data.decode()
        assert "a title" in text and "up to 4 streams" in text and "stream 1" in text


def test_needs_a_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["diagnose", "timeline", "seedcnn", "--device", "cpu"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_timeline_of_a_branchy_model_on_the_gpu(tmp_path, capsys):
    """GoogLeNet at batch 1 with weights taken as fixed: both ways profiled, the multi-stream one
    (forced where not kept) runs the same kernels over at least two rows; the picture is written."""
    out, events = tmp_path / "t.png", tmp_path / "e.json"
    assert main(["diagnose", "timeline", "googlenet", "--batch", "1", "--replays", "3", "--force",
                 "--options", '{"fixed_weights": true}', "--out", str(out), "--events", str(events)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG")
    ways = json.loads(events.read_text())["ways"]
    single, multi = ways["one stream"], ways["up to 4 streams"]
    assert single["summary"]["kernels"] > 50 and single["decision"] is None
    assert abs(multi["summary"]["kernels"] - single["summary"]["kernels"]) <= 0.1 * single["summary"]["kernels"]
    assert multi["decision"]["used"] >= 2 and multi["decision"]["single_ms"] > 0
    rows, _ = T.lanes([T.Kernel(**k) for k in multi["kernels"]])
    assert len(rows) >= 2
    assert "picture:" in capsys.readouterr().out


class _Entry:
    def __init__(self, replay):
        self.instances = [type("Instance", (), {"graph": type("Graph", (), {"replay": staticmethod(replay)})})()]


class _FakeRunner:
    """The runner's surface ``_way`` reads: its signatures' entries, ``decisions()``, the
    multi-stream alternative, ``_capture_streams``; called with the flat arguments."""

    def __init__(self, kept):
        self.graphs = {"sig": _Entry(lambda: "single replay")}
        self.streams = object()
        self.kept, self.captured_with = kept, None

    def __call__(self, *args):
        return args[0]

    def decisions(self):
        return [{"runs": "optimized graph", "streams": {"used": 3, "single_ms": 0.3, "multi_ms": 0.31,
                                                        "kept": self.kept}}]

    def _capture_streams(self, entry, args):
        self.captured_with = args
        return _Entry(lambda: "multi-stream replay")


@pytest.mark.parametrize("kept,force,want,note", [
    ("single", True, "multi-stream replay", "forced: measured no faster, not kept"),
    ("single", False, "single replay", None),
    ("multi", True, "single replay", None),  # the kept entry already replays the multi-stream graph
])
def test_force_captures_the_plan_the_runner_did_not_keep(monkeypatch, kept, force, want, note):
    import fxopt.testing

    runner = _FakeRunner(kept)

    def compile_with_fxopt(model, options, graphs):
        graphs.append(type("Report", (), {"executor_details": {"cudagraph_runner": runner}})())
        return lambda x: runner(x, "weight")

    monkeypatch.setattr(fxopt.testing, "compile_with_fxopt", compile_with_fxopt)
    replay, decision, got_note = T._way(None, "input", {"streams": 4}, force)
    assert replay() == want and got_note == note and decision["streams"]["kept"] == kept
    assert type(runner) is _FakeRunner  # the recording class is taken off again
    assert runner.captured_with == (("input", "weight") if want.startswith("multi") else None)
    label = T._label("up to 4 streams", [T.Kernel("fx_a", 0, 0.0, 2.0)], decision, got_note)
    assert "one stream 300.0 µs, 3 streams 310.0 µs, kept " + kept in label
    assert (note in label) if note else "[" not in label
