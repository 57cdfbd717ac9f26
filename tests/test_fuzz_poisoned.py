"""The fuzzer after a failure that leaves its process unable to run CUDA work (an illegal address,
a capture that never ended, a generator left in capture mode): the program that did it is written
as drawn (not shrunk to whatever the broken process fails next), the shard ends, and ``--jobs``
starts it again in a new process with other seeds while the budget lasts. On the CPU: the health
check stubbed, the restart loop with stand-in shard processes."""
import json
import sys

from fxopt.fuzz import parallel, runner


def test_a_poisoning_failure_is_written_unshrunk_and_ends_the_shard(tmp_path, monkeypatch):
    from fxopt.fuzz import check

    ran = []

    def run_program(program, device, graphs, outcome=None):
        ran.append(program)
        if len(ran) >= 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return []
    monkeypatch.setattr(check, "run_program", run_program)
    monkeypatch.setattr(runner, "process_ok", lambda device: len(ran) < 3)
    s = runner.run_fuzz("cpu", examples=50, seed=5, out=tmp_path, executors=("torch",), log=lambda *a: None)
    assert s["poisoned"] and s["failing_programs"] == 1 and s["ran"] == 3  # no shrinking, no more examples
    (f,) = s["failures"]
    assert f["poisoned"] and "not shrunk" in f["error"] and f["program"] == ran[-1].to_json()
    assert (tmp_path / "shard-0-of-1" / "summary.json").exists()


def test_an_ordinary_failure_is_still_shrunk(tmp_path, monkeypatch):
    from fxopt.fuzz import check

    def run_program(program, device, graphs, outcome=None):
        if len(program.layers) >= 2:
            raise AssertionError("mismatch")
        return []
    monkeypatch.setattr(check, "run_program", run_program)
    s = runner.run_fuzz("cpu", examples=40, seed=1, out=tmp_path, executors=("torch",), log=lambda *a: None)
    assert not s["poisoned"] and s["failures"] and not s["failures"][0]["poisoned"]
    assert len(s["failures"][0]["program"]["layers"]) == 2  # shrunk to the smallest failing program


def test_process_ok_without_cuda_work():
    assert runner.process_ok("cpu")


def test_restart_output_and_seeds_differ(tmp_path, monkeypatch):
    from fxopt.fuzz import check

    drawn = {0: [], 1: []}

    def run_program(program, device, graphs, outcome=None):
        drawn[current].append(program.to_json())
        return []
    monkeypatch.setattr(check, "run_program", run_program)
    for current in (0, 1):
        s = runner.run_fuzz("cpu", examples=3, seed=2, out=tmp_path, executors=("torch",), log=lambda *a: None,
                            restart=current)
        assert s["restart"] == current
    assert (tmp_path / "shard-0-of-1" / "restart-1" / "summary.json").exists()
    assert drawn[0] != drawn[1]


STAND_IN = """
import json, pathlib, sys
args = sys.argv[1:]
out = pathlib.Path(args[args.index("--out") + 1]) / "shard-{i}-of-{n}".format(**dict(zip("in", args[args.index("--shard") + 1].split("/"))))
k = int(args[args.index("--restart") + 1]) if "--restart" in args else 0
d = out / f"restart-{k}" if k else out
d.mkdir(parents=True, exist_ok=True)
budget = args[args.index("--time-budget") + 1]
poisoned = k < 2 and out.name.startswith("shard-0")
print(f"progress stand-in k={k} budget={budget}", flush=True)
(d / "summary.json").write_text(json.dumps({"poisoned": poisoned, "ran": 1, "coverage": {}, "failures": []}))
"""


def test_jobs_restart_a_poisoned_shard_with_the_time_left(tmp_path, monkeypatch):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(parallel, "shard_command",
                        lambda i, jobs, args, threads, progress: [sys.executable, str(script), *args,
                                                                  "--shard", f"{i}/{jobs}"])
    monkeypatch.setattr(parallel, "merge", lambda dirs, out=None, log=None: {"failures": [], "dirs": dirs})
    lines = []
    rc = parallel.run_jobs(2, tmp_path / "fz", ["--out", str(tmp_path / "fz"), "--time-budget", "300"], threads=1,
                           log=lines.append)
    assert rc == 0
    restarts = [ln for ln in lines if "] restart " in ln]
    assert len(restarts) == 2 and all("[shard 0/2]" in ln for ln in restarts), lines
    shard0 = tmp_path / "fz" / "shard-0-of-2"
    assert (shard0 / "restart-2" / "summary.json").exists() and not (shard0 / "restart-3").exists()
    assert not (tmp_path / "fz" / "shard-1-of-2" / "restart-1").exists()
    log = (shard0 / "log.txt").read_text()
    assert "k=0 budget=300" in log and "k=2 budget=" in log  # one log, the restarts with the budget left
    assert json.loads((shard0 / "restart-2" / "summary.json").read_text())["poisoned"] is False
