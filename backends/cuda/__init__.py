"""The cuda executor, organised by stage (the path of a graph from the pass pipeline to a launch):

- ``schedule/``: which nodes form one kernel and which implementations are candidates for it:
  the fusion scheduler over the loop-level IR (``ir.py``, ``lowering.py``, ``fusion.py``) and the
  template candidates for library nodes (``conv.py``, ``linear.py``, ``pool.py``) and node groups
  (``groups.py``).
- ``codegen/``: CUDA C from the IR (``kernel.py``) and from parameterised templates (``__init__``,
  ``direct_conv.py``, ``linear.py``, ``templates/*.cu``); pure Python, no GPU needed.
- ``compiler.py``: NVRTC compile (through ``cuda.core``), the in-memory and on-disk cubin cache, and
  ``CompileError`` carrying NVRTC's log and the generated source.
- ``runtime/``: launching (``launch.py``), measuring candidates (``measure.py``), the executor that
  puts the choices into the graph (``executor.py``) and the CUDA-graph runner (``cudagraphs.py``).
"""
