"""A root of checkpoints: which one is newest, which ones to prune.

Newest means written last, by the sequence each checkpoint's marker records ([Note: the marker] in
checkpoint_files.py), never by name: after a restart with another `accumulate`, step numbers start
over lower than the stale ones of the first run (issue 16, point 1).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from paratrain.checkpoint_files import complete, problems, rank


def latest(root: str | os.PathLike, *, verify: bool = False) -> Path | None:
    """The newest intact checkpoint `root/step-*` by the order of writing, or None. Intact: its
    files are all there at their recorded sizes (a stat each); `verify=True` also checks their
    sha256 (reads them all). One process."""
    for path in reversed(complete(root)):
        if not problems(path, checksum=verify):
            return path
    return None


def prune(root: str | os.PathLike, keep: int) -> None:
    """Delete all but the newest `keep` complete checkpoints under `root` (rank 0 only). Newest by
    sequence, so no checkpoint is deleted that was written after one kept."""
    if rank() == 0 and keep > 0:
        for old in complete(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
