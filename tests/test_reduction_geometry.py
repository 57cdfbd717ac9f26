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

    twice = ks.source.replace("acc_acc = ok0_ ? __fadd_rn(acc_acc, t0) : acc_acc;", "acc_acc = __fadd_rn(acc_acc, t0);")
    missed = ks.source.replace("const bool ok0_ = lane_ + 0 < 3;", "const bool ok0_ = lane_ + 0 < 2;")
    assert twice != ks.source and missed != ks.source
    for src, what in ((twice, "counted twice"), (missed, "8 elements of in0 combined")):
        with pytest.raises(AssertionError, match=what):
            check_row_geometry(dataclasses.replace(ks, source=src))


class _ConvBnAbsLayerNorm(nn.Module):
    """The fuzzer's case: LayerNorm over (C, H, W) after conv, BatchNorm (folded into a per-channel
    shift read beside the row's values) and abs."""

    def __init__(self, c, hw, affine=False):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 1.5)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.2, 0.2)
        self.ln = nn.LayerNorm([c, *hw], elementwise_affine=affine)

    def forward(self, x):
        return self.ln(torch.abs(self.bn(self.conv(x))))


def _layer_norm_sources(c, hw, n=1, fmt=torch.contiguous_format, affine=False, dtype=torch.float32):
    torch.manual_seed(0)
    model = _ConvBnAbsLayerNorm(c, hw, affine).eval().to(dtype)
    x = torch.randn((n, c, *hw), generator=torch.Generator().manual_seed(1)).to(dtype).contiguous(memory_format=fmt)
    return [ks for name, ks in _row_sources(model, x) if name == "fx_red_native_layer_norm"]


def test_layer_norm_with_a_per_channel_shift_covers_each_row_once():
    """Fuzzer finding: LayerNorm([8, 1, 2]) after conv + BatchNorm + abs, input 1x8x1x2. Lane c of
    the 8 takes chunk c = the row's positions (c, 0) and (c, 1) (a vector of 2) and the folded
    BatchNorm shift in1[c] of its channel, which both positions add: each of in1's 8 elements is
    read twice per row, as the IR reads it, not counted twice (both phases, both widths)."""
    sources = _layer_norm_sources(8, (1, 2))
    assert sorted(ks.meta["geometry"]["vec"] for ks in sources) == [1, 2]
    v2 = next(ks for ks in sources if ks.meta["geometry"]["vec"] == 2)
    assert v2.name.startswith("fx_red_native_layer_norm_rows32v2_") and v2.meta["geometry"]["tpr"] == 8
    k = v2.meta["kernel"]
    assert [b.shape for b in k.inputs] == [(1, 8, 1, 2), (8,)]
    for ks in sources:
        assert check_row_geometry(ks) == {"rows": 1, "row_size": 16, "threads": 32, "phases": ["acc_m2", "acc_sum"]}


@pytest.mark.parametrize("c,hw,n", [(8, (1, 2), 2), (4, (3, 3), 1), (16, (2, 4), 1), (3, (2, 2), 3), (6, (5, 7), 2),
                                    (32, (4, 4), 1), (8, (1, 1), 5), (2, (8, 16), 1)])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_over_chw_with_per_channel_parameters(c, hw, n, fmt, affine):
    """The family: rows of C x H x W with the shift broadcast over H x W (and, affine, a weight
    and bias over the whole row), at every vector width and threads-per-row the plan takes."""
    sources = _layer_norm_sources(c, hw, n, fmt, affine)
    assert sources, "no register-row LayerNorm"
    for ks in sources:
        summary = check_row_geometry(ks)
        assert summary["rows"] == n and summary["row_size"] == c * hw[0] * hw[1]


def test_layer_norm_with_a_per_channel_shift_in_half_precision():
    """16-bit rows: vectors of 8 (16 bytes) beside the scalar row."""
    sources = _layer_norm_sources(16, (2, 4), dtype=torch.float16)
    assert sorted(ks.meta["geometry"]["vec"] for ks in sources) == [1, 8]
    for ks in sources:
        assert check_row_geometry(ks)["row_size"] == 128


def test_the_emulator_sees_a_wrong_per_channel_shift():
    """On the fuzzer's kernel: a position dropped or added twice, the shift of another channel
    (the right elements, paired with the wrong positions) and one shift for all channels."""
    import dataclasses

    ks = next(ks for ks in _layer_norm_sources(8, (1, 2)) if ks.meta["geometry"]["vec"] == 2)
    src = ks.source
    assert "acc_m2 = __fadd_rn(acc_m2, t11);" in src and "in1[(r0_0)]" in src
    cases = [(src.replace("acc_m2 = __fadd_rn(acc_m2, t11);", ""), "acc_m2: 8 elements of in0 combined for a row of 16"),
             (src.replace("acc_m2 = __fadd_rn(acc_m2, t11);", "acc_m2 = __fadd_rn(acc_m2, t11);\n    acc_m2 = __fadd_rn(acc_m2, t11);"),
              "acc_m2: 24 elements of in0 .* counted twice"),
             (src.replace("in1[(r0_0)]", "in1[(7 - r0_0)]"), "elements of no single position"),
             (src.replace("in1[(r0_0)]", "in1[(0)]"), "0 elements of in1 combined for a row of 16 that reads 16")]
    for bad, what in cases:
        assert bad != src
        with pytest.raises(AssertionError, match=what):
            check_row_geometry(dataclasses.replace(ks, source=bad))


def test_layer_norm_in_the_kernels_order_is_as_accurate_as_eagers():
    """The vec-2 kernel's arithmetic on the fuzzer's inputs, in float32: lane c adds its channel's
    shift to both of its values, sums them, the butterfly over 8 lanes; the squared deviations the
    same way; each row position enters the variance once, which lands at float64's."""
    torch.manual_seed(0)
    model = _ConvBnAbsLayerNorm(8, (1, 2)).eval()
    x = torch.randn((1, 8, 1, 2), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        bn = model.bn
        conv = model.conv(x)  # in0: the convolution; in1: BatchNorm folded, scale into it, shift apart
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        in0 = (conv * scale.view(1, 8, 1, 1)).reshape(16).numpy().astype(np.float32)
        in1 = (bn.bias - bn.running_mean * scale).numpy().astype(np.float32)
        exact = torch.nn.functional.layer_norm(torch.abs(torch.from_numpy(in0).double().view(8, 2)
                                                         + torch.from_numpy(in1).double().view(8, 1)), [8, 2])
    f32 = np.float32

    def butterfly(lanes):
        for o in (4, 2, 1):
            lanes = [f32(lanes[i] + lanes[i ^ o]) for i in range(8)]
        return lanes

    t = [[abs(f32(in0[2 * c + j] + in1[c])) for j in (0, 1)] for c in range(8)]
    mean = f32(butterfly([f32(f32(0) + t[c][0]) + t[c][1] for c in range(8)])[0] * f32(0.0625))
    d = [[f32(v - mean) for v in t[c]] for c in range(8)]
    m2 = butterfly([f32(f32(f32(0) + d[c][0] * d[c][0]) + f32(d[c][1] * d[c][1])) for c in range(8)])[0]
    rstd = f32(1 / np.sqrt(np.float64(f32(m2 * f32(0.0625)) + f32(1e-5))))
    got = np.array([[f32(v * rstd) for v in row] for row in d], dtype=np.float64)
    assert np.abs(got - exact.numpy()).max() <= 2e-6
