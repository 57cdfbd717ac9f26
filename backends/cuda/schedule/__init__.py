"""The schedule stage: which nodes form one kernel (``fusion.py``), each described in the loop IR
(``lowering.py`` and its rules), built into kernels (``build.py``, ``loops.py``) and put back into the
graph (``rewrite.py``). The per-node candidates are the kernel families' (``kernels/``)."""
