"""The NVRTC compiler module (``fxopt.backends.cuda.compiler``): ``CompileError`` with the log and the
source, its cache in memory and on disk (damaged files rewritten), parallel compiles in order, launch
arguments, programmatic dependent launch (the wait first, the switch), the default architecture;
kernels from the code generators of tests/test_cuda_codegen.py."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from fxopt.backends.cuda import compiler as nvrtc
from fxopt.backends.cuda.codegen import c as csnip, source
from fxopt.backends.cuda.kernels import common

from test_cuda_codegen import ARCH, compile_all, epi_kernel, needs_nvrtc


_uid = itertools.count()


def unique_source(tag=""):
    n = f"fx_test_{os.getpid()}_{next(_uid)}{tag}"
    return n, f'extern "C" __global__ void {n}(float* x, long long n) {{\n  if (n) x[0] = 1.f;\n}}\n'


@needs_nvrtc
def test_compile_error_carries_log_source_and_line():
    src = ('extern "C" __global__ void fx_broken(float* x) {\n'
           '  x[0] = 1.f;\n'
           '  x[1] = undefined_symbol;\n'
           '}\n')
    with pytest.raises(nvrtc.CompileError) as ei:
        nvrtc.compile_kernel(src, "fx_broken", ARCH)
    e = ei.value
    assert e.name == "fx_broken" and e.source == src and "undefined_symbol" in e.log
    assert e.error_lines() == [3]
    msg = str(e)
    assert "fx_broken" in msg and ">    3 |   x[1] = undefined_symbol;" in msg
    assert "     2 |   x[0] = 1.f;" in msg


@needs_nvrtc
@pytest.mark.parametrize("layout,vec", [("nchw", 1), ("nhwc", 8)])
def test_fast_math_epilogue_template_only_where_an_activation_has_exp_or_a_quotient(layout, vec):
    """Option fast_math reaches the conv-epilogue kernel: the activation's exp and quotient approximate
    (no IEEE division left in the PTX) in every float dtype; an activation without them is unchanged."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        ieee, fast = (epi_kernel("silu", (), True, True, dtype, layout, vec, fast_math=f) for f in (False, True))
        assert fast.meta["fast_math"] and fast.name == ieee.name + "_fm"
        assert fast.source.replace(fast.name, ieee.name) == "#define FXOPT_FAST_MATH 1\n" + ieee.source
        ptx_ieee, ptx_fast = (nvrtc.compile_ptx(k.source, k.name, ARCH) for k in (ieee, fast))
        assert "div.rn.f32" in ptx_ieee and "div.rn.f32" not in ptx_fast
        relu = epi_kernel("relu", (), True, False, dtype, layout, vec, fast_math=True)
        assert not relu.meta["fast_math"] and relu.source == epi_kernel("relu", (), True, False, dtype, layout, vec).source
    compile_all([epi_kernel("hardswish", (), True, True, dt, layout, vec, fast_math=True)
                 for dt in (torch.float16, torch.float32)])


@needs_nvrtc
def test_compile_error_from_a_broken_epilogue(monkeypatch):
    monkeypatch.setitem(csnip._UNARY_C, "relu", "({a} +* )")
    ks = epi_kernel("relu", (), False, False)
    with pytest.raises(nvrtc.CompileError) as ei:
        ks.compile(ARCH)
    lines = ei.value.error_lines()
    assert lines and "+* )" in ks.source.splitlines()[lines[0] - 1]
    assert f"> {lines[0]:4d} | " in str(ei.value) or f">{lines[0]:5d} | " in str(ei.value)


@needs_nvrtc
def test_cache_memory_then_disk_hit():
    name, src = unique_source()
    before = nvrtc.cache_stats().get("nvrtc_compiles", 0)
    a = nvrtc.compile_kernel(src, name, ARCH)
    assert a.cache_source is None and nvrtc.cache_stats()["nvrtc_compiles"] == before + 1
    assert nvrtc.compile_kernel(src, name, ARCH) is a  # in-memory hit
    nvrtc.clear_memory_cache()
    disk_before = nvrtc.cache_stats().get("disk_hits", 0)
    b = nvrtc.compile_kernel(src, name, ARCH)
    assert b.cache_source == "disk" and b.cubin == a.cubin
    assert nvrtc.cache_stats()["nvrtc_compiles"] == before + 1
    assert nvrtc.cache_stats()["disk_hits"] == disk_before + 1
    # the key covers arch and options
    c = nvrtc.compile_kernel(src, name, "sm_80")
    d = nvrtc.compile_kernel(src, name, ARCH, {"lineinfo": True})
    assert len({a.key, c.key, d.key}) == 3
    assert nvrtc.cache_stats()["nvrtc_compiles"] == before + 3


@needs_nvrtc
def test_cache_dir_from_env_and_atomic_files(tmp_path, monkeypatch):
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path / "c"))
    name, src = unique_source()
    ck = nvrtc.compile_kernel(src, name, ARCH)
    files = list((tmp_path / "c" / "kernels").rglob("*.cubin"))
    assert [f.name for f in files] == [f"{ck.key}.cubin"]
    assert not [f for f in files[0].parent.iterdir() if f.name.startswith(".tmp-")]


@needs_nvrtc
@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "garbage"])
def test_corrupt_cache_file_is_ignored_and_rewritten(damage):
    name, src = unique_source(damage)
    ck = nvrtc.compile_kernel(src, name, ARCH)
    path = nvrtc.cache_dir() / ck.key[:2] / f"{ck.key}.cubin"
    blob = path.read_bytes()
    bad = {"truncate": blob[: len(blob) // 2], "empty": b"", "garbage": b"not a cubin\n" * 3,
           "flip": blob[:-1] + bytes([blob[-1] ^ 0xFF])}[damage]
    path.write_bytes(bad)
    nvrtc.clear_memory_cache()
    stats = nvrtc.cache_stats()
    again = nvrtc.compile_kernel(src, name, ARCH)
    now = nvrtc.cache_stats()
    assert now["nvrtc_compiles"] == stats["nvrtc_compiles"] + 1
    assert now.get("corrupt_cache_files", 0) == stats.get("corrupt_cache_files", 0) + 1
    assert again.cubin == ck.cubin and path.read_bytes() == blob


@needs_nvrtc
def test_compile_many_keeps_order_and_raises():
    items = [unique_source() for _ in range(6)]
    out = nvrtc.compile_many(((s, n) for n, s in items), arch=ARCH, max_workers=3)  # any iterable
    assert [k.name for k in out] == [n for n, _ in items]
    assert [k.source for k in out] == [s for _, s in items]
    assert nvrtc.compile_many([]) == []
    name, src = unique_source()  # asked for three times (three nodes alike): compiled once
    before = nvrtc.cache_stats().get("nvrtc_compiles", 0)
    same = nvrtc.compile_many([(src, name)] * 3 + [(s, n) for n, s in items[:1]], arch=ARCH, max_workers=3)
    assert nvrtc.cache_stats()["nvrtc_compiles"] == before + 1  # items[0] is in the memory cache already
    assert same[0] is same[1] is same[2] and same[3].name == items[0][0]
    bad = [(s, n) for n, s in (unique_source() for _ in range(2))] + [("garbage(", "fx_bad")]
    with pytest.raises(nvrtc.CompileError):
        nvrtc.compile_many(bad, arch=ARCH)


def test_arg_conversion_and_empty_launch_is_noop():
    ck = nvrtc.CompiledKernel("k", "", ARCH, b"x", ("const float*", "float*", "long long", "int", "float"))
    t = torch.zeros(4)
    args = ck.convert_args([t, 1234, 7, 3, 0.5])
    assert args[0] == t.data_ptr() and args[1] == 1234
    assert isinstance(args[2], np.int64) and isinstance(args[3], np.int32) and isinstance(args[4], np.float32)
    with pytest.raises(TypeError):
        ck.convert_args([t])
    with pytest.raises(TypeError):
        ck.convert_args([t, t, t, 1, 1.0])
    untyped = nvrtc.CompiledKernel("k", "", ARCH, b"x").convert_args([t, 3, 2.5, np.int32(1)])
    assert [type(a) for a in untyped[1:]] == [np.int64, np.float32, np.int32]
    ck.launch((0, 1, 1), 256, [t, t, 0, 0, 0.0])  # empty grid: returns before touching CUDA
    ck.launch(1, (0,), [t, t, 0, 0, 0.0])


def test_pdl_safe_needs_the_wait_as_first_statement():
    ok = 'extern "C" __global__ void __launch_bounds__(256)\nk(float* y) {\n  fx_pdl_begin();  // c\n  y[0] = 1.f;\n}'
    late = 'extern "C" __global__ void k(float* y) {\n  y[0] = 1.f;\n  fx_pdl_begin();\n}'
    assert nvrtc.CompiledKernel("k", ok, ARCH, b"x").pdl_safe
    assert not nvrtc.CompiledKernel("k", late, ARCH, b"x").pdl_safe
    assert not nvrtc.CompiledKernel("k", 'extern "C" __global__ void k() {}', ARCH, b"x").pdl_safe
    from importlib import resources
    tdir = resources.files(common.__package__).joinpath("templates")
    kernels = [p for p in tdir.iterdir() if p.name.endswith(".cu") and "__global__" in p.read_text()]
    assert len(kernels) >= 9
    for path in kernels:  # every kernel template opts in
        assert nvrtc._PDL_FIRST.search(path.read_text()), path.name


@pytest.mark.parametrize("env,capability,want", [(None, (9, 0), True), ("0", (9, 0), False),
                                                 ("1", (8, 0), False), (None, (10, 0), True)])
def test_programmatic_launch_switch(monkeypatch, env, capability, want):
    if env is None:
        monkeypatch.delenv("FXOPT_PDL", raising=False)
    else:
        monkeypatch.setenv("FXOPT_PDL", env)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(nvrtc, "_launch_config_has_pdl", lambda: True)
    assert nvrtc.programmatic_launch_supported(0) is want


def test_launch_sets_programmatic_serialization_only_when_asked(monkeypatch):
    seen = []

    class FakeCore:
        class Stream:
            @staticmethod
            def from_handle(handle):
                return ("stream", handle)

        @staticmethod
        def LaunchConfig(**kw):
            return kw

        @staticmethod
        def launch(stream, cfg, kernel, *args):
            seen.append((stream, cfg, kernel, args))

    class FakeTorchStream:
        cuda_stream = 12345

    monkeypatch.setattr(nvrtc, "_core", lambda: FakeCore)
    monkeypatch.setattr(nvrtc, "_STREAMS", {})
    nvrtc._launch("kern", (1, 1, 1), (32, 1, 1), 0, FakeTorchStream(), [1], pdl=True)
    nvrtc._launch("kern", (1, 1, 1), (32, 1, 1), 0, FakeTorchStream(), [1], pdl=False)
    assert seen[0][1]["programmatic_stream_serialization"] is True
    assert "programmatic_stream_serialization" not in seen[1][1]
    assert seen[0][0] == ("stream", 12345) and seen[0][2] == "kern" and seen[0][3] == (1,)


def test_default_arch():
    assert nvrtc.default_arch("sm_80") == "sm_80"
    if not torch.cuda.is_available():
        assert nvrtc.default_arch() == "sm_90"
    else:
        assert nvrtc.default_arch() == "sm_%d%d" % torch.cuda.get_device_capability()


@needs_nvrtc
def test_pending_kernels_overlap_and_isolate_a_failure():
    """The executor's background compilation: an item's kernels are filled when that item is
    asked for (the others may still compile); a kernel that fails leaves its item without any
    kernel, the other items keep theirs, and the report records every kernel in order, the bad
    one with its NVRTC log."""
    from types import SimpleNamespace

    from fxopt.backends.cuda.runtime.executor import PendingKernels

    def item(*sources):
        return SimpleNamespace(sources={i: source.KernelSource(n, s, (), "test") for i, (n, s) in enumerate(sources)},
                               kernels={})

    good1, good2 = item(unique_source(), unique_source()), item(unique_source())
    bad = item(unique_source(), ("fx_bad_kernel", 'extern "C" __global__ void fx_bad_kernel() { garbage( }'))
    info = {"kernels": []}
    pending = PendingKernels([good1, bad, good2], info)
    pending.ready([good2])
    assert len(good2.kernels) == 1 and good2.kernels[0].compiled
    assert good1.kernels == {} and info["kernels"] == []  # not asked for yet, nothing recorded yet
    pending.finish()
    assert len(good1.kernels) == 2 and bad.kernels == {}
    names = [ks.name for it in (good1, bad, good2) for ks in it.sources.values()]
    assert [k.name for k in info["kernels"]] == names
    assert [k.compiled for k in info["kernels"]] == [True, True, True, False, True]
    assert "garbage" in info["kernels"][3].error and pending.compile_s > 0
