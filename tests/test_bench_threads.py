"""The benchmark's backends on threads of their own (CUDA: torch keeps cuDNN's plans per thread):
turns, thread-local state, and the calling thread for a backend that cannot run on its own."""
from __future__ import annotations

import pytest
import torch

import fxopt.bench as B
from fxopt.bench import report as RP
from fxopt.bench import runners as R
from test_bench import _broken_prepare, _tag_backends, tiny_model  # noqa: F401 - tiny_model: a fixture


def test_backends_on_threads_of_their_own_take_turns(monkeypatch, tiny_model, tmp_path):
    """CUDA runs give each backend a thread of its own (torch caches cuDNN's plans per thread): a
    backend's preparation, rounds and statistics all run on its one thread, no two backends share one,
    and the rounds still alternate; compiled backends work there."""
    import threading

    from torch._dynamo.utils import counters

    order, seen = _tag_backends(monkeypatch)
    monkeypatch.setattr(R, "_settle", lambda s: None)
    a = B.parse_args(["--quick", "--device", "cpu", "--models", tiny_model, "--backends",
                      "tag-a,broken,inductor,tag-b,fxopt", "--iters", "6", "--warmup", "1", "--rounds", "3",
                      "--out", str(tmp_path)])
    assert a.backend_threads is False  # the CPU keeps one calling thread (one OpenMP team)
    a.backend_threads = True
    counters.clear()
    res = B.run_benchmark(a, [])
    assert res["meta"]["backend_threads"] is True
    by = {c["backend"]: c for c in res["cells"]}
    for be in ("tag-a", "inductor", "tag-b", "fxopt"):
        assert by[be]["status"] == "ok" and by[be]["n"] == 6 and by[be]["max_rel_err"] <= 1e-4, by[be]
    assert by["broken"]["status"] == "error" and "boom" in by["broken"]["error"]
    assert len(seen["a"]) == len(seen["b"]) == 1 and seen["a"] != seen["b"]
    assert threading.get_ident() not in seen["a"] | seen["b"]
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert runs == ["a", "b"] * 4  # preparation and warm-up, then 3 rounds, taking turns
    assert counters["frames"]["ok"] == 2, dict(counters["frames"])  # inductor, fxopt: compiled once each
    assert not [t for t in threading.enumerate() if t.name.startswith("bench-")]  # ended with the row
    md = RP.render_markdown({**res, "meta": {**res["meta"], "device_type": "cuda"}})
    assert "each backend on a thread of its own" in md


def test_a_backend_failing_on_its_own_thread_runs_on_the_calling_thread(monkeypatch, tiny_model, tmp_path):
    """A backend whose preparation fails on a thread of its own (a torch whose thread-local state it
    needs is only made on some threads) is prepared again on the calling thread, once a run, and stays
    there for the rest of the run, the cell saying so; one failing there too is not tried again."""
    import threading

    caller = threading.get_ident()
    calls = {"shy": [], "broken": 0}

    def shy(model, x, device, dtype, options):
        calls["shy"].append(threading.get_ident())
        if threading.get_ident() != caller:
            raise AssertionError("no thread-local state here")
        return R.Prepared(lambda inp: model(inp), x)

    def broken(*a):
        calls["broken"] += 1
        return _broken_prepare(*a)

    _tag_backends(monkeypatch)
    monkeypatch.setitem(R.BACKENDS, "shy", R.BackendSpec("shy", shy))
    monkeypatch.setitem(R.BACKENDS, "broken", R.BackendSpec("broken", broken))
    monkeypatch.setattr(R, "_settle", lambda s: None)
    a = B.parse_args(["--quick", "--device", "cpu", "--models", tiny_model, "--batch", "1,2", "--backends",
                      "tag-a,shy,broken", "--iters", "4", "--warmup", "1", "--rounds", "2", "--out", str(tmp_path)])
    a.backend_threads = True
    res = B.run_benchmark(a, [])
    shy_cells = [c for c in res["cells"] if c["backend"] == "shy"]
    assert len(shy_cells) == 2 and all(c["status"] == "ok" and c["n"] == 4 for c in shy_cells), shy_cells
    assert all("ran on the calling thread (on a thread of its own: AssertionError" in c["note"] for c in shy_cells)
    assert calls["shy"][1:] == [caller, caller] and calls["shy"][0] != caller  # one try on its own thread
    assert calls["broken"] == 3  # its thread, the caller once, then its thread again at the next batch
    assert all(c["status"] == "error" for c in res["cells"] if c["backend"] == "broken")
    assert all(c["status"] == "ok" and "calling thread" not in c["note"] for c in res["cells"] if c["backend"] == "tag-a")
    assert not [t for t in threading.enumerate() if t.name.startswith("bench-")]


def test_backend_thread_returns_raises_and_keeps_its_thread():
    import threading

    t = R.BackendThread("x")
    try:
        first = t(threading.get_ident)
        assert first != threading.get_ident() and t(threading.get_ident) == first
        assert t(lambda a, b=0: a + b, 2, b=3) == 5
        # Inductor's CUDA-graph trees find their thread-local managers there (torch 2.11 asserts it)
        assert t(torch._C._is_key_in_tls, "tree_manager_containers")
        with pytest.raises(ValueError, match="boom"):
            t(_broken_prepare, None, None, None, None, None)
    finally:
        t.close()
    assert R.on_backend_thread(None, "x", threading.get_ident) == threading.get_ident()


def test_backend_thread_makes_cudagraph_tree_state_without_torchs_initializer(monkeypatch):
    """torch 2.11 has no ``cudagraph_trees._initialize_tls``: the thread makes the state as it would,
    and Inductor's own lookup (``get_obj``) finds it there."""
    from torch._inductor import cudagraph_trees

    monkeypatch.delattr(cudagraph_trees, "_initialize_tls", raising=False)
    t = R.BackendThread("x")
    try:
        assert t(torch._C._is_key_in_tls, "tree_manager_containers")
        assert t(lambda: cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")) == {}
        locks = t(lambda: cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_locks"))
        assert hasattr(locks["cuda:0"], "acquire")
    finally:
        t.close()
