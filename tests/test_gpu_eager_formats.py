"""The GPU fuzzer's stride failures (fxopt/eager_formats.py) on a CUDA device: channels_last inputs
through upsampling (nearest, bilinear, after max pooling, before batch norm, after a cast) and a
1-channel value through pointwise ops, compiled with the cuda executor, against eager's values and
strides (twice: the CUDA-graph capture, then a replay). The CPU side is test_eager_formats.py."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.testing import compile_with_fxopt
from test_eager_formats import CASES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class ConvBilinear(nn.Module):
    """grouped 1x1 conv, abs, bn, 3x3 conv, abs, bilinear (fuzz 09a86e0483)."""

    def __init__(self):
        super().__init__()
        self.m0, self.m1 = nn.Conv2d(4, 4, 1, groups=2), nn.BatchNorm2d(4)
        self.m2 = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x):
        x = torch.abs(self.m2(self.m1(torch.abs(self.m0(x)))))
        return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class CastNearest(nn.Module):
    """fp16 round trip, scale, nearest (fuzz ed5ae43202)."""

    def forward(self, x):
        return F.interpolate(x.to(torch.float16).to(x.dtype) * 2.0, scale_factor=2, mode="nearest")


GPU_CASES = {**{k: (make, shape) for k, (make, shape, _) in CASES.items()},
             "conv-bilinear": (ConvBilinear, (1, 4, 2, 2)), "cast-nearest": (CastNearest, (1, 2, 1, 2))}


@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_outputs_have_eagers_strides_with_the_cuda_executor(name):
    make, shape = GPU_CASES[name]
    torch.manual_seed(0)
    model = make().eval().cuda()
    x = torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last)
    fast = compile_with_fxopt(model, {"executor": "cuda", "autotune_cache": False}, [])
    with torch.no_grad():
        want = model(x)
        for _ in range(2):
            got = fast(x)
            for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
                torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
                assert all(n == 1 or a == b for n, a, b in zip(w.shape, g.stride(), w.stride())), \
                    (g.stride(), w.stride())
