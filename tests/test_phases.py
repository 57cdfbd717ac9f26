"""The training step's phase timer (fxopt.bench.phases) on the CPU: the loop's marks, the summary's
phases, and the DDP benchmark's phase table."""
import torch

from fxopt.bench.phases import MARKS, PHASES, PhaseTimer, time_phases
from fxopt.testing.training import TrainLoop, make_batches, run_steps


def _loop():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 5))
    return TrainLoop(model, model.parameters(), "cpu", amp=None), make_batches(2, 3, (3, 8, 8), 5)


def test_the_loop_marks_every_phase_in_order():
    loop, batches = _loop()
    seen = []
    loop.mark = seen.append
    run_steps(loop, batches, 2)
    assert seen == list(MARKS) * 2
    loop.mark = None
    run_steps(loop, batches, 1)  # no timer: no marks
    assert len(seen) == 2 * len(MARKS)


def test_phase_summary_on_the_cpu_has_host_times_only():
    loop, batches = _loop()
    got = time_phases(loop, lambda n: run_steps(loop, batches, n), 4, cuda=False)
    assert got["steps"] == 4 and loop.mark is None
    for p in PHASES:
        assert got[p]["host_ms"] >= 0 and "gpu_ms" not in got[p]
    assert got["forward"]["host_ms"] > 0 and got["backward"]["host_ms"] > 0
    # a step's host time is the sum of its three phases (between is outside the step)
    total = got["step_host_ms"]
    assert total >= max(got[p]["host_ms"] for p in ("forward", "backward", "optimizer"))
    assert "step_gpu_ms" not in got


def test_incomplete_steps_are_left_out():
    timer = PhaseTimer(cuda=False)
    for name in ("start", "forward", "start", "forward", "backward", "optimizer"):
        timer(name)
    got = timer.summary()
    assert got["steps"] == 1 and "between" not in got  # no step after the complete one


def test_ddp_phase_table_renders_rows_for_both_models():
    from fxopt.bench.ddp import _phase_lines

    ph = {"steps": 3, "forward": {"host_ms": 1.0, "gpu_ms": 2.0, "lag_ms": 0.5},
          "backward": {"host_ms": 1.5, "gpu_ms": 3.0, "lag_ms": 1.0}, "optimizer": {"host_ms": 2.0, "gpu_ms": 2.5,
                                                                                     "lag_ms": 0.01},
          "step_gpu_ms": 7.5}
    lines = _phase_lines({"backends": {"fxopt": {"phases_single": ph, "phases_ddp": ph,
                                                 "ddp_stats": {"backward_comm_time_ms": 0.7}}}})
    rows = [line for line in lines if line.startswith("| fxopt")]
    assert len(rows) == 2 and "1 device" in rows[0] and "DDP" in rows[1]
    assert "1.00 / 2.00 / 0.50" in rows[0] and "backward comm time 0.70" in rows[1] and rows[0].endswith("| – |")
    assert _phase_lines({"backends": {"eager": {}}}) == []
