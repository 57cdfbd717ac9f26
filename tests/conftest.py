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


def pytest_terminal_summary(terminalreporter):
    from fxopt.testing import fusion, strategies

    terminalreporter.write_line(f"fxopt: generated graphs checked for equivalence: {strategies.GRAPHS_CHECKED}")
    terminalreporter.write_line(f"fxopt: fused regions checked against their ATen ops: {fusion.REGIONS_CHECKED}")
