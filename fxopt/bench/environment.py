"""What machine and software a benchmark ran on (shared by the inference and training harnesses)."""
from __future__ import annotations

import os
import platform
from typing import Any, Dict, Optional


# --------------------------------------------------------------------------
def _versions() -> Dict[str, Optional[str]]:
    import torch
    v: Dict[str, Optional[str]] = {"python": platform.python_version(), "torch": torch.__version__,
                                   "CUDA": torch.version.cuda, "cuDNN": None}
    try:
        v["cuDNN"] = str(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None
    except Exception:
        pass
    for mod in ("torchvision", "triton", "onnx", "onnxruntime", "openvino"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:
            v[mod] = None
    try:
        from importlib.metadata import version
        v["fxopt"] = version("fxopt")
    except Exception:
        try:
            import fxopt
            v["fxopt"] = getattr(fxopt, "__version__", None) or "uninstalled checkout"
        except Exception:
            v["fxopt"] = "not importable"
    v["fxopt_commit"] = _git_commit()
    return v


def _git_commit() -> Optional[str]:
    """The checkout's commit (with "+dirty" for uncommitted changes) when fxopt runs from a git
    checkout (editable install, the GPU machine's copy), else None. ``FXOPT_COMMIT`` in the
    environment overrides it: a copy of the tree whose ``.git`` is not its own says which commit it is."""
    import subprocess

    if os.environ.get("FXOPT_COMMIT"):
        return os.environ["FXOPT_COMMIT"]

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        run = lambda *cmd: subprocess.run(["git", "-C", here, *cmd], capture_output=True, text=True,  # noqa: E731
                                          timeout=10)
        head = run("rev-parse", "--short=12", "HEAD")
        if head.returncode != 0:
            return None
        dirty = run("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _device_info(device: str) -> Dict[str, Any]:
    import torch
    if device == "cuda":
        cap = torch.cuda.get_device_capability()
        return {"device_name": torch.cuda.get_device_name(), "capability": f"{cap[0]}.{cap[1]}",
                "device_count": torch.cuda.device_count()}
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except Exception:
        pass
    bf16 = _cpu_bf16()  # in the name: the report header shows it
    return {"device_name": f"CPU: {name} (bfloat16 units: {bf16}; {torch.get_num_threads()} threads)",
            "capability": None, "cpu_threads": torch.get_num_threads(), "cpu_bf16": bf16}


def _cpu_bf16() -> str:
    """The CPU's bfloat16 units as /proc/cpuinfo names them (AMX tiles, AVX512-BF16), or "none"."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(l.split(":", 1)[1].split() for l in f if l.startswith("flags")))
    except Exception:
        return "unknown"
    found = [name for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"))
             if flag in flags]
    return ", ".join(found) if found else "none"
