import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI: bounded and deterministic. Locally: --hypothesis-profile=thorough for a longer search.
settings.register_profile("ci", max_examples=25, derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=400, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config):
    """The generated C way's compile (~0.7 s a graph) only where a test is about it (its own fixture
    turns it on), for the whole session and its subprocesses; ``FXOPT_CPU_GENERATED_C=1 pytest`` keeps
    it on everywhere."""
    os.environ.setdefault("FXOPT_CPU_GENERATED_C", "0")


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    """Every test gets its own autotune/kernel cache dir and a clean Dynamo state."""
    monkeypatch.setenv("FXOPT_CACHE_DIR", str(tmp_path / "fxopt-cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    torch.compiler.reset()
    grad = torch.is_grad_enabled()
    yield
    torch.compiler.reset()
    leaked = torch.is_grad_enabled() != grad
    torch.set_grad_enabled(grad)
    assert not leaked, "the test left autograd's grad mode changed"


_FROZEN_BEFORE = [None]  # the test file whose first test the last gc.freeze() preceded


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test file's first test (the previous file's fixtures torn down, the new file's not
    yet made): collect, then move every object that survived out of the cyclic collector's sight
    (``gc.freeze``). The session keeps much alive (imported modules, the collected tests, torch's and
    Dynamo's process-wide caches): over 2 million objects late in the run, which every full
    collection walked again, about a tenth of the suite's time. Objects made later are collected as
    before; a frozen object that becomes unreachable is still freed by reference counting, only one
    in a reference cycle stays."""
    if item.path != _FROZEN_BEFORE[0]:
        _FROZEN_BEFORE[0] = item.path
        gc.collect()
        gc.freeze()


def pytest_terminal_summary(terminalreporter):
    from fxopt.testing import fusion, strategies

    terminalreporter.write_line(f"fxopt: generated graphs checked for equivalence: {strategies.GRAPHS_CHECKED}")
    terminalreporter.write_line(f"fxopt: fused regions checked against their ATen ops: {fusion.REGIONS_CHECKED}")
