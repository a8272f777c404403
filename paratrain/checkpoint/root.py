"""A root of checkpoints: which one is newest, which one to resume from, which ones to prune.

Newest means written last, by the sequence each checkpoint's marker records ([Note: the marker] in
checkpoint/files.py), never by name: after a restart with another `accumulate`, step numbers start
over lower than the stale ones of the first run.

`resume` is the restart path, and must not be blocked by one bad checkpoint: it loads the
newest checkpoint, and when that one is damaged (a file missing, truncated or changed: `load`
checks sizes and sha256) it warns, naming it and why, and loads the one written before it. Rank 0
lists the candidates and every rank tries them in that order; `load` raises the same
DamagedCheckpoint on every rank (its checks are gathered), so all ranks end on the same checkpoint.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

from paratrain.checkpoint.files import MARKER, CheckpointWarning, DamagedCheckpoint, agree, complete, problems, rank
from paratrain.errors import ConfigError


def latest(root: str | os.PathLike, *, verify: bool = False) -> Path | None:
    """The newest intact checkpoint `root/step-*` by the order of writing, or None. Intact: its
    files are all there at their recorded sizes (a stat each); `verify=True` also checks their
    sha256 (reads them all). One process: for a decision all ranks share, use `resume`."""
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


def resume(root: str | os.PathLike, load_fn: Callable[[Path], Any], *, required: bool = False) -> Path | None:
    """Call `load_fn` on the newest checkpoint under `root` that loads, and return its path. A
    damaged one (DamagedCheckpoint) is skipped with a CheckpointWarning naming it and why. `root`
    may also be one checkpoint, loaded or refused as it is. None when there is no checkpoint, or a
    ConfigError saying where it looked when `required`. A collective: rank 0 lists, all agree."""
    root = Path(root)
    candidates = agree(lambda: _candidates(root))
    if rank() == 0:
        for path in _unmarked(root):
            warnings.warn(f"checkpoint {path} is damaged: it has no {MARKER}, which every save writes last (the "
                          "save did not finish, or the file was removed); resume() skips it", CheckpointWarning,
                          stacklevel=2)
    if not candidates:
        if required:
            raise ConfigError(agree(lambda: _nothing_found(root)))
        others = _not_step_named(root) if rank() == 0 and root.is_dir() else []
        if others:  # saved with session.save(root / name): not what resume looks for, but said
            warnings.warn(f"resume({str(root)!r}) starts from scratch: {root} holds no checkpoint step-*, but "
                          f"{', '.join(others[:5])} {'are checkpoints' if len(others) > 1 else 'is a checkpoint'}"
                          " under another name: pass its path to resume from it", CheckpointWarning, stacklevel=2)
        return None
    skipped = []
    for path in candidates:
        try:
            load_fn(path)
            return path
        except DamagedCheckpoint as e:
            if path == root:  # the user named this one: no other will do
                raise
            skipped.append(path.name)
            if rank() == 0:
                warnings.warn(f"{e.reason}; resume() skips it and tries the checkpoint written before it",
                              CheckpointWarning, stacklevel=2)
    raise DamagedCheckpoint(f"every checkpoint under {root} is damaged ({', '.join(skipped)}; the "
                            "warnings above say why): move them away to start from scratch")


def _candidates(root: Path) -> list[Path]:
    """`root` itself when it is a checkpoint (or a save's leftovers), else its checkpoints, newest first."""
    if root.is_dir() and ((root / MARKER).is_file() or (root / ".metadata").is_file()
                          or root.name.endswith(".partial")):
        return [root]
    return list(reversed(complete(root))) if root.is_dir() else []


def _unmarked(root: Path) -> list[Path]:
    """The directories `root/step-*` that hold checkpoint files but no marker: not a save in progress
    (that is `step-*.partial`) nor one replaced by a newer save of its name (`step-*.old`)."""
    if not root.is_dir() or (root / MARKER).is_file():
        return []
    return sorted(p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith((".partial", ".old"))
                  and not (p / MARKER).is_file() and any(p.iterdir()))


def _not_step_named(root: Path) -> list[str]:
    """The complete checkpoints directly under `root` whose names resume() does not look for."""
    return sorted(p.name + "/" for p in root.iterdir() if p.is_dir() and (p / MARKER).is_file())


def _nothing_found(root: Path) -> str:
    where = f"resume({str(root)!r}, required=True) found no checkpoint:"
    if not root.exists():
        return (f"{where} {root.absolute()} does not exist; pass the root that session.checkpoint() "
                "wrote to (check for a typo), or leave required=False to start from scratch")
    if not root.is_dir():
        return f"{where} {root} is a file; pass the directory session.checkpoint() wrote to"
    children = sorted(p.name + "/" * p.is_dir() for p in root.iterdir())
    named = _not_step_named(root)
    hint = (f"; {', '.join(named[:5])} {'are checkpoints' if len(named) > 1 else 'is a checkpoint'} not "
            "named step-*: pass its path to load it") if named else ""
    return (f"{where} {root} holds no complete checkpoint step-*/ with a {MARKER} (it holds: "
            f"{', '.join(children[:10]) or 'nothing'}{' …' * (len(children) > 10)}){hint}")
