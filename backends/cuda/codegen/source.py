"""What a kernel generator returns (``KernelSource``: the CUDA C, its launch parameters, block and
meta data; ``compile()`` hands it to ``compiler.py``) and the helpers every generator shares: the
32-/64-bit index rule, the codegen layout name of a tensor, names made unique by a digest."""
from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass, field

import torch

from fxopt.names import CL, NCHW, format_of


def made_once(generate):
    """``generate`` (a kernel generator whose ``KernelSource`` depends on its parameters alone, no sizes
    among them: sizes are launch arguments) run once per parameters: every size a symbolic graph is
    lowered at, and every convolution alike, asks for the same kernels. Keyed by the parameters'
    ``repr`` (exact: ``-0.0`` is not ``0.0``, ``1`` not ``1.0`` nor ``True``, as equality would have
    them); the source is shared, and nothing writes to one."""
    cache: dict = {}

    @functools.wraps(generate)
    def source(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        made = cache.get(key)
        if made is None:
            if len(cache) >= 1024:
                cache.clear()
            made = cache[key] = generate(*args, **kwargs)
        return made
    source.cache = cache
    return source


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MAX_BLOCKS = 1 << 16
_INDEX32_LIMIT = 2**31 - 1 - 2**27  # leaves room for the grid-stride step (<= 2**24 threads x 8)


def needs_index64(numel: int) -> bool:
    """Whether a kernel touching ``numel`` elements must be generated with ``index64=True``."""
    return int(numel) > _INDEX32_LIMIT


def c_ident(s: str) -> str:
    return re.sub(r"\W", "_", str(s)) or "k"


def c_comment(s) -> str:
    return re.sub(r"[\r\n]", " ", str(s))


def layout_name(v) -> str | None:
    """The codegen layout name ("nchw" / "nhwc") of a value's memory format (the layout pass's
    notion of it), or None (other strides, not a tensor)."""
    return {NCHW: "nchw", CL: "nhwc"}.get(format_of(v)) if isinstance(v, torch.Tensor) else None


def checked_layout(layout: str) -> str:
    lay = str(layout).lower()
    if lay not in ("nchw", "nhwc"):
        raise ValueError(f"layout must be 'nchw' or 'nhwc', not {layout!r}")
    return lay


def unique_name(prefix: str, *config) -> str:
    return f"{prefix}_{hashlib.sha1(repr(config).encode()).hexdigest()[:8]}"


def int_pair(v) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def index_type(index64: bool) -> str:
    return "long long" if index64 else "int"


@dataclass
class KernelSource:
    """Generated kernel: ``params`` are (name, C type) pairs in launch order."""
    name: str
    source: str
    params: tuple[tuple[str, str], ...]
    kind: str
    meta: dict = field(default_factory=dict)
    block: tuple[int, int, int] = (256, 1, 1)
    index64: bool = False

    @property
    def param_types(self) -> tuple[str, ...]:
        return tuple(t for _, t in self.params)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.params)

    def grid_block(self, numel: int = 0, *, N: int | None = None, C: int | None = None,
                   extent: int | None = None):
        """(grid, block) for ``numel`` work items (output elements); for global_avgpool pass N
        and C. ``extent``: the largest number of elements any argument spans (checked against
        32-bit indexing). A zero grid means: nothing to do, do not launch."""
        if not self.index64 and needs_index64(max(int(numel), int(extent or 0))):
            raise ValueError(f"{self.name}: {max(numel, extent or 0)} elements need index64=True")
        if self.kind == "global_avgpool":
            if self.meta["layout"] == "nchw":
                return (min(-(-N * C // 8), MAX_BLOCKS * 16), 1, 1), self.block
            return (-(-C // 32), min(N, 65535), 1), self.block
        units = -(-int(numel) // self.meta.get("vec", 1))
        return (min(-(-units // self.block[0]), MAX_BLOCKS), 1, 1), self.block

    def compile(self, arch: str | None = None, options=()):
        from fxopt.backends.cuda.compiler import compile_kernel
        return compile_kernel(self.source, self.name, arch, options, self.param_types)
