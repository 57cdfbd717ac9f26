"""The GPU fuzzer's failures kept as regression tests: each program as the fuzzer drew it (with its
seed and options), built and run eagerly and through the cuda executor's CPU-checkable part in CI,
and judged as the fuzzer judges it on a GPU (``-m gpu``)."""
import pytest
import torch

from fxopt.fuzz import Program
from fxopt.fuzz import check as fuzz_check


_BN = "_random_stats(self.m{})"
GPU_REPRODUCERS = {  # GPU fuzz seeds 41 / 51 (2026-11-27): shape, dtype, fmt, mode, init, forward, returned
    "9785f6078b": ((1, 2, 1, 2), "float16", "contiguous", "training", [
        "self.m0 = nn.BatchNorm2d(2)", _BN.format(0), "self.m1 = nn.Conv2d(2, 2, 1, padding=0, bias=False)",
        "self.m2 = nn.BatchNorm2d(2)", _BN.format(2), "self.m3 = nn.Conv2d(2, 2, 1, padding=0, bias=False)",
        "self.m4 = nn.BatchNorm2d(2)", _BN.format(4), "self.m5 = nn.Linear(4, 1)", "self.m6 = nn.Linear(1, 1)"],
        ["x = self.m0(x)", "x = torch.abs(self.m2(self.m1(x)) + x)", "x = torch.abs(self.m4(self.m3(x)) + x)",
         "x = self.m6(F.gelu(self.m5(torch.flatten(x, 1))))"], "x"),
    "349ac6a1e1": ((1, 2, 1, 2), "float16", "contiguous", "training", [
        "self.m0 = nn.GroupNorm(1, 2, affine=False)", "self.m1 = nn.Conv2d(2, 2, 1, padding=0, bias=False)",
        "self.m2 = nn.BatchNorm2d(2)", _BN.format(2), "self.m3 = nn.Conv2d(2, 1, 1)", "self.m4 = nn.Conv2d(1, 2, 1)"],
        ["x = self.m0(x)", "x = F.leaky_relu(self.m2(self.m1(x)) + x, 0.1)",
         "x = x * torch.sigmoid(self.m4(F.hardswish(self.m3(x.mean((2, 3), keepdim=True)))))"], "x"),
    "5bf7573163": ((1, 2, 1, 2), "float16", "contiguous", "training", [
        "self.m0 = nn.Conv2d(2, 2, 1, stride=1, padding='same', dilation=1, groups=2, bias=False)",
        "self.m1 = nn.GroupNorm(1, 2, affine=False)", "self.m2 = nn.Conv2d(2, 1, 1)", "self.m3 = nn.Conv2d(1, 2, 1)"],
        ["x = torch.abs(self.m0(x))", "x = self.m1(x)", "y = x",
         "x = x * torch.sigmoid(self.m3(F.hardswish(self.m2(x.mean((2, 3), keepdim=True)))))"], "x, y"),
    "4671d707b6": ((1, 2, 1, 2), "float16", "contiguous", "training", [
        "self.m0 = nn.Conv2d(2, 2, 1, stride=1, padding='same', dilation=1, groups=1, bias=False)",
        "self.m1 = nn.BatchNorm2d(2)", _BN.format(1), "self.m2 = nn.GroupNorm(1, 2, affine=False)",
        "self.m3 = nn.Conv2d(2, 2, 1, stride=1, padding=0, dilation=1, groups=1, bias=False)"],
        ["x = x - x.mean((1,), keepdim=True)", "x = torch.abs(self.m0(x))", "x = self.m1(x)", "x = self.m2(x)",
         "x = torch.abs(self.m3(x))"], "x"),
    "649729573e": ((1, 1, 1, 2), "float16", "contiguous", "inference", [  # GPU fuzz seed 61: test_fp16_rounding.py
        "self.m0 = nn.Conv2d(1, 1, 3, stride=1, padding=1, dilation=1, groups=1, bias=True)",
        "self.m1 = nn.InstanceNorm2d(1, affine=False)"],
        ["x = x.to(torch.bfloat16).to(x.dtype) * 2.0", "x = torch.abs(x)", "x = torch.abs(self.m0(x))",
         "x = x - x.mean((1,), keepdim=True)", "x = self.m1(x)"], "x"),
    "a6d9fae0a3": ((1, 2, 4, 4), "float32", "channels_last", "inference", [],
                   ["x = F.max_pool2d(x, 2, 1, 0, ceil_mode=False)", "x = F.interpolate(x, scale_factor=2, mode='nearest')",
                    "y = x"], "x, y"),
    "fd5d5f69d6": ((1, 8, 1, 2), "float32", "channels_last", "inference", [],
                   ["x = F.interpolate(x, scale_factor=2, mode='bilinear', align_corners=False)", "y = x"],
                   "x, y.transpose(2, 3)"),
    # GPU fuzz 2026-11-28 (seeds 63-67): each with its seed and options
    "a93a79118e": ((5, 7, 9, 5), "float32", "channels_last", "training", [  # amax's maxima: test_selecting_reductions
        "self.m0 = nn.Conv2d(14, 14, 1, stride=1, padding='same', dilation=1, groups=14, bias=True)",
        "self.m1 = nn.BatchNorm2d(14)", _BN.format(1)],
        ["a = x", "x = torch.cat([x, F.gelu(a, approximate='tanh')], 1)",
         "x = F.gelu(self.m1(self.m0(x)), approximate='tanh')", "x = x - x.amax((1,), keepdim=True)",
         "x = x - x.sum((2,), keepdim=True)"], "x", 219, {}),
    "c0a961fbcc": ((1, 2, 1, 2), "float16", "contiguous", "training", [  # GroupNorm's gradient: test_backend
        "self.m0 = nn.GroupNorm(1, 2, affine=False)", "self.m1 = nn.Conv2d(2, 2, 1, padding=0, bias=False)",
        "self.m2 = nn.BatchNorm2d(2)", _BN.format(2),
        "self.m3 = nn.Conv2d(2, 2, 1, stride=1, padding=0, dilation=1, groups=1, bias=False)"],
        ["x = self.m0(x)", "x = F.elu(x)", "x = torch.abs(self.m2(self.m1(x)) + x)", "x = F.elu(self.m3(x))"],
        "x", 12366, {"conv_algorithm": "fft", "cudagraphs": False}),
    "f1b43b3664": ((1, 12, 1, 2), "float32", "channels_last", "inference", [  # aliasing: test_eager_formats
        "self.m0 = nn.Conv2d(12, 16, 3, stride=1, padding=1, dilation=1, groups=4, bias=False)",
        "self.m1 = nn.Conv2d(16, 16, 1, stride=1, padding=0, dilation=1, groups=1, bias=False)"],
        ["x = torch.abs(self.m0(x))", "x = torch.abs(self.m1(x))", "y = x"], "x, y.transpose(2, 3)", 0,
        {"conv_algorithm": "winograd_2x2_3x3"}),
    "081a07d4c1": ((1, 7, 1, 2), "float32", "contiguous", "training", [  # a constant row: test_constant_rows
        "self.m0 = nn.Conv2d(7, 7, 3, stride=1, padding=1, dilation=1, groups=1, bias=False)",
        "self.m1 = nn.Conv2d(7, 7, 3, stride=1, padding=1, dilation=1, groups=1, bias=False)",
        "self.m2 = nn.LayerNorm(7, elementwise_affine=False)"],
        ["x = torch.abs(self.m0(x))", "y = x", "x = torch.abs(self.m1(x))",
         "x = F.pad(x, (0, 0, 0, 1), mode='constant', value=-1.5)",
         "x = self.m2(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)"], "x, y", 0, {}),
    "eaa5b52212": ((1, 16, 1, 2), "float32", "channels_last", "inference", [  # Winograd's strides: test_eager_formats
        "self.m0 = nn.Conv2d(16, 16, 1, stride=1, padding=0, dilation=1, groups=1, bias=False)",
        "self.m1 = nn.Conv2d(16, 16, 3, padding=1, bias=False)", "self.m2 = nn.BatchNorm2d(16)", _BN.format(2)],
        ["x = torch.abs(self.m0(x))", "x = torch.abs(x)", "x = F.gelu(self.m2(self.m1(x)) + x)"], "x", 0,
        {"conv_algorithm": "winograd_2x2_3x3"}),
    # GPU fuzz 2026-11-28 (seeds 68, 69): judged since against the perturbed runs and the branch-flip run
    "95116b2fe4": ((2, 8, 2, 3), "float16", "contiguous", "inference", [  # LayerNorm over 2 channels
        "self.m0 = nn.Conv2d(8, 2, 3, stride=1, padding=1, dilation=1, groups=1, bias=True)",
        "self.m1 = nn.BatchNorm2d(2)", _BN.format(1), "self.m2 = nn.LayerNorm(2, elementwise_affine=False)",
        "self.m3 = nn.BatchNorm2d(2)", _BN.format(3)],
        ["x = torch.abs(self.m1(self.m0(x)))", "x = F.pad(x, (0, 0, 0, 0), mode='reflect')",
         "x = self.m2(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)", "x = self.m3(x)"], "x", 0,
        {"conv_algorithm": "winograd_2x2_3x3"}),
    "736f3d759a": ((3, 12, 7, 4), "float16", "channels_last", "training", [  # a gradient through abs's kink
        "self.m0 = nn.Conv2d(12, 6, 3, stride=1, padding=1, dilation=1, groups=6, bias=True)",
        "self.m1 = nn.BatchNorm2d(6)", _BN.format(1), "self.m2 = nn.Conv2d(6, 6, (3, 1), 1, (1, 0), 1, 1, bias=False)",
        "self.m3 = nn.BatchNorm2d(6)", _BN.format(3)],
        ["x = F.gelu(self.m1(self.m0(x)))", "x = torch.abs(self.m2(x) + x)",
         "x = F.pad(x, (0, 0, 0, 0), mode='constant', value=0.0)", "x = self.m3(x)"], "x", 9283, {}),
    # GPU fuzz 2026-11-28 (seed 72): strides and views (test_eager_formats)
    "be7f1a0376": ((1, 2, 5, 5), "float32", "channels_last", "inference", [  # ATen's format from a fused kernel's
        "self.m0 = nn.Conv2d(2, 2, 3, stride=2, padding=0, dilation=2, groups=1, bias=False)"],  # size-1 strides
        ["x = F.leaky_relu(self.m0(x), 0.1)", "y = x", "x = F.interpolate(x, scale_factor=2, mode='nearest')",
         "x = F.interpolate(x, scale_factor=2, mode='nearest')"], "x, y", 0, {}),
    "2e22e3cf84": ((1, 16, 2, 2), "float32", "channels_last", "inference", [  # a pointwise op over a transpose
        "self.m0 = nn.Conv2d(16, 16, 3, stride=1, padding=1, dilation=1, groups=2, bias=False)",
        "self.m1 = nn.Conv2d(16, 16, 1, stride=1, padding=0, dilation=1, groups=1, bias=False)"],
        ["x = torch.abs(self.m0(x))", "x = torch.abs(x)", "x = torch.abs(self.m1(x))", "x = x.transpose(2, 3) * 1.5"],
        "x", 0, {}),
    "e489bb7fe8": ((1, 16, 2, 1), "float32", "contiguous", "inference", [  # a one-channel value, then a flatten
        "self.m0 = nn.Conv2d(16, 16, 3, stride=1, padding=1, dilation=1, groups=1, bias=False)",
        "self.m1 = nn.BatchNorm2d(16)", _BN.format(1), "self.m2 = nn.BatchNorm2d(16)", _BN.format(2),
        "self.m3 = nn.BatchNorm2d(16)", _BN.format(3),
        "self.m4 = nn.Conv2d(16, 1, 3, stride=1, padding=1, dilation=1, groups=1, bias=False)",
        "self.m5 = nn.Conv2d(1, 2, 3, stride=1, padding=1, dilation=1, groups=1, bias=False)",
        "self.m6 = nn.Linear(4, 1)", "self.m7 = nn.Linear(1, 1)"],
        ["x = torch.abs(self.m0(x))", "x = self.m1(x)", "x = self.m2(x)", "x = self.m3(x)", "x = torch.abs(self.m4(x))",
         "x = torch.abs(self.m5(x))", "x = self.m7(F.gelu(self.m6(torch.flatten(x, 1))))"], "x", 0,
        {"conv_algorithm": "winograd_2x2_3x3"}),
    # GPU fuzz 2026-11-28 (seeds 73-75): open, each in OPEN with what is known
    "60928602b9": ((1, 8, 1, 5), "float16", "contiguous", "training", [
        "self.m0 = nn.Conv2d(8, 8, 2, stride=1, padding='same', dilation=2, groups=8, bias=False)",
        "self.m1 = nn.BatchNorm2d(8)", _BN.format(1), "self.m2 = nn.Conv2d(8, 8, 1, padding=0, bias=False)",
        "self.m3 = nn.BatchNorm2d(8)", _BN.format(3)],
        ["x = torch.abs(self.m1(self.m0(x)))", "y = x", "x = torch.abs(self.m3(self.m2(x)) + x)"], "x, y", 0, {}),
    "7c5eb76ce1": ((1, 1, 6, 1), "float16", "contiguous", "training", [
        "self.m0 = nn.Conv2d(1, 1, 1, padding=0, bias=False)", "self.m1 = nn.BatchNorm2d(1)",
        _BN.format(1), "self.m2 = nn.BatchNorm2d(1)",
        _BN.format(2), "self.m3 = nn.Conv2d(1, 1, 3, stride=1, padding=1, dilation=1, groups=1, bias=False)"],
        ["x = x.to(torch.bfloat16).to(x.dtype) * 2.0", "x = torch.abs(self.m1(self.m0(x)) + x)",
        "x = F.avg_pool2d(x, 2, 1, 1, ceil_mode=False, count_include_pad=False)", "x = self.m2(x)",
        "x = torch.abs(self.m3(x))"], "x", 0, {}),
    "2ea87f01e0": ((64, 12, 8, 8), "bfloat16", "contiguous", "training", [
        "self.m0 = nn.Conv2d(12, 12, (1, 1), 1, (0, 0), 2, 3, bias=True)",
        "self.m1 = nn.Conv2d(12, 12, (3, 3), 1, (2, 2), 2, 3, bias=False)",
        "self.m2 = nn.Conv2d(12, 12, (1, 1), 1, (0, 0), 2, 3, bias=False)", "self.m3 = nn.Linear(12, 3)",
        "self.m4 = nn.Linear(3, 2)"],
        ["x = F.adaptive_avg_pool2d(x, 1)", "y = x", "x = torch.softmax(x, dim=1)",
        "x = torch.abs(self.m0(x) + self.m1(x) + self.m2(x) + x)", "x = x.to(torch.float16).to(x.dtype) * 2.0",
        "x = self.m4(self.m3(torch.flatten(x, 1)))"], "x, y[:, :1]",
        23119, {'cudagraphs': False, 'fast_math': False}),
    "1b24f0e72f": ((1, 1, 1, 1), "float16", "contiguous", "training", [
        "self.m0 = nn.Conv2d(1, 1, 1)", "self.m1 = nn.Conv2d(1, 1, 1)",
        "self.m2 = nn.Conv2d(1, 1, (3, 3), 1, (1, 1), 1, 1, bias=True)", "self.m3 = nn.Linear(9, 1)",
        "self.m4 = nn.Linear(1, 1)"],
        ["x = x * torch.sigmoid(self.m1(F.hardswish(self.m0(x.mean((2, 3), keepdim=True)))))",
        "x = F.interpolate(x, scale_factor=2, mode='nearest')", "x = x - x.mean((1,), keepdim=True)",
        "x = torch.abs(self.m2(x))", "x = F.avg_pool2d(x, 2, 1, 1, ceil_mode=False, count_include_pad=False)",
        "x = self.m4(F.gelu(self.m3(torch.flatten(x, 1))))"], "x", 78, {'cudagraphs': True}),
    # GPU fuzz 2026-11-28 (seed 80)
    "6e42ecd3e1": ((64, 4, 12, 3), "bfloat16", "contiguous", "training", [
        "self.m0 = nn.Conv2d(4, 4, (1, 1), 1, (0, 0), 1, 4, bias=True)", "self.m1 = nn.BatchNorm2d(4)",
        _BN.format(1), "self.m2 = nn.Conv2d(4, 4, (3, 3), 1, (1, 1), 1, 4, bias=False)", "self.m3 = nn.BatchNorm2d(4)",
        _BN.format(3), "self.m4 = nn.Conv2d(4, 8, 2, stride=1, padding='same', dilation=1, groups=4, bias=False)",
        "self.m5 = nn.BatchNorm2d(8)", _BN.format(5), "self.m6 = nn.Linear(8, 1)", "self.m7 = nn.Linear(1, 2)"],
        ["x = torch.tanh(self.m1(self.m0(x)) + self.m3(self.m2(x)))", "x = F.adaptive_avg_pool2d(x, 1)",
        "x = F.hardsigmoid(self.m5(self.m4(x)))", "x = self.m7(F.gelu(self.m6(torch.flatten(x, 1))))"], "x", 10, {}),
    # GPU fuzz 2026-12-03 (seed 81)
    "68a548ca2f": ((1, 5, 6, 9), "float32", "channels_last", "training", [
        "self.m0 = nn.Conv2d(5, 2, 1)", "self.m1 = nn.Conv2d(2, 5, 1)",
        "self.m2 = nn.Conv2d(5, 5, 1, stride=1, padding=0, dilation=1, groups=5, bias=True)"],
        ["x = x * torch.sigmoid(self.m1(F.silu(self.m0(x.mean((2, 3), keepdim=True)))))",
        "x = F.avg_pool2d(x, 3, 1, 1, ceil_mode=False, count_include_pad=True)", "x = F.mish(self.m2(x))",
        "x = x + 0.1 * x.amin((3,), keepdim=True)"], "x", 533, {"conv_algorithm": "winograd_2x2_3x3"}),
    # GPU fuzz 2026-12-05 (seed 90): a product minus its own mean, contracted into an FMA (test_constant_rows)
    "696d585eed": ((1, 1, 2, 8), "float32", "contiguous", "inference", [
        "self.m0 = nn.LayerNorm(1, elementwise_affine=False)", "self.m1 = nn.Linear(16, 1)", "self.m2 = nn.Linear(1, 1)"],
        ["x = x * torch.sigmoid(x.mean((1,), keepdim=True))",
         "x = self.m0(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)", "y = x",
         "x = self.m2(F.gelu(self.m1(torch.flatten(x, 1))))"], "x, y", 2753,
        {"conv_algorithm": "gemm", "cudagraphs": False}),
    # CPU fuzz 2026-12-05 (seed 197, emulated kernels): two equal values' float32 noise scaled by 1 / sqrt(eps);
    # judged against eager's error at nearby inputs (references.EagerNearby)
    "88d430b4dc": ((1, 8, 1, 2), "float32", "contiguous", "training", [
        "self.m0 = nn.Linear(8, 1)", "self.m1 = nn.Linear(1, 8, bias=True)", "self.m2 = nn.InstanceNorm2d(8, affine=False)",
        "self.m3 = nn.GroupNorm(1, 8, affine=False)", "self.m4 = nn.BatchNorm2d(8)", _BN.format(4)],
        ["x = (self.m1(F.gelu(self.m0(x.permute(0, 2, 3, 1))))).permute(0, 3, 1, 2)", "y = x", "x = self.m2(x)",
         "x = self.m3(x)", "a, c = torch.chunk(x, 2, dim=1)", "x = torch.cat([torch.abs(a), c], 1)",
         "x = self.m4(x)"], "x, y"),
    # CPU fuzz 2026-12-05 (seed 203, emulated kernels): a reader of two outputs of a kernel it was merged
    # into read one of them back; and a merged kernel moved past its first output's readers (test_consumers)
    "96e3afdf1f": ((1, 1, 1, 1), "float32", "contiguous", "training", [
        "self.m0 = nn.Linear(1, 1)", "self.m1 = nn.Linear(1, 1)"],
        ["x = F.pad(x, (0, 0, 0, 0), mode='constant', value=0.0)", "x = torch.abs(x)", "x = torch.abs(x)",
         "x = F.interpolate(x, size=(1, 1), mode='bilinear', align_corners=False)",
         "x = self.m1(F.gelu(self.m0(torch.flatten(x, 1))))"], "x"),
}


#: reproducers still failing on the GPU, with what is known (the GPU test expects them to fail)
OPEN: dict = {}


def gpu_reproducer(tag: str) -> Program:
    from fxopt.fuzz.graphs import render

    shape, dtype, fmt, mode, init, forward, ret, *rest = GPU_REPRODUCERS[tag]
    seed, options = rest if rest else (0, {})
    return Program(render(init, forward, ret), shape, dtype, fmt, mode, seed,
                   {**options, "executor": "cuda", "autotune_cache": False}, [tag])


@pytest.mark.parametrize("tag", sorted(GPU_REPRODUCERS))
def test_gpu_reproducers_build_and_run_eagerly(tag):
    """The GPU test's programs are the reproducers' models (what eager runs of them on the CPU)."""
    model, x = fuzz_check.build(gpu_reproducer(tag), "cpu")
    assert x.shape == GPU_REPRODUCERS[tag][0] and model(x) is not None


@pytest.mark.parametrize("tag", sorted(GPU_REPRODUCERS))
def test_gpu_reproducers_checkable_part_passes_on_the_cpu(tag):
    """Their CPU-checkable part: every kernel generated and compiled with NVRTC, every fused region's IR
    against its ATen ops, the reductions' thread mappings emulated (``check.check_cuda_on_cpu``)."""
    graphs = fuzz_check.run_program(gpu_reproducer(tag), "cpu")
    assert graphs and all(g.fallback is None for g in graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("tag", [pytest.param(t, marks=pytest.mark.xfail(reason=OPEN[t], strict=False)) if t in OPEN
                                 else t for t in sorted(GPU_REPRODUCERS)])
def test_gpu_reproducers_pass(tag):
    """The GPU fuzzer's failures, judged as the fuzzer judges them (two calls: a capture, a replay)."""
    assert fuzz_check.run_program(gpu_reproducer(tag), "cuda")
