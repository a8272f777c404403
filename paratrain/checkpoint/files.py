"""What makes a checkpoint directory trustworthy: its marker, its place among the saves of its root,
the checksums of its files, and errors that name the file at fault.

[Note: the marker] `paratrain.json` is written by rank 0 last, once every rank's files are on
disk, and holds besides the session's state:

    sequence   1 + the largest sequence under the root when it was written. The newest checkpoint
               is the one written last, whatever its name: step numbers start over lower when a
               run restarts with another `accumulate`, so names cannot order checkpoints.
    saved_at   wall time of the save (seconds since the epoch), for people and as a tie-break.
    files      {name: {"bytes": n, "sha256": hex}} for every file DCP wrote, each hashed by the
               rank that wrote it: its bytes are still in that rank's page cache, and on a shared
               file system rank 0 may not yet see another node's fresh writes.

A checkpoint written before these fields existed has sequence 0 and no checksums: it sorts below
every newer one and loads unverified.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from paratrain.errors import CheckpointError, ConfigError, ParatrainError, UsageError

MARKER = "paratrain.json"  # written last: a directory without it is not a checkpoint
_CHUNK = 8 << 20  # bytes per read when hashing: large reads keep sha256 near memory speed
_ERRNO_WORDS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                errno.EIO: "input/output error", errno.ENOENT: "no such file or directory"}


ADVICE = (". It is damaged or incomplete: load an earlier one (session.resume(root) falls back by "
          "itself; paratrain.checkpoint.latest(root, verify=True) names it)")


class DamagedCheckpoint(ConfigError):
    """A checkpoint's files are missing, truncated or changed since they were written."""

    @property
    def reason(self) -> str:
        """The message without the advice, for a warning that acts on it."""
        return str(self).removesuffix(ADVICE)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped, or a stale lock taken over; training goes on."""


# -- the marker and the order of saves --------------------------------------------------------


def read_marker(path: Path) -> dict:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: its {MARKER} cannot be read "
                                f"({type(e).__name__}: {e}){ADVICE}") from None
    if not isinstance(marker, dict):
        raise DamagedCheckpoint(f"checkpoint {path} is damaged: its {MARKER} holds no JSON object{ADVICE}")
    return marker


def write_marker(path: Path, marker: dict) -> None:
    with open(path / MARKER, "w") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())  # the rename that publishes the checkpoint must not outrun its marker


def complete(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints `root/step-*`, oldest first by sequence (see [Note: the marker]).
    A save over an existing name renames `X` to `X.old` and then `X.partial` (marked complete) to
    `X`: a crash between the two leaves no `X`, and both count, as what they are."""
    found = []
    for path in Path(root).glob("step-*"):
        name = path.name.removesuffix(".partial").removesuffix(".old")
        if (path / MARKER).is_file() and (name == path.name or not (path.parent / name).exists()):
            found.append(path)
    return sorted(found, key=_order)


def _order(path: Path) -> tuple:
    try:
        marker = read_marker(path)
    except DamagedCheckpoint:  # order unknown: count it as newest, so it is verified, never pruned
        return (math.inf, 0.0, path.name)
    return (marker.get("sequence", 0), marker.get("saved_at", 0.0), path.name)


def next_sequence(root: Path) -> int:
    """1 + the largest sequence of a checkpoint under `root`: the order of writing, kept on disk."""
    return 1 + max((s for s, _, _ in map(_order, complete(root)) if s != math.inf), default=0)


# -- a checkpoint reads only its own files --------------------------------------------------


def listed_files(ckpt: Path) -> dict:
    """The files `ckpt`'s marker lists ({name: {"bytes", "sha256"}}; {} for a checkpoint saved
    before checksums), each checked to be a file of `ckpt` itself (see own_file)."""
    files = read_marker(ckpt).get("files", {})
    for name in files:
        own_file(ckpt, name, None, "a file its paratrain.json lists")
    return files


def own_file(ckpt: Path, name: str, listed: dict | None, what: str) -> Path:
    """`ckpt / name`, refused with a UsageError where `name` is absolute, leads out of `ckpt` (after
    `..` and symlinks are resolved), or is not among the `listed` files (None: no list to check,
    as for a checkpoint saved before checksums). Checksums catch damage, not an attacker, who
    rewrites them too: without this a hand-made `.metadata` could point a tensor at any file the
    job can read, and resume, `paratrain ckpt info` and `export` would read it into the model."""
    path = ckpt / name
    if Path(name).is_absolute():
        reason = "it is an absolute path"
    elif not path.resolve().is_relative_to(ckpt.resolve()):
        reason = "it leads out of the checkpoint's directory"
    elif listed is not None and name not in listed:
        reason = f"the checkpoint's {MARKER} does not list it"
    else:
        return path
    raise UsageError(f"refusing to read {name!r}, {what} of checkpoint {ckpt}: {reason}. A checkpoint "
                     "reads only its own files; this one was changed after it was written: do not load it")


# -- checksums ---------------------------------------------------------------------------------


def digest(path: Path) -> dict:
    """{"bytes": size, "sha256": hex} of one file, read in large chunks."""
    sha, size, buffer = hashlib.sha256(), 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            sha.update(view[:n])
            size += n
    return {"bytes": size, "sha256": sha.hexdigest()}


def file_problem(ckpt: Path, name: str, recorded: dict, checksum: bool = True) -> str | None:
    """What is wrong with file `name` of `ckpt` against what the save recorded, or None. Sizes cost
    a stat; `checksum` reads the whole file."""
    try:
        size = (ckpt / name).stat().st_size
        if size != recorded["bytes"]:
            return (f"{name} is truncated ({size} of {recorded['bytes']} bytes)" if size < recorded["bytes"]
                    else f"{name} has {size} bytes where {recorded['bytes']} were written")
        if checksum and digest(ckpt / name)["sha256"] != recorded["sha256"]:
            return (f"{name} does not match the sha256 recorded when it was written: its bytes "
                    "changed on disk or in transfer")
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({os_cause(e)})"
    return None


def problems(ckpt: Path, checksum: bool) -> list[str]:
    """Everything wrong with `ckpt`'s files, checked by this process alone."""
    try:
        files = listed_files(ckpt)
    except DamagedCheckpoint as e:
        return [str(e)]
    found = (file_problem(ckpt, name, files[name], checksum) for name in sorted(files))
    return [p for p in found if p]


# -- errors that name the file -----------------------------------------------------------------


class FileError(Exception):
    """A failure reading or writing one checkpoint file, with the file's name in its first words.
    Picklable (one message argument): DCP gathers every rank's exception onto every rank."""


def os_cause(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno in _ERRNO_WORDS:
        return f"{_ERRNO_WORDS[e.errno]} ({errno.errorcode[e.errno]})"
    return f"{type(e).__name__}: {str(e)[:200]}"


FULL_BELOW = 16 << 20  # bytes: a write that failed with less free than this failed for want of space


def full_disk(directory: Path) -> str | None:
    """'no space left on device (ENOSPC: 12 KiB free on the file system holding DIR)' when that file
    system is full, else None. torch.save's zip writer meets a full disk as a short write and says
    only "unexpected pos 704 vs 598", so a write that failed so is judged by the space left."""
    try:
        fs = os.statvfs(directory)
    except (OSError, AttributeError):  # gone, or Windows
        return None
    blocks = fs.f_bfree if os.geteuid() == 0 else fs.f_bavail  # root may write into the reserved blocks
    free = blocks * fs.f_frsize
    if free >= FULL_BELOW:
        return None
    return f"no space left on device (ENOSPC: {free >> 10} KiB free on the file system holding {directory})"


def describe_failure(e: BaseException) -> str:
    """The root cause of a DCP CheckpointException in one line: each distinct per-rank failure with
    its ranks, instead of DCP's str() of every rank's full traceback."""
    ranks_of: dict[str, list[int]] = {}
    for rank, (exc, trace) in sorted(getattr(e, "failures", {}).items()):
        ranks_of.setdefault(_one_failure(exc, trace), []).append(rank)
    parts = [f"{text} (rank{'s' * (len(r) > 1)} {', '.join(map(str, r))})" for text, r in ranks_of.items()]
    more = f"; {len(parts) - 2} more kinds of failure" if len(parts) > 2 else ""
    return "; ".join(parts[:2]) + more if parts else f"{type(e).__name__}: {str(e)[:300]}"


def _one_failure(exc: BaseException, trace) -> str:
    if isinstance(exc, (FileError, ParatrainError)):
        return str(exc)
    where = f" at {Path(trace[-1].filename).name}:{trace[-1].lineno}" if trace else ""
    return f"{os_cause(exc)}{where}"


# -- decisions every rank shares --------------------------------------------------------------


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def agree(fn: Callable[[], Any]) -> Any:
    """`fn()` run on rank 0, its result or the exception it raised handed to every rank: a rank
    that raised alone would leave the others waiting in the next collective until the timeout."""
    ok, value, original = True, None, None
    if rank() == 0:
        try:
            value = fn()
        except Exception as e:
            ok, value, original = False, _sendable(e), e
    if world() > 1:
        box = [(ok, value)]
        dist.broadcast_object_list(box, src=0)
        ok, value = box[0]
    if not ok:
        raise original if original is not None else value
    return value


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order."""
    if world() == 1:
        return [obj]
    out: list[Any] = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def _sendable(e: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return CheckpointError(f"{type(e).__name__}: {e}")
