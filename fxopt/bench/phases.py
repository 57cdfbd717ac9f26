"""Where a training step's time goes, phase by phase: a timer for the reference loop's marks.

``TrainLoop.step`` calls its ``mark`` with ``"start"``, ``"forward"`` (the loss is computed: for
DDP this includes its forward wrapper and the buffer broadcast), ``"backward"`` (``backward()``
returned: the gradients' hooks, DDP's copies into its buckets and the all-reduce launches ran) and
``"optimizer"`` (GradScaler's check and the optimizer step returned). At each mark
:class:`PhaseTimer` takes the host's clock (``time.perf_counter``) and records a CUDA event on the
current stream (the GPU's clock: when the GPU gets to that point of the step's work).

Both clocks are put on one axis by an anchor: an event recorded on an idle GPU right after a
synchronize, the host's time taken just after it completes. Per phase the summary gives the host's
time in it, the GPU's time in it, and the GPU's **lag** at the phase's end (GPU time of the mark
minus host time of the mark): a lag near zero means the GPU had caught up with the host there —
it waited for the host's launches (host-bound); a large lag means the host ran ahead and the GPU's
work was the critical path. ``between`` is the span from one step's ``optimizer`` mark to the next
step's ``start`` (the loop's own bookkeeping). On the CPU only the host's times are kept.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Dict, List, Optional

__all__ = ["PhaseTimer", "PHASES", "time_phases"]

#: the loop's marks, in order; a phase is named after the mark that ends it
MARKS = ("start", "forward", "backward", "optimizer")
PHASES = ("forward", "backward", "optimizer", "between")


class PhaseTimer:
    """Collects the marks of whole steps (a step begins at ``"start"``)."""

    def __init__(self, cuda: bool):
        import torch

        self.cuda = cuda
        self.steps: List[List[tuple]] = []
        self.anchor_host: Optional[float] = None
        self.anchor = None
        if cuda:
            torch.cuda.synchronize()
            self.anchor = torch.cuda.Event(enable_timing=True)
            self.anchor.record()
            self.anchor.synchronize()
        self.anchor_host = time.perf_counter()

    def __call__(self, name: str) -> None:
        import torch

        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        now = time.perf_counter()
        if name == "start":
            self.steps.append([])
        if self.steps:
            self.steps[-1].append((name, now, ev))

    def summary(self) -> Dict[str, Any]:
        """Per phase, medians over the complete steps: ``host_ms``, and on CUDA ``gpu_ms`` and
        ``lag_ms`` (the GPU's lag behind the host at the phase's end); ``step_host_ms`` and
        ``step_gpu_ms``; ``steps``."""
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        rows: Dict[str, Dict[str, List[float]]] = {p: {"host_ms": [], "gpu_ms": [], "lag_ms": []} for p in PHASES}
        totals: Dict[str, List[float]] = {"step_host_ms": [], "step_gpu_ms": []}
        complete = 0

        def gpu(ev) -> float:  # the GPU's time of an event on the host's axis (ms)
            return self.anchor_host * 1e3 + self.anchor.elapsed_time(ev)

        for i, marks in enumerate(self.steps):
            if [m[0] for m in marks] != list(MARKS):
                continue
            complete += 1
            spans = list(zip(marks, marks[1:]))
            if i + 1 < len(self.steps):
                spans.append((marks[-1], self.steps[i + 1][0]))
            for (a, b), phase in zip(spans, PHASES):
                rows[phase]["host_ms"].append((b[1] - a[1]) * 1e3)
                if self.cuda:
                    rows[phase]["gpu_ms"].append(a[2].elapsed_time(b[2]))
                    rows[phase]["lag_ms"].append(gpu(b[2]) - b[1] * 1e3)
            totals["step_host_ms"].append((marks[-1][1] - marks[0][1]) * 1e3)
            if self.cuda:
                totals["step_gpu_ms"].append(marks[0][2].elapsed_time(marks[-1][2]))
        out: Dict[str, Any] = {"steps": complete}
        for phase, got in rows.items():
            cell = {k: statistics.median(v) for k, v in got.items() if v}
            if cell:
                out[phase] = cell
        out.update({k: statistics.median(v) for k, v in totals.items() if v})
        return out


def time_phases(loop, run_steps, steps: int, cuda: bool) -> Dict[str, Any]:
    """Run ``steps`` steps (``run_steps(n)``) with a :class:`PhaseTimer` on ``loop``; its summary."""
    timer = PhaseTimer(cuda)
    loop.mark = timer
    try:
        run_steps(steps)
    finally:
        loop.mark = None
    return timer.summary()
