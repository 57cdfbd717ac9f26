"""Padding fused into a reduction's loads reads only elements inside its input (CPU only).

A padded max pool (window positions outside the input are -inf), an average pool and a constant
pad fused into a reduction are IR ``Where``s over the input's loads, emitted as
``c ? in0[i] : fill``: where ``c`` is false, ``i`` lies outside the input and is never read. For
every register-row reduction (``fxopt.fuzz.geometry``) and column reduction (``fxopt.fuzz.simt``)
generated for such regions, every thread of the launch is run on the CPU: each load a thread
performs lies within its buffer's span and each element of a row is combined once (a padded
window position combines nothing); the regions' IR matches their ATen ops
(``fxopt.testing.check_fusion``).

The first case is the CPU fuzzer's finding 50e36b7b8c (seed 3): BatchNorm, max_pool2d(2, 1, 1) and
InstanceNorm on a [1, 1, 1, 2] input, the pool fused into the InstanceNorm's row of 2 x 3. The
generated kernel guarded its loads; the row emulator took every ``in0[...]`` of a line as read,
the untaken branches' offsets -1 and 2 among them.
"""
import dataclasses
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxopt.backends.cuda import ir
from fxopt.backends.cuda.compiler import nvrtc_available
from fxopt.fuzz import Program
from fxopt.fuzz import check as fuzz_check
from fxopt.fuzz.backend_api import reduction_kernels, reduction_sources
from fxopt.fuzz.geometry import check_row_geometry, is_row_kernel
from fxopt.fuzz.graphs import render
from fxopt.fuzz.simt import check_column_geometry, is_column_kernel
from fxopt.testing import check_fusion
from fxopt.testing.strategies import CNNCase

_FUZZ_INIT = ["self.m0 = nn.BatchNorm2d(1)", "_random_stats(self.m0)", "self.m1 = nn.InstanceNorm2d(1, affine=False)"]
_FUZZ_FORWARD = ["x = self.m0(x)", "y = x", "x = F.max_pool2d(x, 2, 1, 1, ceil_mode=False)", "x = self.m1(x)"]


def _fuzz_program(executor: str = "cuda") -> Program:
    return Program(render(_FUZZ_INIT, _FUZZ_FORWARD, "x, y"), (1, 1, 1, 2), "float32", "contiguous", "inference", 0,
                   {"executor": executor, "autotune_cache": False}, ["batchnorm", "max2s1p1pool", "instancenorm"])


def _fuzz_row_kernels() -> list:
    model, x = fuzz_check.build(_fuzz_program(), "cpu")
    return [ks for _, k in reduction_kernels(model, (x,)) for ks in reduction_sources(k) if is_row_kernel(ks)]


def test_the_fuzzers_instance_norm_reads_only_inside_its_input():
    """The pooled row of 2 x 3 (r1: the pooled height 2, r0: the width 3) reads in0[r0 - 1] and
    in0[r0] of the one input row of 2 under their window's guards; the emulator reads them where
    the guard holds only: every load in [0, 2), each pooled position combined once."""
    sources = _fuzz_row_kernels()
    assert [ks.meta["geometry"]["vec"] for ks in sources] == [1]
    (ks,) = sources
    assert ks.name.startswith("fx_red_native_batch_norm_legit_rows32v1_")
    src = ks.source
    assert re.search(r"\? fx_to_f32\(in0\[\(r0_0 \+ -1\)\]\) : \(-__int_as_float\(0x7f800000\)\)\)", src)
    assert re.search(r"\? fx_to_f32\(in0\[\(r0_0\)\]\) : \(-__int_as_float\(0x7f800000\)\)\)", src)
    assert "in0[" not in re.sub(r"\(t\d+ \? fx_to_f32\(in0\[[^\]]*\]\) : [^;]*\);", "", src)  # every load guarded
    assert check_row_geometry(ks) == {"rows": 1, "row_size": 6, "threads": 32, "phases": ["acc_m2", "acc_sum"]}


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-core) not importable")
def test_the_fuzzers_program_passes_the_fuzzers_cpu_check():
    """The program as the fuzzer runs it on the CPU: kernels compiled by NVRTC, regions' IR
    against ATen, the row geometry."""
    assert fuzz_check.run_program(_fuzz_program(), "cpu")


def test_the_fuzzers_program_matches_eager():
    assert fuzz_check.run_program(_fuzz_program("torch"), "cpu")


def _first_guarded_load(src: str):
    m = re.search(r"\((t\d+) \? (fx_to_f32\(in0\[[^\]]*\]\)) : [^;]*\);", src)
    assert m, "no guarded load"
    return m


def test_the_emulator_sees_a_missing_or_wrong_guard():
    """On the fuzzer's kernel: the first guarded load read unguarded or under a guard that always
    holds reads outside the input; under one that never holds, the positions it reads miss their
    element."""
    (ks,) = _fuzz_row_kernels()
    m = _first_guarded_load(ks.source)
    cond = m.group(1) + " ?"
    cases = [(m.group(2) + ";", "outside its span 2"),
             (m.group(0).replace(cond, "true ?"), "outside its span 2"),
             (m.group(0).replace(cond, "false ?"), "missed")]
    for bad, what in cases:
        src = ks.source.replace(m.group(0), bad, 1)
        assert src != ks.source
        with pytest.raises(AssertionError, match=what):
            check_row_geometry(dataclasses.replace(ks, source=src))


class PaddedReduce(nn.Module):
    """A padded window op or constant pad (``pad``) followed by a reduction (``red``): the
    instance norm and the spatial mean (rows of H x W: register rows for NCHW, columns for
    channels_last), the softmax and sum over channels (columns for NCHW, rows for channels_last)."""

    def __init__(self, pad: str, red: str):
        super().__init__()
        self.pad, self.red = pad, red

    def forward(self, x):
        kind, *args = self.pad.split(":")
        if kind == "max":
            k, s, p = map(int, args)
            y = F.max_pool2d(x, k, s, p)
        elif kind == "avg":
            k, s, p = map(int, args)
            y = F.avg_pool2d(x, k, s, p, count_include_pad=False)
        else:
            y = F.pad(x, (1, 2, 0, 1), value=0.5)
        if self.red == "instance_norm":
            return F.instance_norm(y)
        if self.red == "mean":
            return y.mean((2, 3), keepdim=True)
        if self.red == "softmax":
            return torch.softmax(y, 1)
        return y.sum(1, keepdim=True)


def _check_structure(ks) -> str:
    """The kernel's launch run on the CPU by its family's emulator; returns which ran."""
    if is_row_kernel(ks):
        check_row_geometry(ks)
        return "row"
    if is_column_kernel(ks):  # small inputs: the float32 math of exp and division rounds
        check_column_geometry(ks, high=4, rtol=1e-4, atol=1e-4)
        return "column"
    return "other"


CASES = [(pad, red, shape) for pad in ("max:3:1:1", "max:2:1:1", "max:3:2:1", "avg:3:1:1", "constant")
         for red in ("instance_norm", "mean", "softmax", "sum") for shape in ((2, 3, 5, 7), (1, 8, 4, 4))
         if shape == (2, 3, 5, 7) or pad in ("max:3:1:1", "constant")]


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("pad, red, shape", CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v.replace(":", ""))
def test_padding_fused_into_a_reduction_reads_inside_its_input(pad, red, shape, dtype, fmt):
    """The region's IR against ATen; each of its kernels (widest vector and scalar) run thread by
    thread: loads inside the input, each element combined once, each output stored once."""
    model = PaddedReduce(pad, red).eval().to(dtype)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype).contiguous(memory_format=fmt)
    kinds = []
    for sched in check_fusion(CNNCase(model, (x,), dtype)):
        for region in sched.regions:
            k = region.kernel
            if not hasattr(k, "reduced"):
                continue
            assert any(isinstance(e, ir.Where) for ph in k.phases for e in ir.walk(ph.value)), "the padding not fused"
            kinds += [_check_structure(ks) for ks in reduction_sources(k)]
    assert kinds and "other" not in kinds, kinds


def test_the_cases_reach_row_and_column_kernels_at_several_widths():
    """The family covers both reduction mappings, with vector loads beside the guarded ones."""
    seen = set()
    for pad, red, shape, fmt in [("max:3:1:1", "instance_norm", (1, 8, 4, 4), torch.contiguous_format),
                                 ("max:3:1:1", "mean", (1, 8, 4, 4), torch.channels_last),
                                 ("constant", "softmax", (2, 3, 5, 7), torch.contiguous_format),
                                 ("constant", "sum", (1, 8, 4, 4), torch.channels_last)]:
        x = torch.randn(shape).contiguous(memory_format=fmt)
        for _, k in reduction_kernels(PaddedReduce(pad, red).eval(), (x,)):
            for ks in reduction_sources(k):
                seen.add((_check_structure(ks), ks.meta["geometry"]["vec"]))
    assert {("row", 1), ("row", 4), ("column", 1), ("column", 4)} <= seen, seen
