"""Shared C emission for every generated kernel, pure Python (no GPU needed): ``source.py`` (the
``KernelSource`` a generator returns, the index-width rule and naming helpers), ``c.py`` (C types,
the prelude, activation and pointwise snippets, loaded from ``templates/*.cuh``), ``epilogue.py`` (a
convolution's bias / residual / activation epilogue as C lines), ``emit.py`` (the IR's expressions as
C statements) and ``ir_kernel.py`` (the header, parameters and name of a kernel generated from the
IR). The kernel families (``kernels/``) build their sources from these."""
