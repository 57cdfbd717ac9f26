"""A package's calls straight to an external engine (ONNX Runtime, OpenVINO): once inputs of one kind
ran the engine's way, later such inputs go to its ``fixed`` call, which compares their addresses
alone. These check that it gives eager's values whatever changes between calls (new tensors, the same
tensor written in place, another layout, an evicted session, threads, several inputs and outputs)."""
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxopt
import fxopt.choices as choices
from fxopt.backends.openvino import why_unavailable as why_no_openvino

RTOL = 1e-4


def why_no_onnxruntime():
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime not installed"
    return None


class TwoInTwoOut(nn.Module):
    """Two images in (their order matters), a dict of two tensors out."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(5, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x, y):
        z = F.relu(self.a(x)) - 0.5 * self.b(y)
        return {"map": z, "logits": self.fc(z.mean((2, 3)))}


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _same(out, ref) -> bool:
    return out.keys() == ref.keys() and all(_rel(out[k], ref[k]) < RTOL for k in ref)


def _engine_package(tmp_path, monkeypatch, way: str, options=None):
    """A package of :class:`TwoInTwoOut` at batch 2 whose other batch sizes run ``way`` (checked
    against the optimized graph at their first call, not measured)."""
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    fxopt.package(model, (torch.randn(2, 3, 8, 8), torch.randn(2, 5, 8, 8)), tmp_path / "m.fxopt", options=options)
    module = fxopt.load(tmp_path / "m.fxopt")
    monkeypatch.setattr(choices, "default_entry", lambda key, held=None: {"runs": way, "not_measured": True})
    return model, module


def _check_fixed_calls(model, module, way: str):
    xs = [torch.randn(3, 3, 8, 8) for _ in range(3)]
    ys = [torch.randn(3, 5, 8, 8) for _ in range(3)]
    with torch.no_grad():
        assert _same(module(xs[0], ys[0]), model(xs[0], ys[0]))
        (d,) = module.decisions()["3"]["runner"]
        assert d["runs"] == way, d
        assert len(module._fixed) == 1  # the engine's fixed call, for inputs of this kind
        for x, y in zip(xs, ys):  # new tensors each call, then the inputs swapped between the slots' kinds
            assert _same(module(x, y), model(x, y))
        x, y = xs[1], ys[1]
        first = module(x, y)
        x.mul_(-2.0)  # the same addresses, new values: read again
        y.add_(1.0)
        second = module(x, y)
        assert _same(second, model(x, y)) and not torch.equal(first["map"], second["map"])
        assert first["map"].data_ptr() != second["map"].data_ptr()  # every call's outputs are its own
        xc = xs[2].contiguous(memory_format=torch.channels_last)  # another kind: checked, then its own way
        assert _same(module(xc, ys[2]), model(xc, ys[2]))
        assert _same(module(xc, ys[2]), model(xc, ys[2]))
        x = torch.randn(3, 3, 8, 8, requires_grad=True)  # grad mode on: no autograd through the engine
    out = module(x, ys[0])
    assert not out["map"].requires_grad
    with torch.no_grad():
        assert _same(out, model(x, ys[0]))


@pytest.mark.skipif(why_no_onnxruntime() is not None, reason="onnxruntime not installed")
@pytest.mark.parametrize("buffered", [True, False])
def test_onnxruntime_way_takes_the_fixed_call_with_eagers_values(tmp_path, monkeypatch, buffered):
    """``buffered``: outputs written into buffers bound once and copied out (small ones), or into
    new tensors bound at every call (large ones: the threshold set to 0 here)."""
    import fxopt.backends.onnxrt as ortb

    if not buffered:
        monkeypatch.setattr(ortb, "CPU_OUT_BUFFER_BYTES", 0)
    model, module = _engine_package(tmp_path, monkeypatch, "onnxruntime")
    _check_fixed_calls(model, module, "onnxruntime")


@pytest.mark.skipif(why_no_openvino() is not None, reason="openvino not installed")
@pytest.mark.parametrize("buffered", [True, False])
def test_openvino_way_takes_the_fixed_call_with_eagers_values(tmp_path, monkeypatch, buffered):
    import fxopt.backends.openvino as ovb

    if not buffered:
        monkeypatch.setattr(ovb, "OUT_BUFFER_BYTES", 0)
    model, module = _engine_package(tmp_path, monkeypatch, "openvino", {"cpu_openvino": True})
    _check_fixed_calls(model, module, "openvino")


@pytest.mark.skipif(why_no_onnxruntime() is not None, reason="onnxruntime not installed")
def test_an_evicted_session_leaves_the_fixed_call_for_the_runners_way(tmp_path, monkeypatch):
    """The fixed call holds the engine's session weakly: once the engine lets it go, the package
    forgets the call and the runner's way builds the session again."""
    model, module = _engine_package(tmp_path, monkeypatch, "onnxruntime")
    x, y = torch.randn(3, 3, 8, 8), torch.randn(3, 5, 8, 8)
    with torch.no_grad():
        module(x, y)
        assert len(module._fixed) == 1
        runner = module.lowerings[3].fn.onnxruntime
        builds = runner.builds
        runner.sessions.clear()
        assert _same(module(x, y), model(x, y))
        assert not module._fixed and runner.builds == builds + 1
        assert _same(module(x, y), model(x, y))


@pytest.mark.skipif(why_no_onnxruntime() is not None, reason="onnxruntime not installed")
def test_fixed_calls_from_several_threads_give_each_its_own_values(tmp_path, monkeypatch):
    """Threads calling at once: one holds the session's bound buffers, the others take the checked
    way (ORT's own outputs); every call gets the values of its own inputs."""
    model, module = _engine_package(tmp_path, monkeypatch, "onnxruntime")
    with torch.no_grad():
        module(torch.randn(3, 3, 8, 8), torch.randn(3, 5, 8, 8))
        assert len(module._fixed) == 1
        pairs = [(torch.randn(3, 3, 8, 8), torch.randn(3, 5, 8, 8)) for _ in range(4)]
        refs = [model(x, y) for x, y in pairs]
    wrong = []

    def work(k):
        with torch.no_grad():
            for _ in range(30):
                if not _same(module(*pairs[k]), refs[k]):
                    wrong.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_graph_ways_get_no_fixed_call(tmp_path):
    """The torch graphs (the cpu executor's oneDNN ways) keep the runner's way: no fixed call."""
    torch.manual_seed(0)
    model = TwoInTwoOut().eval()
    fxopt.package(model, (torch.randn(2, 3, 8, 8), torch.randn(2, 5, 8, 8)), tmp_path / "m.fxopt",
                  options={"cpu_onnxruntime": False, "cpu_generated_c": False})
    module = fxopt.load(tmp_path / "m.fxopt")
    x, y = torch.randn(2, 3, 8, 8), torch.randn(2, 5, 8, 8)
    with torch.no_grad():
        assert _same(module(x, y), model(x, y)) and _same(module(x, y), model(x, y))
    assert len(module._direct) == 1 and not module._fixed
