"""``fxopt diagnose``: the CLI's argument handling, and each diagnostic's output on the CPU
(the CUDA-graph split once more on a GPU)."""
from __future__ import annotations

import json

import pytest
import torch

import fxopt
import fxopt.bench
from fxopt.cli import build_parser, main
from fxopt.diagnose import DIAGNOSTICS, autotune, compile_time, host, timeline


def _exit_code(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_help_lists_every_diagnostic(capsys):
    code, text = _exit_code(["diagnose", "--help"], capsys)
    assert code == 0
    for name in ("host", "compile", "autotune", "timeline"):
        assert f"    {name}  " in text
    assert set(DIAGNOSTICS) == {"host", "compile", "autotune", "timeline"}
    code, text = _exit_code(["--help"], capsys)
    assert code == 0 and "diagnose" in text and "bench" in text


@pytest.mark.parametrize("name,module", [("host", host), ("compile", compile_time), ("autotune", autotune),
                                         ("timeline", timeline)])
def test_arguments_parsed(name, module):
    args = build_parser().parse_args(["diagnose", name, "resnet50", "--batch", "4", "--dtype", "float16",
                                      "--device", "cpu", "--options", '{"layout": "contiguous"}'])
    assert args.diagnostic is module.run and args.run.__name__ == "cmd_diagnose"
    assert (args.model, args.batch, args.dtype, args.device) == ("resnet50", 4, "float16", "cpu")
    assert args.options == {"layout": "contiguous"} and args.shape is None
    args = build_parser().parse_args(["diagnose", name, "pkg.mod:Net", "--shape", "2,3,8,8"])
    assert args.shape == (2, 3, 8, 8) and args.options == {}


@pytest.mark.parametrize("argv,message", [
    (["diagnose"], "DIAGNOSTIC"),
    (["diagnose", "profile", "seedcnn"], "invalid choice"),
    (["diagnose", "host"], "the following arguments are required: model"),
    (["diagnose", "host", "seedcnn", "--options", "{layout"], "options must be JSON"),
    (["diagnose", "host", "seedcnn", "--options", "[1]"], "must be a JSON object"),
    (["diagnose", "compile", "seedcnn", "--dtype", "float8"], "invalid choice"),
    (["diagnose", "compile", "seedcnn", "--backend", "tvm"], "invalid choice"),
    (["diagnose", "compile", "seedcnn", "--shape", "1,x"], "comma-separated integers"),
    (["diagnose", "autotune", "seedcnn", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["explain", "m:M", "--shape", "1", "--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_arguments_exit_2_naming_the_problem(argv, message, capsys):
    code, text = _exit_code(argv, capsys)
    assert code == 2 and message in text, text


@pytest.mark.parametrize("argv,message", [
    (["diagnose", "host", "no_such_model", "--device", "cpu"], "unknown model 'no_such_model'"),
    (["diagnose", "compile", "fxopt.testing.models:SeedCNN", "--device", "cpu"], "needs --shape"),
    (["diagnose", "compile", "seedcnn", "--device", "cpu", "--backend", "eager", "--options", '{"verify": true}'],
     "need --backend fxopt"),
    (["diagnose", "autotune", "seedcnn", "--device", "cpu", "--batch", "0"], "--batch must be >= 1"),
])
def test_bad_model_or_combination_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_bench_takes_the_rest_of_the_line(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(fxopt.bench, "main", lambda argv: seen.append(list(argv)) or 0)
    assert main(["bench", "--models", "seedcnn", "--quick", "--out", "x"]) == 0
    assert seen == [["--models", "seedcnn", "--quick", "--out", "x"]]
    monkeypatch.undo()
    code, text = _exit_code(["bench", "--help"], capsys)
    assert code == 0 and "--time-budget" in text


def test_compile_profile_on_cpu(capsys):
    assert main(["diagnose", "compile", "seedcnn", "--device", "cpu", "--cprofile", "5"]) == 0
    out = capsys.readouterr().out
    assert "seedcnn float32 (1, 3, 32, 32) cpu fxopt: first call" in out
    assert "executor cpu" in out
    for name in fxopt.PASS_NAMES:  # one line per pass, with its time and status
        assert any(line.split()[:1] == [name] and line.rstrip().endswith("ran") for line in out.splitlines()), name
    assert "Ordered by: cumulative time" in out


def test_compile_floor_backend_and_a_module_model(capsys):
    assert main(["diagnose", "compile", "fxopt.testing.models:SeedCNN2", "--shape", "2,3,32,32",
                 "--device", "cpu", "--backend", "eager"]) == 0
    out = capsys.readouterr().out
    assert "fxopt.testing.models:SeedCNN2 float32 (2, 3, 32, 32) cpu eager: first call" in out
    assert "graph inference" not in out  # Dynamo alone: no fxopt graph


def test_host_split_on_cpu(capsys):
    assert main(["diagnose", "host", "seedcnn", "--device", "cpu", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("seedcnn float32 (2, 3, 32, 32) cpu, µs per call:")
    values = dict(kv.split("=") for kv in first.split(":", 1)[1].split())
    assert set(values) == {"call", "host", "entry_host"}, values  # no CUDA-graph runner on the CPU
    assert all(float(v) > 0 for v in values.values())
    assert "executor=cpu" in out


def test_host_inductor_beside_runs_on_a_thread_of_its_own(monkeypatch, capsys):
    import threading

    called_on = []
    real = host.call_us

    def spy(fn, x, device):
        called_on.append(threading.current_thread().name)
        return real(fn, x, device)

    monkeypatch.setattr(host, "call_us", spy)
    assert main(["diagnose", "host", "seedcnn", "--device", "cpu", "--batch", "2", "--inductor"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    values = dict(kv.split("=") for kv in first.split(":", 1)[1].split())
    assert float(values["inductor_freezing_ro"]) > 0 and float(values["inductor_host"]) > 0
    # fxopt timed on the calling thread, Inductor on its own (torch caches cuDNN plans per thread)
    assert called_on == [threading.current_thread().name, "bench-inductor"], called_on
    assert not [t for t in threading.enumerate() if t.name == "bench-inductor"]


def test_autotune_profile_on_cpu(tmp_path, capsys):
    import fxopt.autotune
    import fxopt.passes.select_conv_algorithm as sca

    before = (sca.measure, fxopt.autotune.time_ms)
    path = tmp_path / "autotune.json"
    assert main(["diagnose", "autotune", "seedcnn", "--device", "cpu", "--json", str(path)]) == 0
    assert (sca.measure, fxopt.autotune.time_ms) == before  # the wrappers are gone again
    out = capsys.readouterr().out
    assert "convolutions measured" in out and "F=4: skips" in out
    record = json.loads(path.read_text())
    assert record["convs"], "conv_algorithm auto measures on the CPU too"
    for conv in record["convs"]:
        assert conv["chosen"] in conv["measured"] and set(conv["measured"]) <= set(conv["estimate"])
        assert f"-> {conv['chosen']}" in out
    assert any(label.startswith("timing loops") for label in record["steps"])


def test_pruning_lines_name_a_lost_winner():
    convs = [{"sig": "c1", "estimate": {"direct": 1.0, "fft": 0.1}, "measured": {"direct": 2.0, "fft": 0.5},
              "chosen": "fft"},
             {"sig": "c2", "estimate": {"direct": 0.1, "gemm": 0.3}, "measured": {"direct": 1.0, "gemm": 0.4},
              "chosen": "gemm"}]
    lines = autotune.pruning_lines(convs)
    assert lines[0] == "  F=2: skips 1 of 4 candidates; winners lost: 1"
    assert lines[1].strip() == "c2: gemm 0.400 -> 1.000 ms"
    assert "  F=4: skips 0 of 4 candidates; winners lost: 0" in lines


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_split_on_cuda(monkeypatch, capsys):
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    assert main(["diagnose", "host", "seedcnn", "--device", "cuda", "--kernels", "--choices"]) == 0
    out = capsys.readouterr().out
    values = dict(kv.split("=") for kv in out.splitlines()[0].split(":", 1)[1].split())
    assert {"call", "host", "runner", "replay", "runner_host", "replay_host", "check_host", "wrappers_host",
            "entry_host"} <= set(values), values
    assert "decisions=" in out and "kernels per replay" in out
