"""Compiles generated C (``backends/c_source.py``) with the system's C compiler into a shared library,
caches it on disk, and loads its entry point with ``ctypes``.

Libraries live in ``$FXOPT_CACHE_DIR/cpu_c`` (else the user cache dir), named by a hash of the
source, the compiler's version and the flags; ``-march=native`` builds for this CPU, so the cache is
this machine's (the CPU's model is in the key too). A compiler error raises :class:`CompileError`
with the compiler's log and the source, as the CUDA side's NVRTC errors do.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

#: -O3 for this CPU, wide vectors where it has them; OpenMP, whose runtime is the one torch loaded
#: (libgomp.so.1 is already in the process: the library binds to it), so its threads are torch's
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fno-math-errno",
         "-std=gnu11", "-fPIC", "-shared")
TIMEOUT_S = 120


class CompileError(RuntimeError):
    """The C compiler rejected a generated source. ``.log`` and ``.source`` are kept."""

    def __init__(self, source: str, log: str, command: list):
        self.source, self.log, self.command = source, log, command
        numbered = "\n".join(f"{k:5d} | {line}" for k, line in enumerate(source.splitlines(), 1))
        super().__init__(f"fxopt: the C compiler failed ({' '.join(command)}):\n{log}\n--- source ---\n{numbered}")


def compiler() -> Optional[str]:
    """The C compiler (``$CC``, else ``cc``, ``gcc`` or ``clang`` on PATH), or None."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.lru_cache(maxsize=None)
def _compiler_id(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return (out.splitlines() or [cc])[0]


@functools.lru_cache(maxsize=None)
def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") or line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16] + platform.machine()
    except OSError:
        pass
    return platform.processor() + platform.machine()


def cache_dir() -> Path:
    root = os.environ.get("FXOPT_CACHE_DIR")
    if not root:
        import platformdirs

        root = platformdirs.user_cache_dir("fxopt")
    return Path(root) / "cpu_c"


#: stats of this process: libraries compiled and found on disk
stats = {"compiled": 0, "cached": 0}
_loaded: dict = {}


def build(source: str, entry: str, extra_ints: int = 0):
    """The ``ctypes`` function ``entry(void**, char*, int, ...)`` of ``source`` compiled (or found in the
    cache), with ``extra_ints`` more int arguments."""
    flags = FLAGS
    cc = compiler()
    if cc is None:
        raise CompileError(source, "no C compiler on PATH (set $CC)", [])
    key = hashlib.sha256("\0".join((source, _compiler_id(cc), " ".join(flags), _cpu_id())).encode()).hexdigest()[:32]
    fn = _loaded.get((key, entry))
    if fn is not None:
        return fn
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    lib = d / f"{key}.so"
    if lib.exists():
        stats["cached"] += 1
    else:
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            src, out = Path(tmp) / "k.c", Path(tmp) / "k.so"
            src.write_text(source)
            cmd = [cc, *flags, "-o", str(out), str(src), "-lm"]
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired as e:
                raise CompileError(source, f"timed out after {TIMEOUT_S} s", cmd) from e
            if r.returncode != 0 or not out.exists():
                raise CompileError(source, r.stderr or r.stdout, cmd)
            os.replace(out, lib)  # atomic: a concurrent process finds a whole library or none
        stats["compiled"] += 1
    fn = getattr(ctypes.CDLL(str(lib)), entry)
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p) + (ctypes.c_int,) * (1 + extra_ints)
    fn.restype = None
    _loaded[(key, entry)] = fn
    return fn
