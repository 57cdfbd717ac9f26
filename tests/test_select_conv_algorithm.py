"""select_conv_algorithm: modes, per-layer overrides, the autotuning cache, forced algorithms on models."""
import json

import pytest
import torch
import torch.nn as nn
import torchvision

import fxopt
from fxopt.ops import FUSED_CONV, PREPACK
from fxopt.testing import SeedCNN, SeedCNN2, SmallResNet
from fxopt.tolerances import relative_error

ALGOS = ["direct", "winograd_2x2_3x3", "winograd_4x4_3x3", "fft", "gemm"]


def conv_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is FUSED_CONV]


def test_auto_measures_once_then_hits_the_cache(tmp_path):
    cache = tmp_path / "tune.json"
    m, x = SmallResNet().eval(), torch.randn(2, 3, 32, 32)
    opts = {"conv_algorithm": "auto", "autotune_cache": str(cache)}
    r1 = fxopt.explain(m, x, options=opts)
    assert r1.measurements > 0
    hows = [c.how for c in r1.conv_algorithms.values()]
    assert "measured" in hows and set(hows) <= {"measured", "cached", "only-direct"}  # same-shape convs share
    r2 = fxopt.explain(m, x, options=opts)
    assert r2.measurements == 0
    assert {k: c.algorithm for k, c in r1.conv_algorithms.items()} == {k: c.algorithm for k, c in r2.conv_algorithms.items()}
    data = json.loads(cache.read_text())
    (device,) = data["entries"]
    entry = next(iter(data["entries"][device].values()))
    assert set(entry) >= {"algorithm", "candidates", "errors", "max_rel_error"}
    rec = next(c for c in r2.conv_algorithms.values() if c.how == "cached")
    assert rec.algorithm in ALGOS and isinstance(rec.candidates, dict) and rec.max_rel_error is not None


def test_corrupt_cache_is_ignored_with_a_warning_and_rewritten(tmp_path):
    cache = tmp_path / "tune.json"
    cache.write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring unreadable autotune cache"):
        fxopt.explain(SeedCNN2().eval(), torch.randn(1, 3, 32, 32),
                      options={"conv_algorithm": "auto", "autotune_cache": str(cache)})
    assert json.loads(cache.read_text())["entries"]


def test_cache_off_always_measures(tmp_path):
    opts = {"conv_algorithm": "auto", "autotune_cache": False}
    m, x = SeedCNN2().eval(), torch.randn(1, 3, 32, 32)
    assert fxopt.explain(m, x, options=opts).measurements > 0
    assert fxopt.explain(m, x, options=opts).measurements > 0


def test_heuristic_is_default_on_cpu_and_measures_nothing():
    r = fxopt.explain(SmallResNet().eval(), torch.randn(1, 3, 32, 32))
    assert r.measurements == 0
    assert {c.how for c in r.conv_algorithms.values()} <= {"heuristic", "only-direct"}


@pytest.mark.parametrize("algorithm", ALGOS[1:])
def test_forced_algorithm_sets_node_and_prepacks(algorithm):
    r = fxopt.explain(SeedCNN2().eval(), torch.randn(2, 3, 32, 32), options={"conv_algorithm": algorithm})
    convs = conv_nodes(r.after)
    assert [n.args[10] for n in convs] == [algorithm] * 2
    # the weight transform was folded: no prepack op remains in the per-call graph
    assert str(PREPACK) not in r.op_counts_after
    assert all(n.args[11] is not None for n in convs)


def test_per_layer_override_by_qualified_name():
    opts = {"conv_algorithm": {"conv1": "fft", "*": "direct"}}
    r = fxopt.explain(SeedCNN2().eval(), torch.randn(1, 3, 32, 32), options=opts)
    assert r.conv_algorithms["conv1"].algorithm == "fft"
    assert r.conv_algorithms["conv2"].algorithm == "direct"


def test_forcing_an_illegal_algorithm_falls_back_to_direct():
    r = fxopt.explain(SeedCNN().eval(), torch.randn(1, 3, 32, 32), options={"conv_algorithm": "winograd_2x2_3x3"})
    assert {c.algorithm for c in r.conv_algorithms.values()} == {"direct"}  # 5x5 kernels
    assert any("illegal" in n for p in r.passes for n in p.notes)


@pytest.mark.parametrize("algorithm", ALGOS)
@pytest.mark.parametrize("model", [SeedCNN, SeedCNN2, "resnet18"])
def test_forced_algorithms_on_reference_models_match_eager(algorithm, model):
    m = (torchvision.models.resnet18(weights=None) if model == "resnet18" else model()).eval()
    x = torch.randn(2, 3, 64 if model == "resnet18" else 32, 64 if model == "resnet18" else 32)
    compiled = torch.compile(m, backend="fxopt", options={"conv_algorithm": algorithm})
    with torch.no_grad():
        assert relative_error(compiled(x), m(x)) <= 1e-4


def test_large_kernel_1d_fft_forced_matches():
    conv = nn.Conv1d(4, 4, 257, padding=128).eval()
    x = torch.randn(2, 4, 2048)
    r = fxopt.explain(conv, x, options={"conv_algorithm": "auto", "autotune_cache": False})
    (rec,) = r.conv_algorithms.values()
    assert rec.candidates.get("fft") is not None  # measured, accurate enough
    compiled = torch.compile(conv, backend="fxopt", options={"conv_algorithm": "fft"})
    with torch.no_grad():
        assert relative_error(compiled(x), conv(x)) <= 1e-4
