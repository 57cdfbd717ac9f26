"""The CPU-testable parts of the CUDA-graph runner for training graphs: what a forward's instance
copies out, lends and returns, the forward and backward replays linked (simulated captures that
recompute), the backward's fast path, and held gradients and saved values."""
import torch

from test_cudagraphs_cpu import _SimulatedRunner


def test_training_instance_copies_what_the_caller_sees_lends_saved_values_and_returns_arguments():
    from fxopt.backends.cuda.runtime.cudagraphs import _Instance

    w, x = torch.randn(3), torch.randn(4, 3)
    buf = torch.empty(4, 3)  # x's static buffer
    logits, h = torch.randn(4), torch.randn(4, 3)
    inst = _Instance(None, {1: buf}, None, (logits, h, h[0], w, buf), [w, x], copied=frozenset({0}),
                     training=True)
    assert inst.ways == ["copy", "lend", "lend", "alias", "lend"]
    out = inst.hand_out()
    assert out[0].data_ptr() != logits.data_ptr() and torch.equal(out[0], logits)  # copied
    assert out[1].data_ptr() == h.data_ptr() and out[3].data_ptr() == w.data_ptr()
    assert not inst.free()  # the saved values (and the buffered batch) are held
    del out
    assert inst.free()
    kept = inst.hand_out()[0]  # holding only what was copied keeps nothing busy
    assert inst.free() and kept.shape == (4,)


def test_a_flat_output_list_with_other_values_is_handed_out_each_way_by_position():
    from fxopt.backends.cuda.runtime.cudagraphs import _Instance

    w, x = torch.randn(3), torch.randn(4, 3)
    logits, h = torch.randn(4), torch.randn(4, 3)
    outputs = [logits, None, h, 7, w]  # e.g. a backward's gradients with None for inputs without one
    inst = _Instance(None, {}, None, outputs, [w, x], copied=frozenset({0}), training=True)
    assert inst.ways == ["copy", "lend", "alias"] and inst._plan is not None
    out = inst.hand_out()
    assert type(out) is list and out[1] is None and out[3] == 7
    assert out[0].data_ptr() != logits.data_ptr() and torch.equal(out[0], logits)  # copied
    assert out[2].data_ptr() == h.data_ptr() and out[2] is not h  # lent: a new tensor over the buffer
    assert out[4].data_ptr() == w.data_ptr() and out[4] is not w
    assert not inst.free()
    del out
    assert inst.free()
    nested = _Instance(None, {}, None, (logits, [h]), [w, x], training=True)
    assert nested._plan is None and nested.hand_out()[1][0].data_ptr() == h.data_ptr()
    lent = _Instance(None, {}, None, [h, logits], [w, x], training=True)  # all lent: one map, a list again
    out = lent.hand_out()
    assert type(out) is list and [t.data_ptr() for t in out] == [h.data_ptr(), logits.data_ptr()]


def step_alike(pairs, x) -> list:
    """One step of each (model or its compiled call, optimizer) on ``x``, loss the output's mean
    square; their outputs."""
    outs = []
    for m, o in pairs:
        o.zero_grad(set_to_none=True)
        outs.append(m(x))
        outs[-1].square().mean().backward()
        o.step()
    return outs


def _sim_training(monkeypatch):
    """torch.compile training through fxopt on the CPU with the CUDA-graph runners simulated
    (captures recompute on replay): the graphs lower as the torch executor lowers CUDA graphs
    (``cuda_entry.lower_graph`` without generated kernels); returns the simulated runner class."""
    from fxopt import backends
    from fxopt.backends import cuda_entry
    from fxopt.backends.cuda.runtime.cudagraphs import CudaGraphRunner

    class Simulated(_SimulatedRunner, CudaGraphRunner):
        def _decide(self, entry, args):
            entry.timings = {"graph_ms": 0.0, "plain_ms": 1.0}

    monkeypatch.setattr(cuda_entry, "unsafe_reason", lambda gm, kind, device_type, static=(): None)
    monkeypatch.setattr(cuda_entry, "CudaGraphRunner", Simulated)
    monkeypatch.setattr(backends, "lower", lambda gm, ctx, kind: cuda_entry.lower_graph(gm, ctx, kind, kernels=False))
    return Simulated


def test_training_forward_and_backward_replay_linked_and_match_eager(monkeypatch):
    import copy

    from fxopt.backend import fxopt_backend

    simulated = _sim_training(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 6 * 6, 5))
    ref = copy.deepcopy(model)
    reports: list = []
    compiled = torch.compile(model, backend=lambda gm, ex: fxopt_backend(gm, ex, {"autotune_cache": False},
                                                                          _sink=reports))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    held = []
    for step in range(4):
        x = torch.randn(4, 3, 6, 6)  # a new batch at a new address every step
        outs = step_alike(((compiled, opt), (ref, ref_opt)), x)
        torch.testing.assert_close(outs[0], outs[1])
        held.append(outs[0])  # the caller keeps its outputs across later steps
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, msg=name)
        torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    fw, bw = (r for r in reports if r.kind in ("forward", "backward"))
    assert fw.cudagraphs.startswith("on") and bw.cudagraphs.startswith("on")
    fw_d = fw.executor_details["cudagraph_runner"].decisions()
    bw_d = bw.executor_details["cudagraph_runner"].decisions()
    # one capture each: held outputs were copies, saved values released by the backward
    assert simulated.captures == 2 and fw_d[0]["captures"] == 1 and bw_d[0]["captures"] == 1
    assert "lent" in fw_d[0]["outputs"] and "copied" in fw_d[0]["outputs"]
    assert fw_d[0]["inputs"] == "copied"  # the batch
    assert "read in place" in bw_d[0]["inputs"] and "copied" in bw_d[0]["inputs"]  # saved values; grad
    # the backward's capture allocated from the forward capture's pool (and is its one sharer)
    fw_inst, = (i for e in fw.executor_details["cudagraph_runner"].graphs.values() for i in e.instances)
    bw_inst, = (i for e in bw.executor_details["cudagraph_runner"].graphs.values() for i in e.instances)
    assert bw_inst.pool is fw_inst.pool and fw_inst.live_sharers() == [bw_inst]


def test_the_backward_fast_path_checks_lent_saved_values_by_address_and_the_rest_by_signature(monkeypatch):
    from fxopt.backend import fxopt_backend

    _sim_training(monkeypatch)
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
    reports: list = []
    compiled = torch.compile(model, backend=lambda gm, ex: fxopt_backend(gm, ex, {"autotune_cache": False},
                                                                          _sink=reports))
    def step(*batches):
        model.zero_grad(set_to_none=True)  # the lent gradients are released, as in a training loop
        sum(compiled(x).square().mean() for x in batches).backward()

    for _ in range(3):
        step(torch.randn(2, 3, 6, 6))
    fw, bw = (r.executor_details["cudagraph_runner"] for r in reports if r.kind in ("forward", "backward"))
    inst, _, _, _, _, checked = bw._fast
    reads = set(inst.input_ptrs)
    skipped = set(bw.dynamic) - set(checked)
    assert skipped and skipped <= reads  # only saved values read in place go unchecked...
    assert set(bw.dynamic) - reads <= set(checked)  # ...the incoming gradient is checked
    assert fw.lent_storages() and set(fw._fast[5]) == set(fw.dynamic)  # the forward checks its batch
    replays = inst.graph.replays
    step(torch.randn(2, 3, 6, 6))
    assert inst.graph.replays == replays + 1 and bw._fast[0] is inst  # served by the fast path
    # two forwards before their backward: the second forward's capture (the first's saved values
    # are held) lends other memory, the backward's fast path declines it by address, and another
    # backward capture reads it; the first forward's backward replays the first capture again
    step(torch.randn(2, 3, 6, 6), torch.randn(2, 3, 6, 6))
    entry, = bw.graphs.values()
    assert len(entry.instances) == 2 and inst.graph.replays == replays + 2


def test_training_replays_stay_correct_when_gradients_and_saved_values_are_held(monkeypatch):
    """Gradient accumulation (a ``.grad`` that is a lent gradient is still held at the next
    backward) and two forwards before their backwards (saved values of the first still held):
    other captures serve, and every value matches eager."""
    import copy

    from fxopt.backend import fxopt_backend

    _sim_training(monkeypatch)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 3))
    ref = copy.deepcopy(model)
    reports: list = []
    compiled = torch.compile(model, backend=lambda gm, ex: fxopt_backend(gm, ex, {"autotune_cache": False},
                                                                          _sink=reports))
    for step in range(3):
        xs = [torch.randn(2, 3, 6, 6) for _ in range(2)]
        for m in (compiled, ref):
            for x in xs:  # two micro-batches, gradients accumulated
                m(x).square().mean().backward()
            a, b = m(xs[0]), m(xs[1])  # two forwards, then one backward through both
            (a.sum() + b.square().sum()).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    bw = next(r for r in reports if r.kind == "backward")
    assert bw.executor_details["cudagraph_runner"].decisions()[0]["captures"] >= 2
