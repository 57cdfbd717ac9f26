"""Measured choices carried from one process to another: recorded while compiling, replayed later.

Everything fxopt measures (a convolution's algorithm, a node's implementation in the cuda
executor, a CUDA-graph runner's replay decision) goes through the autotuning cache
(``fxopt.autotune.AutotuneCache``: ``get(device, key)`` / ``put(device, key, entry)``). So a
compiled artefact can carry its choices without knowing how the executor makes them:

- ``RecordingCache`` wraps the user's cache while a graph is compiled (and first run) and keeps
  every entry that was read or written: the choices that compile used.
- ``FixedChoices`` hands those entries back to a later lowering (option ``autotune_cache`` set to
  it). Nothing is measured through it: a key it does not hold is answered with the choice that
  needs no measurement (the reference implementation of a node; a CUDA graph replayed without
  comparing against the unoptimized graph), and recorded in ``misses``. Entries are kept per
  device fingerprint: on another GPU (or another torch / cuDNN), none of them applies and every
  lookup is such a miss.
"""
from __future__ import annotations

import copy
from typing import Optional

from fxopt.autotune import AutotuneCache

#: the answer to a lookup FixedChoices does not hold, by key prefix: the choice that needs no
#: measuring (for the cuda executor's nodes "reference", the implementation the graph names)
RUNNER_PREFIX = "cudagraph_runner|"
#: the cpu executor's runner (``backends/cpu.py``, keys ``cpu_runner|<how>|<graphs>|<ways>|<signature>``):
#: a signature not held runs the way the held signatures with the same ways chose most often (a
#: package's other batch sizes), else the optimized graph
CPU_RUNNER_PREFIX = "cpu_runner|"


def cpu_runner_key(how: str, graphs: str, ways, signature) -> str:
    """The autotuning key of a CPU runner's decision (the one place its layout is written)."""
    return f"{CPU_RUNNER_PREFIX}{how}|{graphs}|{sorted(ways)}|{signature}"


def _cpu_runner_ways(key: str) -> str:
    return key.split("|")[3]


def default_entry(key: str, held: Optional[dict] = None) -> dict:
    """The choice that needs no measuring for ``key``; ``held``: the entries held (key -> entry)."""
    if key.startswith(RUNNER_PREFIX):
        return {"runs": "optimized graph", "timings": {"not_measured": True}}
    if key.startswith(CPU_RUNNER_PREFIX):
        ways = _cpu_runner_ways(key)
        runs = sorted(e["runs"] for k, e in (held or {}).items() if k.startswith(CPU_RUNNER_PREFIX)
                      and _cpu_runner_ways(k) == ways and isinstance(e, dict) and e.get("runs"))
        if runs:
            best = max(runs, key=runs.count)  # a tie: the first by name
            return {"runs": best, "not_measured": True, "why": "the way the measured signatures chose"}
        return {"runs": "optimized graph", "not_measured": True, "why": "nothing measured"}
    return {"choice": "reference", "ms": {}, "errors": {}, "not_measured": True}


class RecordingCache(AutotuneCache):
    """The user's cache (``inner``: None = in memory only), keeping a copy of every entry used."""

    def __init__(self, inner: Optional[AutotuneCache] = None):
        super().__init__(None)
        self.inner = inner
        self.used: dict = {}  # device -> key -> entry

    def __deepcopy__(self, memo):  # options are copied by dataclasses.asdict: keep one recording
        return self

    def get(self, device: str, key: str) -> Optional[dict]:
        entry = self.inner.get(device, key) if self.inner is not None else super().get(device, key)
        if entry is not None:
            self.used.setdefault(device, {})[key] = copy.deepcopy(entry)
        return entry

    def put(self, device: str, key: str, entry: dict) -> None:
        self.used.setdefault(device, {})[key] = copy.deepcopy(entry)
        if self.inner is not None:
            self.inner.put(device, key, entry)
        else:
            super().put(device, key, entry)


class FixedChoices(AutotuneCache):
    """Choices read from a package or a compile-cache entry; measures nothing (see module doc).
    ``fallback``: a cache asked for keys not held (the whole-compile cache passes the user's
    autotuning cache, so the CUDA-graph runner's decisions kept there are found); None = answer
    misses with ``default_entry``."""

    def __init__(self, entries: dict, fallback: Optional[AutotuneCache] = None):
        super().__init__(None)
        self._data = {"version": 1, "entries": {d: dict(e) for d, e in entries.items()}}
        self.fallback = fallback
        self.hits: list = []
        self.misses: list = []

    def __deepcopy__(self, memo):
        return self

    def get(self, device: str, key: str) -> Optional[dict]:
        entry = self._data["entries"].get(device, {}).get(key)
        if entry is not None:
            self.hits.append(key)
            return copy.deepcopy(entry)
        if self.fallback is not None:
            return self.fallback.get(device, key)
        self.misses.append(key)
        return default_entry(key, self._data["entries"].get(device))

    def put(self, device: str, key: str, entry: dict) -> None:
        if self.fallback is not None:
            self.fallback.put(device, key, entry)
