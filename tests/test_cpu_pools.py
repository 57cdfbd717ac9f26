"""The cpu executor's max pools as maxima of strided slices (``fxopt.backends.cpu.max_pool_by_slices``):
equal to the pool bit for bit (NaNs, layouts, dtypes), taken for large square pools only, and left
where the pool's indices are read."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import fxopt
from fxopt.backends import cpu

pytestmark = pytest.mark.skipif(cpu.onednn_available() is not None, reason=str(cpu.onednn_available()))


@given(k=st.sampled_from([2, 3]), n=st.integers(1, 3), c=st.integers(1, 5), h=st.integers(3, 11), w=st.integers(3, 11),
       nhwc=st.booleans(), nan=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_max_pool_by_slices_matches_the_pool(k, n, c, h, w, nhwc, nan, dtype):
    if h < k or w < k:
        return
    x = torch.randn(n, c, h, w, generator=torch.Generator().manual_seed(h * 16 + w)).to(dtype)
    if nan:
        x[0, 0, 0, 0] = float("nan")
    if nhwc:
        x = x.contiguous(memory_format=torch.channels_last)
    got, want = cpu.max_pool_by_slices(x, k), F.max_pool2d(x, k)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert got.stride() == want.stride() or got.numel() <= 1


class Pools(nn.Module):
    def __init__(self, k=2, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.k, self.padding = k, padding

    def forward(self, x):
        return F.max_pool2d(F.relu(self.conv(x)), self.k, padding=self.padding).sum((2, 3))


@pytest.mark.parametrize("batch, padding, taken", [(64, 0, 1), (1, 0, 0), (64, 1, 0)])
def test_large_square_pools_are_lowered_and_small_or_padded_ones_stay(batch, padding, taken):
    m, x = Pools(padding=padding).eval(), torch.randn(batch, 3, 32, 32)
    r = fxopt.explain(m, x, options={"baseline_check": False})
    pools = r.graphs[0].executor_details["pools"]
    assert pools["by_slices"] == taken
    if not taken:
        (why,) = pools["declined"].values()
        assert why.startswith("small" if padding == 0 else "padding")
    assert "max pools as maxima of strided slices" in str(r)
    compiled = torch.compile(m, backend="fxopt", options={"baseline_check": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-4)


def test_a_pool_whose_indices_are_read_stays():
    class WithIndices(nn.Module):
        def forward(self, x):
            y, idx = F.max_pool2d(x, 2, return_indices=True)
            return y + idx.float()

    r = fxopt.explain(WithIndices().eval(), torch.randn(64, 8, 16, 16))
    assert list(r.graphs[0].executor_details["pools"]["declined"].values()) == ["its indices are read"]
