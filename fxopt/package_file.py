"""The ``.fxopt`` file: one manifest (JSON) and one data region (weights, cubins), checksummed.

Layout (little endian)::

    0   8 bytes   magic b"FXOPTPKG"
    8   u32       format version (PACKAGE_FORMAT)
    12  u32       0 (reserved)
    16  u64       manifest length in bytes
    24  u64       data length in bytes
    32  u32       CRC-32 of the manifest
    36  u32       CRC-32 of the data region
    40  manifest  UTF-8 JSON
        padding   zeros up to a multiple of 64
        data      the blobs, each at an offset (from the data start) that is a multiple of 64

The manifest lists every blob (offset, bytes, and for a tensor its dtype, shape and strides), so
tensors are views of one buffer read with a single ``readinto`` (on CUDA moved to the device in
one copy). Reading checks, in this order: the magic (``PackageError``: not a package), the format
version (``PackageVersionError``), the file's length against the header and both checksums
(``PackageCorruptError``: truncated or corrupt), then the fxopt version the manifest names
(``PackageVersionError``). Nothing in the file is executed: no pickle.
"""
from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from typing import Optional

import torch

MAGIC = b"FXOPTPKG"
PACKAGE_FORMAT = 1
_HEADER = struct.Struct("<8sIIQQII")
ALIGN = 64


class PackageError(RuntimeError):
    """A file fxopt cannot run as a package (not a package, another version, corrupt)."""


class PackageVersionError(PackageError):
    """A package written by another fxopt version or in another format version."""


class PackageCorruptError(PackageError):
    """A package whose bytes are not those written (truncated, or changed: a checksum differs)."""


def _pad(n: int) -> int:
    return (-n) % ALIGN


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise PackageCorruptError(f"unknown dtype {name!r} in the manifest")
    return dt


def _dense(t: torch.Tensor) -> bool:
    """The elements fill a block of memory without gaps or overlap (contiguous in some dim order)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def tensor_bytes(t: torch.Tensor) -> tuple[memoryview, list, list]:
    """(raw bytes of `t`'s memory, shape, strides) with its strides kept where it is dense."""
    t = t.detach().cpu()
    if not _dense(t):
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b""), list(t.shape), list(t.stride())
    # dense memory: the elements fill [storage_offset, storage_offset + numel) in some order
    flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
    return memoryview(flat.view(torch.uint8).numpy()).cast("B"), list(t.shape), list(t.stride())


class Writer:
    """Collects blobs, then writes the file atomically (temporary file + rename)."""

    def __init__(self):
        self.blobs: list = []  # (manifest entry, bytes)
        self.size = 0

    def add(self, data, **entry) -> int:
        data = memoryview(data).cast("B")
        entry.update(offset=self.size, nbytes=len(data))
        self.blobs.append((entry, data))
        self.size += len(data) + _pad(len(data))
        return len(self.blobs) - 1

    def add_tensor(self, t: torch.Tensor) -> int:
        raw, shape, stride = tensor_bytes(t)
        return self.add(raw, dtype=str(t.dtype).replace("torch.", ""), shape=shape, stride=stride)

    def write(self, path: str, manifest: dict) -> int:
        manifest = dict(manifest, blobs=[e for e, _ in self.blobs])
        text = json.dumps(manifest, separators=(",", ":")).encode()
        crc = 0
        for _, data in self.blobs:
            crc = zlib.crc32(data, crc)
            crc = zlib.crc32(bytes(_pad(len(data))), crc)
        header = _HEADER.pack(MAGIC, PACKAGE_FORMAT, 0, len(text), self.size, zlib.crc32(text), crc)
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fxopt-package.", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(text)
                f.write(bytes(_pad(len(header) + len(text))))
                for _, data in self.blobs:
                    f.write(data)
                    f.write(bytes(_pad(len(data))))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return os.path.getsize(path)


def read(path: str, expected_version: Optional[str] = None) -> tuple[dict, torch.Tensor]:
    """(manifest, data region as a uint8 CPU tensor), checked as the module doc says."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise PackageError(f"cannot open package {path}: {e}") from e
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_HEADER.size)
        if len(head) < 8 or head[:8] != MAGIC:
            raise PackageError(f"{path} is not an fxopt package (no FXOPTPKG header)")
        if len(head) < _HEADER.size:
            raise PackageCorruptError(f"{path} is truncated (header of {len(head)} bytes)")
        _, fmt, _, mlen, dlen, mcrc, dcrc = _HEADER.unpack(head)
        if fmt != PACKAGE_FORMAT:
            raise PackageVersionError(f"{path} is a package of format {fmt}; this fxopt reads format "
                                      f"{PACKAGE_FORMAT}: package the model again with this version")
        start = _HEADER.size + mlen + _pad(_HEADER.size + mlen)
        if size != start + dlen:
            raise PackageCorruptError(f"{path} is truncated or has trailing bytes: {size} bytes, "
                                      f"the header says {start + dlen}")
        text = f.read(mlen)
        if zlib.crc32(text) != mcrc:
            raise PackageCorruptError(f"{path} is corrupt: the manifest's checksum differs")
        f.seek(start)
        data = torch.empty(dlen, dtype=torch.uint8)
        if dlen and f.readinto(data.numpy()) != dlen:
            raise PackageCorruptError(f"{path} is truncated (data region)")
    if zlib.crc32(data.numpy()) != dcrc:
        raise PackageCorruptError(f"{path} is corrupt: the data's checksum differs")
    try:
        manifest = json.loads(text)
    except ValueError as e:
        raise PackageCorruptError(f"{path} is corrupt: manifest is not JSON ({e})") from e
    version = manifest.get("fxopt_version")
    if expected_version is not None and version != expected_version:
        raise PackageVersionError(f"{path} was written by fxopt {version}; this is fxopt {expected_version}: "
                                  "package the model again with this version")
    return manifest, data


def blob_tensor(data: torch.Tensor, entry: dict) -> torch.Tensor:
    """The tensor a blob holds, as a view of ``data`` (which may be on another device)."""
    dt = _dtype(entry["dtype"])
    raw = data[entry["offset"]:entry["offset"] + entry["nbytes"]]
    if not entry["shape"] or 0 not in entry["shape"]:
        return raw.view(dt).as_strided(entry["shape"], entry["stride"])
    return torch.empty(entry["shape"], dtype=dt, device=data.device)


def blob_bytes(data: torch.Tensor, entry: dict) -> bytes:
    return data[entry["offset"]:entry["offset"] + entry["nbytes"]].numpy().tobytes()
