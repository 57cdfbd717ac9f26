"""The one place that compiles, caches and launches generated CUDA kernels.

* ``compile_kernel(source, name)`` compiles with NVRTC (through ``cuda.core``)
  to a cubin for the current device (or ``arch``), memoised in memory and on
  disk (``$FXOPT_CACHE_DIR/kernels`` or ``user_cache_dir("fxopt")/kernels``).
* ``CompiledKernel.launch`` loads the cubin lazily on first use and launches on
  PyTorch's current stream, so launches order with other torch work and are
  captured by ``torch.cuda.graph``.  Call ``.load()`` before a graph capture.

Kernel argument convention: every kernel carries ``param_types``, the C type of
each parameter, as emitted by the code generator.  ``T*`` parameters take a
torch tensor (its ``data_ptr()``) or an int address; ``long long``/``int64_t``
an int (passed as int64); ``int`` an int (int32); ``float`` a float (float32);
``double`` a float.  Without ``param_types``: tensors -> pointers, ints -> int64,
floats -> float32, numpy/ctypes scalars pass through unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import tempfile
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = [
    "CompileError", "CompiledKernel", "compile_kernel", "compile_ptx", "compile_many", "submit_many", "nvrtc_available",
    "nvrtc_version", "cuda_include_dirs", "cache_dir", "cache_stats", "reset_cache_stats",
    "clear_memory_cache", "default_arch",
]

_CACHE_FORMAT = b"FXOPT-CUBIN-1\n"
_KEY_VERSION = "fxopt-nvrtc-1"
STATS: Counter = Counter()  # nvrtc_compiles, memory_hits, disk_hits, disk_writes, corrupt_cache_files
_MEM: dict[str, "CompiledKernel"] = {}
_LOCK = threading.Lock()


def _core():
    """The cuda.core namespace (1.x: ``cuda.core``; <=0.x: ``cuda.core.experimental``)."""
    try:
        from cuda.core import Program, ProgramOptions  # noqa: F401
        import cuda.core as core
    except ImportError:
        import cuda.core.experimental as core  # type: ignore[no-redef]
    return core


class CompileError(RuntimeError):
    """NVRTC rejected a generated kernel. ``.log``, ``.source`` and ``.name`` are kept."""

    def __init__(self, name: str, source: str, log: str, arch: str = ""):
        self.name, self.source, self.log, self.arch = name, source, log, arch
        super().__init__(self._render())

    def error_lines(self) -> list[int]:
        """1-based source line numbers the log complains about."""
        pat = re.compile(r"\((\d+)\): (?:catastrophic )?error")
        return sorted({int(m.group(1)) for m in pat.finditer(self.log)})

    def _render(self) -> str:
        src = self.source.splitlines()
        out = [f"NVRTC failed to compile kernel {self.name!r} for {self.arch or '?'}:"]
        loc = re.compile(r"^(\S*)\((\d+)\): (.*)$")
        for line in self.log.splitlines():
            out.append("  " + line)
            m = loc.match(line.strip())
            # only quote lines of the generated source, not of an included header
            if m and m.group(1) in (f"{self.name}.cu", "default_program") and "error" in m.group(3):
                n = int(m.group(2))
                for k in range(max(1, n - 1), min(len(src), n + 1) + 1):
                    out.append(f"    {'>' if k == n else ' '}{k:5d} | {src[k - 1]}")
        return "\n".join(out)


@dataclass(eq=False)
class CompiledKernel:
    name: str
    source: str
    arch: str
    cubin: bytes
    param_types: tuple[str, ...] | None = None
    key: str = ""
    cache_source: str | None = None  # None: compiled now; "disk": read from the disk cache
    log: str = ""  # NVRTC warnings of a fresh compile
    _kernels: dict = field(default_factory=dict, repr=False)
    _pdl: dict = field(default_factory=dict, repr=False)  # device -> launch with PDL
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def compiled(self) -> bool:
        return bool(self.cubin)

    # -- loading / launching (needs a GPU) ---------------------------------
    def load(self, device: int | None = None):
        """Load the module on ``device`` (default: torch's current device); returns the Kernel."""
        import torch
        dev = torch.cuda.current_device() if device is None else int(device)
        k = self._kernels.get(dev)
        if k is None:
            with self._lock:
                k = self._kernels.get(dev)
                if k is None:
                    core = _core()
                    torch.cuda.init()
                    core.Device(dev).set_current()  # torch also uses the primary context
                    obj = core.ObjectCode.from_cubin(self.cubin)
                    k = self._kernels[dev] = obj.get_kernel(self.name)
                    self._pdl[dev] = self.pdl_safe and programmatic_launch_supported(dev)
        return k

    @property
    def pdl_safe(self) -> bool:
        """The kernel waits for the previous grid before touching memory (``fx_pdl_begin()`` in
        the prelude), so it may be launched with programmatic dependent launch."""
        return _PDL_FIRST.search(self.source) is not None

    def convert_args(self, args: Sequence[Any]) -> list:
        types = self.param_types
        if types is not None and len(types) != len(args):
            raise TypeError(f"{self.name}: expected {len(types)} kernel args, got {len(args)}")
        return [_convert(a, None if types is None else types[i]) for i, a in enumerate(args)]

    def launch(self, grid, block, args: Sequence[Any], shared_mem: int = 0, stream=None) -> None:
        """Launch on ``stream`` (default ``torch.cuda.current_stream()``). A grid or block
        with a zero extent (empty tensors) is a no-op."""
        grid, block = _dim3(grid), _dim3(block)
        if 0 in grid or 0 in block:
            return
        import torch
        kargs = self.convert_args(args)
        dev = torch.cuda.current_device()
        kernel = self.load(dev)
        ts = torch.cuda.current_stream() if stream is None else stream
        pdl = self._pdl[dev] and not _NO_PDL.active
        if pdl:
            _NO_PDL.launches += 1
        _launch(kernel, grid, block, int(shared_mem), ts, kargs, pdl)


def _dim3(d) -> tuple[int, int, int]:
    t = (int(d),) if isinstance(d, int) else tuple(int(x) for x in d)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"bad launch dimension {d!r}")
    return t + (1,) * (3 - len(t))


def _convert(a, ctype: str | None):
    import numpy as np
    import torch
    if isinstance(a, torch.Tensor):
        if ctype is not None and not ctype.endswith("*"):
            raise TypeError(f"tensor passed for a {ctype} parameter")
        return a.data_ptr()
    if ctype is None:
        if isinstance(a, bool):
            return np.bool_(a)
        if isinstance(a, int):
            return np.int64(a)
        if isinstance(a, float):
            return np.float32(a)
        return a
    c = ctype.replace("const", "").strip()
    if c.endswith("*"):
        return int(a)
    conv = {"long long": np.int64, "int64_t": np.int64, "long": np.int64, "int": np.int32,
            "int32_t": np.int32, "unsigned int": np.uint32, "unsigned long long": np.uint64,
            "float": np.float32, "double": np.float64, "bool": np.bool_}.get(c)
    if conv is None:
        raise TypeError(f"unsupported kernel parameter type {ctype!r}")
    return conv(a)


_STREAMS: dict[int, Any] = {}


# the kernel's first statement waits for the previous grid (prelude.cuh)
_PDL_FIRST = re.compile(r"__global__[^{;]*\{\s*fx_pdl_begin\(\);")


class _NoPdl(threading.local):
    active = False   # launches on this thread leave programmatic dependent launch off
    launches = 0     # launches on this thread that asked for it


_NO_PDL = _NoPdl()


@contextlib.contextmanager
def without_programmatic_launch():
    """Kernels launched on this thread inside the block go without programmatic dependent launch
    (the CUDA-graph runner captures a graph both ways and keeps the faster: the early launch
    holds SM resources with waiting blocks, which some graphs pay for)."""
    old, _NO_PDL.active = _NO_PDL.active, True
    try:
        yield
    finally:
        _NO_PDL.active = old


def programmatic_launches() -> int:
    """Launches on this thread so far that used programmatic dependent launch."""
    return _NO_PDL.launches


def programmatic_launch_enabled() -> bool:
    """``FXOPT_PDL=0`` turns programmatic dependent launch off (read at each kernel load)."""
    return os.environ.get("FXOPT_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _launch_config_has_pdl() -> bool:
    try:
        _core().LaunchConfig(grid=1, block=1, programmatic_stream_serialization=True)
        return True
    except (TypeError, AttributeError):  # a cuda.core before the attribute
        return False


def programmatic_launch_supported(device: int) -> bool:
    """Kernels that wait for their predecessor (``pdl_safe``) are launched with the
    programmatic-stream-serialization attribute on sm_90 and newer, when cuda.core can set it and
    ``FXOPT_PDL`` does not forbid it: the launch of the next kernel then overlaps the end of the
    previous one (in CUDA graphs too: stream capture turns it into a programmatic edge)."""
    import torch
    return (programmatic_launch_enabled() and torch.cuda.get_device_capability(device) >= (9, 0)
            and _launch_config_has_pdl())


def _launch(kernel, grid, block, shmem, torch_stream, kargs, pdl: bool = False) -> None:
    core = _core()
    handle = int(torch_stream.cuda_stream)
    stream = _STREAMS.get(handle)
    if stream is None:
        if hasattr(core.Stream, "from_handle"):        # cuda.core >= 0.3
            stream = core.Stream.from_handle(handle)
        else:                                           # older: __cuda_stream__ protocol
            stream = torch_stream
        if len(_STREAMS) < 256:
            _STREAMS[handle] = stream
    if _new_launch_api(core):
        cfg = (core.LaunchConfig(grid=grid, block=block, shmem_size=shmem, programmatic_stream_serialization=True)
               if pdl else core.LaunchConfig(grid=grid, block=block, shmem_size=shmem))
        core.launch(stream, cfg, kernel, *kargs)
    else:  # cuda.core 0.1/0.2: launch(kernel, config) with the stream in the config
        cfg = core.LaunchConfig(grid=grid, block=block, stream=stream, shmem_size=shmem)
        core.launch(kernel, cfg, *kargs)


@functools.lru_cache(maxsize=None)
def _new_launch_api(core) -> bool:
    import inspect
    try:
        first = next(iter(inspect.signature(core.launch).parameters))
    except (TypeError, ValueError, StopIteration):
        return True  # cython builtin (cuda.core >= 0.3)
    return first != "kernel"


# -- environment ------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def nvrtc_version() -> tuple[int, int]:
    try:
        from cuda.bindings import nvrtc
    except ImportError:  # cuda-python < 12.6
        from cuda import nvrtc  # type: ignore[no-redef]
    err, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


@functools.lru_cache(maxsize=None)
def nvrtc_available() -> bool:
    try:
        core = _core()
        core.Program('extern "C" __global__ void fxopt_probe() {}', "c++",
                     core.ProgramOptions(arch="sm_90")).compile("cubin")
        nvrtc_version()
        return True
    except Exception:
        return False


def _header_major(d: Path) -> int | None:
    try:
        m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", (d / "cuda_runtime_api.h").read_text())
        return int(m.group(1)) // 1000 if m else None
    except OSError:
        return None


@functools.lru_cache(maxsize=None)
def cuda_include_dirs() -> tuple[str, ...]:
    """Directory holding cuda_fp16.h / cuda_bf16.h for NVRTC, or () if none is found.

    Looked for in: $FXOPT_CUDA_INCLUDE, cuda.pathfinder (pip ``nvidia-*`` wheels or
    CUDA_HOME), the ``nvidia`` pip namespace packages, $CUDA_HOME/$CUDA_PATH and
    /usr/local/cuda. A directory whose CUDART_VERSION major matches NVRTC's is preferred.
    """
    cands: list[Path] = []
    for d in os.environ.get("FXOPT_CUDA_INCLUDE", "").split(os.pathsep):
        if d:
            cands.append(Path(d))
    try:
        from cuda import pathfinder
        d = pathfinder.find_nvidia_header_directory("cudart")
        if d:
            cands.append(Path(d))
    except Exception:
        pass
    try:
        import nvidia  # namespace package of the pip CUDA wheels
        for root in getattr(nvidia, "__path__", []):
            for sub in ("cu13/include", "cu12/include", "cuda_runtime/include", "cuda_nvrtc/include"):
                cands.append(Path(root) / sub)
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    found = [d for d in cands if (d / "cuda_fp16.h").is_file() and (d / "cuda_bf16.h").is_file()]
    if not found:
        return ()
    try:
        major = nvrtc_version()[0]
        found.sort(key=lambda d: _header_major(d) != major)  # stable: keeps search order
    except Exception:
        pass
    return (str(found[0]),)


def default_arch(arch: str | None = None) -> str:
    """``arch`` if given, else sm_XY of torch's current CUDA device, else sm_90."""
    if arch:
        return arch
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
    except Exception:
        pass
    return "sm_90"


def cache_dir() -> Path:
    root = os.environ.get("FXOPT_CACHE_DIR")
    if not root:
        try:
            import platformdirs
            root = platformdirs.user_cache_dir("fxopt")
        except ImportError:  # a declared dependency, but keep the compiler usable without it
            root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fxopt")
    return Path(root) / "kernels"


def cache_stats() -> dict[str, int]:
    return dict(STATS)


def reset_cache_stats() -> None:
    STATS.clear()


def clear_memory_cache() -> None:
    with _LOCK:
        _MEM.clear()


# -- compile -------------------------------------------------------------------
def _norm_options(options) -> tuple[tuple[str, Any], ...]:
    """``options``: a mapping or (name, value) pairs of cuda.core ProgramOptions fields."""
    items = options.items() if hasattr(options, "items") else options
    return tuple(sorted((str(k), v) for k, v in items))


def _read_cache(path: Path) -> bytes | None:
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head, _, rest = blob.partition(b"\n")
    digest, _, payload = rest.partition(b"\n")
    if (head + b"\n" != _CACHE_FORMAT or not payload
            or hashlib.sha256(payload).hexdigest().encode() != digest):
        STATS["corrupt_cache_files"] += 1
        return None
    return payload


def _write_cache(path: Path, cubin: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_CACHE_FORMAT + hashlib.sha256(cubin).hexdigest().encode() + b"\n" + cubin)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        STATS["disk_writes"] += 1
    except OSError:
        pass  # a read-only cache directory must not break compilation


def _extract_log(exc: BaseException) -> str:
    msg = str(exc).replace("\x00", "")
    _, sep, log = msg.partition("compilation log:")
    return (log if sep else msg).strip("\n ")


def compile_kernel(source: str, name: str, arch: str | None = None, options=(),
                   param_types: Sequence[str] | None = None, use_cache: bool = True) -> CompiledKernel:
    """Compile ``source`` (which defines ``extern "C" __global__ void name(...)``) to a cubin."""
    arch = default_arch(arch)
    opts = _norm_options(options)
    incs = cuda_include_dirs()
    ver = nvrtc_version()
    key = hashlib.sha256(json.dumps(
        [_KEY_VERSION, source, name, arch, repr(opts), list(ver), list(incs)]).encode()).hexdigest()
    ptypes = None if param_types is None else tuple(param_types)
    if use_cache:
        with _LOCK:
            hit = _MEM.get(key)
        if hit is not None:
            STATS["memory_hits"] += 1
            return hit
        path = cache_dir() / key[:2] / f"{key}.cubin"
        cubin = _read_cache(path)
        if cubin is not None:
            STATS["disk_hits"] += 1
            ck = CompiledKernel(name, source, arch, cubin, ptypes, key, "disk")
            with _LOCK:
                return _MEM.setdefault(key, ck)
    cubin, log = _nvrtc(source, name, arch, opts)
    ck = CompiledKernel(name, source, arch, cubin, ptypes, key, None, log)
    if use_cache:
        _write_cache(cache_dir() / key[:2] / f"{key}.cubin", cubin)
        with _LOCK:
            ck = _MEM.setdefault(key, ck)
    return ck


def _program_options(name: str, arch: str, opts: tuple):
    kw: dict[str, Any] = dict(opts)
    kw.setdefault("name", f"{name}.cu")
    incs = cuda_include_dirs()
    if incs:
        kw["include_path"] = list(incs) + list(kw.get("include_path") or [])
    else:
        kw["define_macro"] = ["FXOPT_NO_CUDA_HEADERS"] + list(kw.get("define_macro") or [])
    return _core().ProgramOptions(arch=arch, **kw)


def _nvrtc(source: str, name: str, arch: str, opts: tuple) -> tuple[bytes, str]:
    """One NVRTC compilation of ``source`` to a cubin: (cubin, log), or ``CompileError`` with
    NVRTC's log and the source."""
    core = _core()
    popts = _program_options(name, arch, opts)
    STATS["nvrtc_compiles"] += 1
    logbuf, prog, err = io.StringIO(), None, None
    try:
        prog = core.Program(source, "c++", popts)
        try:
            code = bytes(prog.compile("cubin", logs=logbuf).code)
        except TypeError:  # a cuda.core without the logs argument
            code = bytes(prog.compile("cubin").code)
    except Exception as e:  # NVRTCError (cuda.core) or older CUDAError/RuntimeError
        err = CompileError(name, source, _extract_log(e), arch)
        err.__cause__ = e.with_traceback(None)  # keep the cause, drop frames holding the Program
    finally:  # free the Program now: left to the cyclic GC (a raising frame is in a cycle),
        if prog is not None and hasattr(prog, "close"):  # cuda.core 1.2's __dealloc__ fails
            prog.close()
        prog = None
    if err is not None:
        raise err
    return code, logbuf.getvalue().replace("\x00", "")


def compile_ptx(source: str, name: str, arch: str | None = None, options=()) -> str:
    """The PTX NVRTC makes of ``source`` with the options ``compile_kernel`` uses (not cached), to
    read what a kernel became. Through cuda-bindings' NVRTC: cuda.core's PTX target asks the
    driver whether it can load the result, and this works without one."""
    from cuda.bindings import nvrtc

    arch = default_arch(arch)
    args = _program_options(name, arch, _norm_options(options)).as_bytes("nvrtc")
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(name, source, f"nvrtcCreateProgram: {err}", arch)
    try:
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(args), args)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CompileError(name, source, log.decode(errors="replace").rstrip("\x00"), arch)
        _, n = nvrtc.nvrtcGetPTXSize(prog)
        ptx = b" " * n
        nvrtc.nvrtcGetPTX(prog, ptx)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode(errors="replace").rstrip("\x00")

def _jobs(items: Iterable) -> list[tuple]:
    jobs = []
    for it in items:
        if isinstance(it, tuple):
            src, nm, *rest = it
            jobs.append((src, nm, rest[0] if rest else None))
        else:
            jobs.append((it.source, it.name, getattr(it, "param_types", None)))
    return jobs


def submit_many(items: Iterable, arch: str | None = None, options=(),
                max_workers: int | None = None) -> list[Future]:
    """Start compiling independent kernels on worker threads and return one future per item, in
    input order (a failure is the future's CompileError). NVRTC releases the GIL, so the caller
    can go on (measuring kernels that are ready) while the rest compile; by default one core is
    left to it. Kernels are submitted in order, so the first items finish first."""
    jobs = _jobs(items)
    if not jobs:
        return []
    arch = default_arch(arch)
    unique = list(dict.fromkeys(jobs))  # the same kernel asked for twice (two nodes alike): once
    workers = max_workers or min(len(unique), max(1, (os.cpu_count() or 2) - 1))
    ex = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fxopt-nvrtc")
    try:
        futs = {job: ex.submit(compile_kernel, job[0], job[1], arch, options, job[2]) for job in unique}
    finally:
        ex.shutdown(wait=False)  # submitted work still runs; the threads end with it
    return [futs[job] for job in jobs]


def compile_many(items: Iterable, arch: str | None = None, options=(),
                 max_workers: int | None = None) -> list[CompiledKernel]:
    """Compile independent kernels in parallel; results in input order.

    ``items``: ``(source, name)`` or ``(source, name, param_types)`` tuples, or objects with
    ``.source``, ``.name`` and ``.param_types`` (codegen's KernelSource). The first failure
    is raised (as CompileError) after all compilations finished.
    """
    jobs = _jobs(items)
    if len(set(jobs)) <= 1 or max_workers == 1:
        done = {job: compile_kernel(job[0], job[1], arch, options, job[2]) for job in dict.fromkeys(jobs)}
        return [done[job] for job in jobs]
    futs = submit_many(jobs, arch, options, max_workers or min(len(set(jobs)), os.cpu_count() or 2))
    wait(futs)
    return [f.result() for f in futs]


# -- cubins carried in a file (fxopt.package): the key compile_kernel would use, and a way in ----
def kernel_key(source: str, name: str, arch: str | None = None, options=()) -> str:
    """The cache key ``compile_kernel(source, name, arch, options)`` uses in this process."""
    return hashlib.sha256(json.dumps(
        [_KEY_VERSION, source, name, default_arch(arch), repr(_norm_options(options)), list(nvrtc_version()),
         list(cuda_include_dirs())]).encode()).hexdigest()


def install_cubin(source: str, name: str, cubin: bytes, arch: str, param_types: Sequence[str] | None = None,
                  options=()) -> CompiledKernel:
    """Put a cubin compiled elsewhere from ``source`` for ``arch`` into the in-memory cache, under
    the key this process computes, so that ``compile_kernel`` returns it without NVRTC. The caller
    checks that it was compiled for this arch by this NVRTC version (the disk cache is left alone)."""
    key = kernel_key(source, name, arch, options)
    ptypes = None if param_types is None else tuple(param_types)
    ck = CompiledKernel(name, source, arch, bytes(cubin), ptypes, key, "package")
    with _LOCK:
        return _MEM.setdefault(key, ck)
