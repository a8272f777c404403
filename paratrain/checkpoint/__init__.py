"""Checkpoints: sharded saves through torch.distributed.checkpoint that load under another world
size or strategy, are atomic, checksummed and read only their own files.

    save_load.py     save, load, verify, describe (the DCP layout and the marker)
    layout.py        the canonical, world-size-free view of a model and optimizer
    files.py         the marker, checksums, and errors that name the file
    dcp_io.py        DCP's reader and writer as paratrain uses them
    root.py          a root of checkpoints: newest, resume, prune
    lock.py          one writing job per root
    random_state.py  RNG states and JSON carried as tensors
    export.py        one .safetensors file, a tensor at a time
    weights.py       a consolidated weights file loaded into any wrapped model
"""

from paratrain.checkpoint.save_load import (
                                            CheckpointWarning,
                                            DamagedCheckpoint,
                                            describe,
                                            hyperparameter,
                                            latest,
                                            load,
                                            lock_root,
                                            prune,
                                            resume,
                                            save,
                                            unlock_roots,
                                            verify,
)

__all__ = ["save", "load", "resume", "latest", "prune", "verify", "describe", "lock_root", "unlock_roots",
           "hyperparameter", "DamagedCheckpoint", "CheckpointWarning"]
