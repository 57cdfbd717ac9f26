"""Property tests: random CNNs give eager's results through each pass and the whole pipeline.

The CI profile (tests/conftest.py) runs a bounded, deterministic number of
examples; `--hypothesis-profile=thorough` (or HYPOTHESIS_PROFILE=thorough) searches longer.
"""
import pytest
import torch
from hypothesis import given, settings

from fxopt.testing import check_equivalence, cnn_cases

# Each pass alone, with the pass it needs to have anything to match.
ALONE = {
    "dead_code": ["dead_code"],
    "fold_batchnorm": ["fold_batchnorm"],
    "fuse_conv_epilogue": ["fuse_conv_epilogue"],
    "layout": ["fuse_conv_epilogue", "layout"],
    "output_formats": ["output_formats"],
    "select_conv_algorithm": ["fuse_conv_epilogue", "select_conv_algorithm"],
    "fold_constants": ["fold_batchnorm", "fold_constants"],
}


def _examples(n):
    """n examples in the CI profile (at most its bound of 25: each example compiles a model), the
    profile's own (larger) number otherwise (``thorough``: 400 for every test here)."""
    current = settings.default.max_examples
    return settings(max_examples=min(n, current) if current <= 25 else current)


@_examples(25)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(1, 2)))
def test_pipeline_float32(case):
    check_equivalence(case)


@_examples(25)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), max_layers=6))
def test_pipeline_channels_last(case):
    check_equivalence(case, options={"layout": "channels_last"})


@pytest.mark.parametrize("name", sorted(ALONE))
@_examples(25)
@given(case=cnn_cases(dtypes=(torch.float32,), ndims=(1, 2)))
def test_each_pass_alone(name, case):
    check_equivalence(case, options={"passes": ALONE[name], "layout": "channels_last"})


@_examples(25)
@given(cnn_cases(dtypes=(torch.float64, torch.bfloat16), ndims=(1, 2)))
def test_pipeline_other_dtypes(case):
    check_equivalence(case)


@_examples(25)
@given(cnn_cases(dtypes=(torch.float32,), ndims=(2,), training=True, min_batch=2))
def test_training_gradients(case):
    check_equivalence(case)


@pytest.mark.parametrize("algorithm", ["winograd_2x2_3x3", "winograd_4x4_3x3", "fft", "gemm"])
@_examples(15)
@given(case=cnn_cases(dtypes=(torch.float32,), ndims=(1, 2)))
def test_forced_algorithm(algorithm, case):
    from fxopt.conv_algorithms import get_algorithm

    rtol, atol = get_algorithm(algorithm).tolerance(torch.float32)
    check_equivalence(case, options={"conv_algorithm": algorithm}, rtol=max(rtol, 1e-4), atol=max(atol, 1e-4))
