"""The generated register-row reductions cover every element of each row exactly once (CPU only).

Each kernel's own index arithmetic (lane / row mapping, clamped chunks and rows, vector loads,
guarded accumulation, the shuffle butterfly, guarded stores) is run for every thread of its launch
grid by ``fxopt.fuzz.geometry``; see its docstring. The first case is the GPU property test's
failure on ``aten.mean.dim`` (InstanceNorm2d(2) then a squeeze-excite block, input 1x2x3x4: rows
of 12 = 3 chunks of 4 over 4 lanes, the last lane masked): the mapping covers each row once, and
the mean it computes, emulated in float32 in the kernel's order, is as close to the float64 mean
as eager's; its relative error against eager is large only because the exact mean of a
normalized row is 0 (see ``test_gpu_fusion.region_error``).
"""
import numpy as np
import pytest
import torch
import torch.nn as nn

from fxopt.fuzz.backend_api import reduction_kernels, reduction_sources
from fxopt.fuzz.geometry import check_row_geometry, is_row_kernel
from fxopt.testing.blocks import Block, BlockNet


def _instancenorm_se():
    gen = torch.Generator().manual_seed(0)  # as block_cases draws seed 0
    model = BlockNet([Block("instancenorm", {}, {"inorm": nn.InstanceNorm2d(2, affine=False)}),
                      Block("se", {}, {"fc1": nn.Conv2d(2, 1, 1), "fc2": nn.Conv2d(1, 2, 1)})]).eval()
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            with torch.no_grad():
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen) * mod.weight[0].numel() ** -0.5)
                mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen) * 0.1)
    return model, torch.randn((1, 2, 3, 4), generator=gen)


def _row_sources(model, x):
    out = [(name, ks) for name, k in reduction_kernels(model, (x,)) for ks in reduction_sources(k)]
    return [(name, ks) for name, ks in out if is_row_kernel(ks)]


def test_mean_of_the_gpu_failure_covers_each_row_once():
    model, x = _instancenorm_se()
    sources = _row_sources(model, x)
    names = {name for name, _ in sources}
    assert {"fx_red_mean", "fx_red__native_batch_norm_legit"} <= names, names
    widths = set()
    for name, ks in sources:
        summary = check_row_geometry(ks)
        assert summary["rows"] == 2 and summary["row_size"] == 12
        widths.add(ks.meta["geometry"]["vec"])
    assert widths == {1, 4}  # the 3-chunk vector row (lane 3 masked) and the 12-lane scalar row


def test_mean_in_the_kernels_order_is_as_accurate_as_eagers():
    """The vec-4 kernel's sum order (each lane its 4 values, then the butterfly over 4 lanes) in
    float32: its error against the float64 mean is at the rounding of the row's values."""
    model, x = _instancenorm_se()
    y = model.blocks[0](x).reshape(2, 12)
    f = np.float32(1 / 12)
    for row in y.numpy().astype(np.float32):
        lanes = [np.float32(0)] * 4
        for lane in range(3):
            for v in row[4 * lane:4 * lane + 4]:
                lanes[lane] = np.float32(lanes[lane] + v)
        for o in (2, 1):
            lanes = [np.float32(lanes[i] + lanes[i ^ o]) for i in range(4)]
        got, exact = float(np.float32(lanes[0] * f)), float(np.mean(row.astype(np.float64)))
        eager = float(torch.from_numpy(row).mean())
        scale = float(np.abs(row).max())
        assert abs(got - exact) <= 1e-6 * scale and abs(eager - exact) <= 1e-6 * scale
        assert abs(exact) < 1e-6 * scale  # a normalized row: its exact mean is (nearly) 0


class _Norms(nn.Module):
    """LayerNorm over channels, GroupNorm, softmax, means and maxima: rows of every length."""

    def __init__(self, c):
        super().__init__()
        self.ln, self.gn = nn.LayerNorm(c), nn.GroupNorm(1, c)

    def forward(self, x):
        a = self.ln(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return torch.softmax(a, 1) + self.gn(x) + x.mean((2, 3), keepdim=True) + x.amax(1, keepdim=True)


@pytest.mark.parametrize("shape", [(1, 2, 3, 4), (1, 8, 1, 1), (3, 5, 7, 9), (2, 3, 1, 5), (1, 7, 2, 3),
                                   (2, 12, 3, 3), (1, 33, 2, 2), (4, 6, 5, 1)])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_every_row_kernel_covers_each_row_once(shape, fmt):
    torch.manual_seed(0)
    x = torch.randn(shape).contiguous(memory_format=fmt)
    sources = _row_sources(_Norms(shape[1]).eval(), x)
    assert sources, "no register-row reduction was generated"
    for _, ks in sources:
        check_row_geometry(ks)


def test_the_emulator_sees_a_missed_and_a_double_counted_chunk():
    """The check is not vacuous: the generated mean with its partial chunk's mask removed (lane 3
    adds the clamped chunk 2 again) and with a chunk index past the mask (chunk 2 never read)."""
    model, x = _instancenorm_se()
    ks = next(ks for name, ks in _row_sources(model, x) if name == "fx_red_mean" and ks.meta["geometry"]["vec"] == 4)
    import dataclasses

    twice = ks.source.replace("acc_acc = ok0_ ? (acc_acc + t0) : acc_acc;", "acc_acc = (acc_acc + t0);")
    missed = ks.source.replace("const bool ok0_ = lane_ + 0 < 3;", "const bool ok0_ = lane_ + 0 < 2;")
    assert twice != ks.source and missed != ks.source
    for src, what in ((twice, "counted twice"), (missed, "8 elements of in0 combined")):
        with pytest.raises(AssertionError, match=what):
            check_row_geometry(dataclasses.replace(ks, source=src))
