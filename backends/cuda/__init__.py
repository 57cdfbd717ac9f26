"""The cuda executor, by layer (each imports only the layers below it; ``tests/test_imports.py``):

- ``runtime/``: the executor that plans, measures (``measure.py``) and puts the choices into the
  graph (``executor.py``), the measured node groups (``groups.py``), the training BatchNorms'
  in-place statistics (``running_stats.py``) and the CUDA-graph runner (``cudagraphs.py``).
- ``schedule/``: which nodes form one kernel: the lowering rules (``lowering.py`` over
  ``values.py``, ``pointwise_rules.py``, ``movement_rules.py``, ``reduction_rules.py``), the fusion
  scheduler (``fusion.py``, building each kernel with ``build.py`` and ordering its loops with
  ``loops.py``), the graph rewrites around it (``rewrite.py``) and each region's reference and
  template candidates (``generated.py``).
- ``kernels/``: one module per kernel family (when it applies, its candidates, its source, its
  checks and launch; ``.cu`` templates in ``kernels/templates/``) and ``FAMILIES`` / ``GROUPS``,
  their tables.
- ``codegen/``: the C emission the families share; ``ir/``: the loop-level IR and its interpreter;
  ``compiler.py``: NVRTC compile (through ``cuda.core``), the in-memory and on-disk cubin cache, and
  ``CompileError`` carrying NVRTC's log and the generated source.
"""
