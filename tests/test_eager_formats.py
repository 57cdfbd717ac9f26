"""Eager's output memory formats where Dynamo's fake values give others (fxopt/eager_formats.py),
on the CPU: Dynamo traced on fake CUDA tensors (no device needed), the formats ``output_formats``
restores compared with those the GPU fuzzer saw eager give, and the cuda executor's planned output
strides after the whole pipeline. The geometries are the fuzzer's failing programs: upsampling of a
channels_last input with few channels (CUDA's meta heuristic makes it contiguous, eager does not),
and a 1-channel value a pointwise op makes contiguous in eager (its meta keeps channels_last)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from fxopt.backend import _graph_output_formats, fxopt_backend
from fxopt.eager_formats import eager_output_formats
from fxopt.testing import compile_with_fxopt

CL, NCHW = torch.channels_last, torch.contiguous_format


class Upsample(nn.Module):
    def __init__(self, mode="nearest", pool=False, bn=0, two=False):
        super().__init__()
        self.mode, self.pool, self.two = mode, pool, two
        self.bn = nn.BatchNorm2d(bn) if bn else None

    def forward(self, x):
        if self.pool:
            x = torch.abs(F.max_pool2d(x, 2, 1, 0))
        x = F.interpolate(x, scale_factor=2, mode=self.mode,
                          **({} if self.mode == "nearest" else {"align_corners": False}))
        if self.bn is not None:
            x = self.bn(x)
        return (x, x) if self.two else x


class OneChannel(nn.Module):
    """conv 8->1, abs, bn, conv 1->2, abs, bn (fuzz 2bea686c5)."""

    def __init__(self):
        super().__init__()
        self.m0, self.m1 = nn.Conv2d(8, 1, 3, padding=1, bias=False), nn.BatchNorm2d(1)
        self.m2, self.m3 = nn.Conv2d(1, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2)

    def forward(self, x):
        return self.m3(torch.abs(self.m2(self.m1(torch.abs(self.m0(x))))))


#: (model, input shape, eager's output format on CUDA as the fuzzer saw it)
CASES = {
    "nearest": (lambda: Upsample(two=True), (1, 2, 1, 2), CL),  # df12e891cd
    "nearest-bn": (lambda: Upsample(bn=2), (1, 2, 1, 2), CL),  # 2d1ca3ed3d
    "bilinear": (lambda: Upsample("bilinear", two=True), (1, 8, 1, 2), CL),  # 9ebabf9937
    "maxpool-abs-nearest": (lambda: Upsample(pool=True), (1, 2, 4, 4), CL),  # f8210112bf
    "maxpool-nearest-bn": (lambda: Upsample(pool=True, bn=2), (1, 2, 4, 4), CL),  # ed0117f339
    "one-channel-conv": (OneChannel, (1, 8, 1, 2), NCHW),  # f2bea686c5
}


def _on_fake_cuda(name, backend):
    """Dynamo on fake CUDA tensors of case ``name`` (channels_last input), ``backend`` its compiler."""
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

    def backend(gm, example_inputs):
        seen.append((_graph_output_formats(gm, "example_value"), eager_output_formats(gm)))
        return gm.forward
    _on_fake_cuda(name, backend)
    (dynamo, eager), = seen
    want = CASES[name][2]
    assert dynamo[0] is not want  # the discrepancy the fuzzer found
    assert all(f is want for f in eager), (dynamo, eager)


@pytest.mark.parametrize("name", ["nearest", "bilinear", "maxpool-abs-nearest"])
def test_the_cuda_executor_plans_eagers_output_strides(name):
    """The whole pipeline (cuda executor, NVRTC not needed for the plan): the output the generated
    region stores has eager's strides."""
    reports = []

    def backend(gm, example_inputs):
        fxopt_backend(gm, example_inputs, options={"executor": "cuda", "autotune_cache": False}, _sink=reports)
        return gm.forward
    _on_fake_cuda(name, backend)
    (report,) = reports
    assert report.fallback is None, report.fallback
    out = next(n for n in report.after.graph.nodes if n.op == "output").args[0]
    for o in out:
        assert o.meta["val"].is_contiguous(memory_format=CL), o.meta["val"].stride()
    assert report.lowered.regions, "the upsampling is a generated region"


def test_a_one_channel_value_through_pointwise_ops_has_eagers_strides_on_the_cpu():
    torch.manual_seed(0)
    m = OneChannel().eval()
    x = torch.randn(1, 8, 1, 2).contiguous(memory_format=CL)
    fast = compile_with_fxopt(m, {}, [])
    with torch.no_grad():
        got, want = fast(x), m(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert all(n == 1 or a == b for n, a, b in zip(want.shape, got.stride(), want.stride())), \
        (got.stride(), want.stride())
