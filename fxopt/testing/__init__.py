"""Public testing helpers: reference models, hypothesis strategies for random CNNs and the blocks between
their convolutions, and equivalence checks (whole models; the fusion scheduler's regions on the CPU)."""
from fxopt.testing.models import REFERENCE_MODELS, SeedCNN, SeedCNN2, SmallResNet
from fxopt.testing.strategies import CNNCase, check_equivalence, cnn_cases, compile_with_fxopt
from fxopt.testing.blocks import block_cases
from fxopt.testing.fusion import check_fusion

__all__ = ["CNNCase", "check_equivalence", "cnn_cases", "compile_with_fxopt", "block_cases", "check_fusion",
           "REFERENCE_MODELS", "SeedCNN", "SeedCNN2", "SmallResNet"]
