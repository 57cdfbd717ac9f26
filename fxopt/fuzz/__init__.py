"""``fxopt fuzz``: random CNN graphs through the whole backend, against eager.

    fxopt fuzz --device cuda --jobs 14 --examples 14000 --time-budget 450 --seed 3 --out fuzz-out
    fxopt fuzz --device cuda --examples 2000 --time-budget 500 --shard 0/4 --out fuzz-out
    fxopt fuzz --merge fuzz-out

``graphs.programs()`` draws a model as Python source with its input, mode and options;
``check.run_program`` runs it eagerly and through ``torch.compile(backend="fxopt")`` and compares;
``runner.run_fuzz`` drives hypothesis (search, shrinking, a directory database), writes a
reproducer per failure (``repro.py``) and the coverage of kernel families, ops, dtypes and layouts
(``coverage.py``); ``parallel.py`` runs a run's shards as processes at once (``--jobs``) and merges
them; ``sample.py`` picks the sanitizers' sample; ``geometry.py`` emulates the register-row
reductions' thread mapping on the CPU, ``simt.py`` runs the column reductions thread by thread.
"""
from .coverage import FAMILIES, Coverage, kernel_family
from .graphs import Program, programs
from .runner import merge, run_fuzz

__all__ = ["Coverage", "FAMILIES", "Program", "kernel_family", "merge", "programs", "run_fuzz"]
