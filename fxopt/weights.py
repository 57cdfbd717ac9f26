"""Noticing that parameters changed: the one per-call check shared by the CUDA-graph runner
(``backends/cuda/runtime/cudagraphs.py``) and folded constants (``passes/fold_constants.py``)."""
from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch

_VERSION = operator.attrgetter("_version")
_DATA_PTR = torch.Tensor.data_ptr
# One C++ call that compares many tensors' data pointers (what Inductor's CUDA graphs use); a
# Python fallback keeps older/newer torch builds without it working.
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class WeightWatch:
    """Notices, per call, when parameter/buffer inputs were replaced (new storage) or changed in
    place (version counter moved). Runs on every replay, so it does a handful of C-level calls
    over the whole list rather than Python work per parameter.

    ``version_indices`` (default: all of ``indices``): the inputs whose in-place changes matter
    (those feeding folded constants); the others are only checked for replacement."""

    def __init__(self, indices: Sequence[int], version_indices: Optional[Sequence[int]] = None):
        self.indices = list(indices)
        n = len(self.indices)
        self.version_indices = self.indices if version_indices is None else sorted(set(version_indices))
        self._getter = operator.itemgetter(*self.indices) if n > 1 else None
        nv = len(self.version_indices)
        self._version_getter = operator.itemgetter(*self.version_indices) if nv > 1 else None
        self.ptrs: Optional[tuple] = None
        self.versions: Optional[tuple] = None
        self._cpp = _PTRS_EQUAL is not None and n > 0

    def _same_ptrs(self, args, params) -> bool:
        if self.ptrs is None:
            return False
        if self._cpp:
            try:  # data_ptrs is indexed like args (None where not checked)
                return _PTRS_EQUAL(list(args), self._ptr_list, self.indices)
            except (TypeError, RuntimeError):  # e.g. a non-tensor argument: the Python way from now on
                self._cpp = False
        return tuple(map(_DATA_PTR, params)) == self.ptrs

    def _gather(self, args) -> tuple:
        if self._getter is not None:
            return self._getter(args)
        return tuple(args[i] for i in self.indices)

    def current_versions(self, args) -> tuple:
        """The version counters of the watched-for-versions inputs in ``args``."""
        if self._version_getter is not None:
            return tuple(map(_VERSION, self._version_getter(args)))
        return tuple(args[i]._version for i in self.version_indices)

    def check(self, args) -> tuple[bool, bool]:
        """(pointers changed, anything changed) since the previous call."""
        params = self._gather(args)
        versions = self.current_versions(args)
        ptrs_changed = not self._same_ptrs(args, params)
        if ptrs_changed:
            self.ptrs = tuple(map(_DATA_PTR, params))
            self._ptr_list = [None] * len(args)
            for i, p in zip(self.indices, self.ptrs):
                self._ptr_list[i] = p
        changed = ptrs_changed or versions != self.versions
        self.versions = versions
        return ptrs_changed, changed


def weights_key(args, indices) -> tuple:
    """The identity, version and address of each parameter input at ``indices`` (a non-tensor as it
    is): equal keys, the same weights unchanged."""
    return tuple((id(args[i]), args[i]._version, args[i].data_ptr()) if isinstance(args[i], torch.Tensor)
                 else args[i] for i in indices)


class ParamChanges:
    """Whether the parameter inputs at ``indices`` were replaced or changed in place since the previous
    call: one ``WeightWatch`` check where they are all tensors (a few C-level calls, not Python work
    per parameter), else their identities, versions and addresses (and non-tensor values) compared."""

    def __init__(self, indices: Sequence[int]):
        self.indices = sorted(indices)
        self._watch: object = None
        self._key: Optional[tuple] = None

    def __call__(self, args) -> bool:
        if self._watch is None:
            tensors = all(isinstance(args[i], torch.Tensor) for i in self.indices)
            self._watch = WeightWatch(self.indices) if tensors else False
        if self._watch is False:  # a non-tensor parameter input: compare everything
            key = weights_key(args, self.indices)
            changed, self._key = key != self._key, key
            return changed
        return self._watch.check(args)[1]
