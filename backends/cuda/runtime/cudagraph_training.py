"""Training: how the CUDA-graph runners of AOTAutograd's forward and backward graphs are linked
(``cudagraphs.py``'s contract, "Training"). The backend entry makes one ``TrainingLink`` per graph
(``fxopt.backend``: the forward's with its number of outputs the caller sees, the backward's with its
forward's runner) and the cuda executor hands it to that graph's runner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from fxopt.backends.cuda.runtime.cudagraphs import _flat, _storage

if TYPE_CHECKING:
    from fxopt.backends.cuda.runtime.cudagraphs import CudaGraphRunner, _Instance


class TrainingLink:
    """How a training graph's runner treats outputs and inputs (module docstring, "Training").

    forward: ``num_fwd_outputs``, the outputs the caller sees (copied out); the rest are saved
    for backward (lent). backward: ``forward``, the forward graph's runner, whose lent memory the
    backward reads in place."""

    def __init__(self, num_fwd_outputs: Optional[int] = None, forward: Optional["CudaGraphRunner"] = None):
        self.num_fwd_outputs, self.forward = num_fwd_outputs, forward

    def copied(self, outputs) -> frozenset:
        """Positions (among the flat tensor outputs) of the forward's outputs the caller sees."""
        if not self.num_fwd_outputs or not isinstance(outputs, (list, tuple)):
            return frozenset()
        return frozenset(range(len(_flat(list(outputs[:self.num_fwd_outputs])))))

    def read_in_place(self, args, dynamic: Sequence[int]) -> frozenset:
        """The backward's inputs that are memory the forward's captures handed out."""
        if self.forward is None:
            return frozenset()
        handed = self.forward.handed_storages()
        return frozenset(i for i in dynamic if isinstance(args[i], torch.Tensor) and _storage(args[i]) in handed)

    def lender(self, args, reads) -> Optional["_Instance"]:
        """The forward capture whose lent memory all the backward's inputs at ``reads`` are, if it
        shares its pool with no backward capture yet (else None: the backward gets a pool of its own)."""
        if self.forward is None or not reads:
            return None
        storages = {_storage(args[i]) for i in reads}
        for entry in self.forward.graphs.values():
            for inst in entry.instances:
                if storages <= inst.handed and inst.pool is not None and not inst.live_sharers():
                    return inst
        return None
