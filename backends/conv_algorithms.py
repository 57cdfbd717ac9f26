"""The convolution algorithm library moved to ``fxopt.conv_algorithms`` (its math is pure PyTorch
that ``fxopt.ops`` and the passes use as references, not an executor's). This module re-exports
its names for code that still imports them from here."""
from fxopt.conv_algorithms import (ALGORITHMS, FFT_MAX_SPECTRUM_BYTES, NCHW_MIN_KERNEL, ConvAlgorithm,  # noqa: F401
                                   ConvSig, channels_first_candidate, compute_dtype, get_algorithm,
                                   legal_algorithms)
