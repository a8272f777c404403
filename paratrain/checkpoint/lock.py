"""One writing job per checkpoint root.

Two jobs checkpointing into the same root would interleave their sequences, prune each other's
checkpoints and race on the same `.partial` directories, each reporting success. So the first
`session.checkpoint(root)` takes `root/paratrain.lock` on rank 0, created with O_CREAT|O_EXCL
(atomic on local file systems and NFS v3+). The file names the job: host, pid, job id, attempt,
start time and command; its mtime is a heartbeat that a thread refreshes every HEARTBEAT_S seconds.

A lock found there already is taken over when it is stale:
- it is an earlier attempt of this same job (same SLURM or torchelastic job id, another restart
  count: a restart under --max-restarts, a SLURM requeue), quietly;
- its process is gone (same host, pid not alive), with a CheckpointWarning;
- its heartbeat is older than PARATRAIN_LOCK_STALE seconds (default 300; the only sign of life of
  a job on another host), with a CheckpointWarning.
Otherwise the second job gets a ConfigError naming the first. `Session.close()` releases the lock,
and so does the interpreter's exit; a killed job leaves it, stale.

A lock (or the whole root) deleted while its job runs is recreated at the job's next
checkpoint(), with a CheckpointWarning saying what was deleted; when another job took the root
meanwhile, that job is named (a ConfigError) as for any second job.

A `save(path)` outside `checkpoint()` takes no lock, but refuses a root another live job holds.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from paratrain.checkpoint.files import CheckpointWarning, agree, rank
from paratrain.errors import ConfigError

LOCK = "paratrain.lock"
HEARTBEAT_S = 30.0


class _Held:
    """A lock this process holds: the file (rank 0 only), who in this process uses it, the heartbeat."""

    def __init__(self, path: Path | None, record: dict | None) -> None:
        self.path, self.record, self.owners = path, record, set()
        self.stop = threading.Event()
        if path is not None:
            threading.Thread(target=self._beat, daemon=True, name="paratrain-lock-heartbeat").start()

    def _beat(self) -> None:
        while not self.stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)  # times=None: on NFS the server's clock, as readers on other hosts see
            except OSError:
                pass  # gone or unreachable now: the check at the next checkpoint() says so

    def release(self) -> None:
        self.stop.set()
        if self.path is not None and _read(self.path) == self.record:  # never delete a successor's lock
            self.path.unlink(missing_ok=True)


_HELD: dict[Path, _Held] = {}  # root → lock; a held lock is a process-wide resource, like an open file


def lock_root(root: str | os.PathLike, owner: Any) -> None:
    """Lock `root` for this job, or check that the lock taken earlier is still this job's. A
    collective: rank 0 decides, and every rank raises the same ConfigError when it cannot."""
    key = Path(root).resolve()
    path = agree(lambda: _acquire(key))
    if key not in _HELD:  # only rank 0 holds the file; the others only count their owners
        _HELD[key] = _Held(path, _read(path)) if rank() == 0 else _Held(None, None)
    _HELD[key].owners.add(id(owner))


def unlock_roots(owner: Any) -> None:
    """Release the locks `owner` took, once no other user in this process holds them."""
    for key, held in list(_HELD.items()):
        held.owners.discard(id(owner))
        if not held.owners:
            held.release()
            del _HELD[key]


def check_not_locked(root: Path) -> None:
    """Refuse to write under `root` when another live job holds its lock (rank 0)."""
    path = root.resolve() / LOCK
    other = _read(path) if path.is_file() else None
    if other is not None and root.resolve() not in _HELD and _stale(path, other) is None:
        raise ConfigError(_conflict(root, other))


def _acquire(root: Path) -> Path:
    """Rank 0: create the lock file, take over a stale one, or raise naming the job that holds it."""
    path = root / LOCK
    if root in _HELD and not path.exists() and _recreated(root, path):
        return path
    if root in _HELD:
        if _read(path) != _HELD[root].record:
            raise ConfigError(f"the lock on checkpoint root {root} was taken by another job since this "
                              f"one took it: {_describe(_read(path))}. Two jobs are writing to {root}; "
                              "stop one, or give each its own root")
        return path
    root.mkdir(parents=True, exist_ok=True)
    while not _create(path):
        other = _read(path)
        reason = _stale(path, other or {})
        if reason is None and other is None:  # being written by its creator this instant
            time.sleep(0.1)
            continue
        if reason is None:
            raise ConfigError(_conflict(root, other))
        if not (other and other.get("job") and other.get("job") == _me()["job"]):
            warnings.warn(f"taking over the lock on checkpoint root {root} from "
                          f"{_describe(other)}: {reason}", CheckpointWarning, stacklevel=2)
        # A race left open: two jobs judging the same stale lock within milliseconds can both
        # unlink, the later one removing the earlier one's new lock; that job then fails at its
        # next checkpoint(), which finds someone else's record in the file.
        path.unlink(missing_ok=True)
    return path


def _recreated(root: Path, path: Path) -> bool:
    """The lock this job holds on `root` is gone: the root was deleted (with its checkpoints), or
    the lock file alone (by hand, or by a job that judged it stale). Take it again, saying so;
    False when another job took it first (the caller then names that job)."""
    what = f"the lock file {path}" if root.is_dir() else f"checkpoint root {root}, with its lock and checkpoints,"
    root.mkdir(parents=True, exist_ok=True)
    if not _create(path):
        return False
    warnings.warn(f"{what} was deleted while this job held the lock on {root}; paratrain recreated it and "
                  "goes on writing there. Checkpoints deleted with it are gone; delete a job's lock only "
                  "once the job has ended", CheckpointWarning, stacklevel=3)
    return True


def _create(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(_me(), f)
    return True


def _stale(path: Path, other: dict) -> str | None:
    """Why the lock `other` no longer guards anything, or None while its job may be alive."""
    me = _me()
    if other.get("job") and other.get("job") == me["job"] and other.get("attempt") != me["attempt"]:
        return "it was left by an earlier attempt of this job"
    if other.get("host") == me["host"] and not _alive(other.get("pid", -1)):
        return f"its process {other.get('pid')} on this host is no longer running"
    if other.get("host") == me["host"] and other.get("pid") == me["pid"] and other.get("started") != me["started"]:
        # a restart in the same container gets the same small pid again: this process holds no lock
        return f"it was left by an earlier process {me['pid']} on this host, started {other.get('started')}"
    try:
        age, limit = time.time() - path.stat().st_mtime, _stale_after()
    except FileNotFoundError:
        return "it was released meanwhile"
    if age > limit or (not other and age > 10):  # an empty lock file: its writer died creating it
        return f"its heartbeat is {age:.0f} s old (stale after {limit:.0f} s: PARATRAIN_LOCK_STALE)"
    return None


def _conflict(root: Path, other: dict) -> str:
    return (f"checkpoint root {root} is being written by another job: {_describe(other)}. Two jobs "
            f"writing one root overwrite and prune each other's checkpoints; give this job its own "
            f"root, or stop the other one. If that job is dead, delete {root / LOCK} (a lock whose "
            f"heartbeat is older than {_stale_after():.0f} s is taken over by itself)")


def _describe(record: dict | None) -> str:
    if not record:
        return "an unknown job"
    job = f"job {record['job']}, " if record.get("job") else ""
    return (f"{job}pid {record.get('pid')} on {record.get('host')}, started {record.get('started')} "
            f"({record.get('command', '?')})")


def _me() -> dict:
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    attempt = (os.environ.get("SLURM_RESTART_COUNT", "0"), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": "" if job == "none" else job,
            "attempt": "/".join(attempt), "started": _STARTED, "command": " ".join(sys.argv)[:200]}


def _read(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or a pid we cannot probe: assume alive
    return True


def _stale_after() -> float:
    return float(os.environ.get("PARATRAIN_LOCK_STALE", "300"))


def _release_all() -> None:
    for held in _HELD.values():
        held.release()
    _HELD.clear()


_STARTED = time.strftime("%Y-%m-%dT%H:%M:%S%z")
atexit.register(_release_all)
