import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py, importable by spawned ranks too

# Multi-rank tests run CPU ranks over gloo, on a machine with a GPU too: there the automatic choice
# (nccl, cuda:LOCAL_RANK) has no GPU for rank 1 of `paratrain run -n 2` on a one-GPU machine, as
# a run of the suite on an H200 showed (2026-11-26). The `cuda` tests name their devices.
os.environ.setdefault("PARATRAIN_BACKEND", "gloo")
