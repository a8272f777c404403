"""Ranks that are stopped (SIGSTOP, a job-control stop, a debugger) when the launcher ends the job.

torch's agent ends the ranks by sending SIGTERM to each rank's process group
(torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py: close), then
waits 30 s for them (api.py: SubprocessContext._close) before it sends SIGKILL. A stopped process
does not run its SIGTERM until it is continued, so a job with one stopped rank ended 30 s after the
others had given up waiting for it: `--timeout 20` took 52 s.

`wake_stopped(notes_dir)` wraps the handler's close while `paratrain run` runs its agent: a rank
whose process is stopped (state T or t in /proc) is noted (`<pid>.stopped`, read by
debug/postmortem.py, which then names it: "rank 1 is not running (stopped)") and continued right
after the signal (SIGCONT to its process group), so the SIGTERM it holds ends it at once, leaving
its last words (launch/worker.py) as any stopped rank does. Linux only (/proc); elsewhere nothing
changes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import time
from typing import Iterator

from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

STOPPED = ".stopped"  # <pid>.stopped in the notes folder: the rank was stopped when it was ended


@contextlib.contextmanager
def wake_stopped(notes_dir: str) -> Iterator[None]:
    """While the block runs, a stopped rank the agent ends is noted and continued (module docstring)."""
    handler = subprocess_handler.SubprocessHandler
    original = handler.close

    @functools.wraps(original)
    def close(self, death_sig: signal.Signals | None = None) -> None:
        stopped = is_stopped(self.proc.pid)
        if stopped:
            note_stopped(notes_dir, self.proc.pid)
        original(self, death_sig)
        if stopped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGCONT)  # the group: its loader workers are stopped too

    handler.close = close
    try:
        yield
    finally:
        handler.close = original


def is_stopped(pid: int) -> bool:
    """The process is stopped by a signal (T) or by a tracer (t); False when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def note_stopped(notes_dir: str, pid: int) -> None:
    with contextlib.suppress(OSError):
        with open(os.path.join(notes_dir, f"{pid}{STOPPED}"), "w") as f:
            f.write(repr(time.time()))


def was_stopped(notes_dir: str, pid: int | None) -> bool:
    return pid is not None and os.path.exists(os.path.join(notes_dir, f"{pid}{STOPPED}"))
