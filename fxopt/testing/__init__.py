"""Public testing helpers: reference models and hypothesis strategies for random CNNs."""
from fxopt.testing.models import REFERENCE_MODELS, SeedCNN, SeedCNN2, SmallResNet
from fxopt.testing.strategies import CNNCase, check_equivalence, cnn_cases, compile_with_fxopt

__all__ = ["CNNCase", "check_equivalence", "cnn_cases", "compile_with_fxopt",
           "REFERENCE_MODELS", "SeedCNN", "SeedCNN2", "SmallResNet"]
