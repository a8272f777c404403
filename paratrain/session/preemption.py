"""Checkpoint on preemption: `Session(checkpoint_on_preempt="checkpoints")`.

SLURM (`--signal=USR1@60`, or SIGTERM at the end of a job's time) and Kubernetes (SIGTERM, then
SIGKILL after the grace period) warn a job before they kill it; `paratrain run`'s agent passes
SIGTERM on to the ranks and waits before it kills them. On SIGTERM or SIGUSR1 a rank only notes
it. At the end of each optimizer step the ranks agree, with one all-reduce of that note (so a
rank signalled a moment later still stops at the same step), and then every rank writes a
checkpoint to the root and leaves with exit status 0: a requeued job calls `session.resume(root)`
and goes on from the step after, exactly (the checkpoint is taken at an optimizer step).

The all-reduce costs one small collective per optimizer step, which is why this is opt-in.
"""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain.distributed.comm import group_device
from paratrain.launch import worker

if TYPE_CHECKING:
    from paratrain.session.session import Session

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """The note a signal leaves, and the agreement at each optimizer step."""

    def __init__(self, root: str):
        self.root, self.signalled = root, 0
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():  # Python runs handlers there only
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.signalled = signum  # acted on at the next optimizer step, by every rank together

    def agreed(self) -> int:
        """The signal any rank received (0: none). A collective: every rank calls it."""
        flag = torch.tensor([float(self.signalled)])
        if dist.is_initialized():
            flag = flag.to(group_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def checkpoint_and_exit(self, session: "Session", signum: int) -> None:
        """Write the checkpoint every rank agreed on, and leave with status 0. It prunes nothing:
        the run's own checkpoint(root, keep=...) calls decide what is kept."""
        try:
            path = session.checkpoint(self.root, keep=0)
        except Exception as e:  # `paratrain run` says why, not only "stopped by SIGTERM"
            worker.note_preempted(None, error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
            raise
        session.print(f"preempted by {signal.Signals(signum).name}: saved {path}; resume with "
                      f"session.resume({self.root!r})")
        session.close()
        worker.note_preempted(str(path))  # so that `paratrain run` exits 0 as well
        raise SystemExit(0)

    def after_step(self, session: "Session", result: Any) -> None:
        """Every optimizer step (a step hook, session/hooks.py: the last a session calls): stop
        here, on every rank, if any rank was told to."""
        signum = self.agreed()
        if signum:
            self.checkpoint_and_exit(session, signum)

    def restore(self) -> None:
        """Put back the handlers that were there before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
