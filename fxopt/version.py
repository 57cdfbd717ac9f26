"""fxopt's version: one home, read by the package metadata (pyproject) and by the modules that key
caches and packages on it, without importing the whole ``fxopt`` package back."""
__version__ = "0.1.0"
