import compileall
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py, importable by spawned ranks too

# Bytecode for paratrain and the tests' helpers, once, as `pip install` writes it for an installed
# package. Where PYTHONDONTWRITEBYTECODE is set (these development machines set it) nothing writes
# it otherwise, and every process the tests start (each rank of each `paratrain run`, each launcher)
# compiled some 100 modules from source: ~0.3 s of CPU apiece (tests/test_cli.py: 98 s -> 88 s).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for folder in ("paratrain", "tests", "examples", "bench"):
    compileall.compile_dir(os.path.join(ROOT, folder), quiet=1)

# Multi-rank tests run CPU ranks over gloo, on a machine with a GPU too: there the automatic choice
# (nccl, cuda:LOCAL_RANK) has no GPU for rank 1 of `paratrain run -n 2` on a one-GPU machine, as
# a run of the suite on an H200 showed (2026-11-26). The `cuda` tests name their devices.
os.environ.setdefault("PARATRAIN_BACKEND", "gloo")
