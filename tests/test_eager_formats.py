"""fxopt/eager_formats.py on the GPU fuzzer's failing programs (Dynamo on fake CUDA tensors)."""
import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt.backend import _graph_output_formats, fxopt_backend
from fxopt.eager_formats import eager_output_formats
from fxopt.testing import compile_with_fxopt

CL, NCHW = torch.channels_last, torch.contiguous_format


S = nn.Sequential


def up(mode="nearest"):
    return nn.Upsample(scale_factor=2, mode=mode)


class Abs(nn.Module):
    def forward(self, x):
        return torch.abs(x)


CASES = {  # model, input shape, eager's format
    "nearest": (lambda: S(up()), (1, 2, 1, 2), CL),  # df12e891cd
    "nearest-bn": (lambda: S(up(), nn.BatchNorm2d(2)), (1, 2, 1, 2), CL),  # 2d1ca3ed3d
    "bilinear": (lambda: S(up("bilinear")), (1, 8, 1, 2), CL),  # 9ebabf9937
    "conv-bilinear": (lambda: S(nn.Conv2d(4, 4, 3, padding=1), Abs(), up("bilinear")), (1, 4, 2, 2), CL),  # 09a86e0483
    "maxpool-abs-nearest": (lambda: S(nn.MaxPool2d(2, 1), Abs(), up()), (1, 2, 4, 4), CL),  # f8210112bf
    "maxpool-nearest-bn": (lambda: S(nn.MaxPool2d(2, 1), up(), nn.BatchNorm2d(2)), (1, 2, 4, 4), CL),  # ed0117f339
    "one-channel-conv": (lambda: S(nn.Conv2d(8, 1, 3, padding=1), Abs(), nn.BatchNorm2d(1), nn.Conv2d(1, 2, 3, padding=1),
                             Abs(), nn.BatchNorm2d(2)), (1, 8, 1, 2), NCHW),  # f2bea686c5
}


def _on_fake_cuda(name, backend):
    make, shape, _ = CASES[name]
    with FakeTensorMode(allow_non_fake_inputs=True):
        with torch.device("cuda"):
            model = make().eval()
        x = torch.empty(shape, device="cuda").contiguous(memory_format=CL)
        torch.compiler.reset()
        with torch.no_grad():
            torch.compile(model, backend=backend)(x)
    torch.compiler.reset()


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_formats_correct_dynamos_fake_values(name):
    seen = []
    _on_fake_cuda(name, lambda gm, ex: seen.append((_graph_output_formats(gm, "example_value"),
                                                    eager_output_formats(gm))) or gm.forward)
    (dynamo, eager), = seen
    assert dynamo[0] is not CASES[name][2]
    assert all(f is CASES[name][2] for f in eager), (dynamo, eager)


@pytest.mark.parametrize("name", ["nearest", "bilinear", "maxpool-abs-nearest"])
def test_the_cuda_executor_plans_eagers_output_strides(name):
    reports = []
    _on_fake_cuda(name, lambda gm, ex: fxopt_backend(gm, ex, options={"executor": "cuda", "autotune_cache": False},
                                                     _sink=reports) and gm.forward)
    (report,) = reports
    assert report.fallback is None and report.lowered.regions, report.fallback
    for o in next(n for n in report.after.graph.nodes if n.op == "output").args[0]:
        assert o.meta["val"].is_contiguous(memory_format=CL), o.meta["val"].stride()


@pytest.mark.parametrize("name,device", [("one-channel-conv", "cpu")] + [
    pytest.param(k, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")])
    for k in sorted(CASES)])
def test_compiled_outputs_have_eagers_strides(name, device):
    torch.manual_seed(0)
    model, x = CASES[name][0]().eval().to(device), torch.randn(CASES[name][1], device=device).to(memory_format=CL)
    fast = compile_with_fxopt(model, {"executor": "cuda", "autotune_cache": False} if device == "cuda" else {}, [])
    with torch.no_grad():
        want = model(x)
        for _ in range(1 + (device == "cuda")):  # the CUDA-graph capture, then a replay
            got = fast(x)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
                assert all(n == 1 or a == b for n, a, b in zip(w.shape, g.stride(), w.stride())), (g.stride(), w.stride())
