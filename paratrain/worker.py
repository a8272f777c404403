"""What a rank started by `paratrain run` does for its launcher: die with it.

`attach()` runs on `import paratrain`, before torch is imported, and does nothing in any process
that `paratrain run` did not start itself (plain python, torchrun, srun, a rank's own children).

[Note: workers die with their launcher]
`paratrain run` runs torch's elastic agent inside its own process (cli.run calls
torch.distributed.run.main), and the agent starts every rank with Popen from that process's main
thread (torch/distributed/elastic/multiprocessing/subprocess_handler), in a session of its own.
The agent stops the ranks when it exits, or on SIGTERM or SIGINT; SIGKILL (the OOM killer's)
gives it no chance, and the ranks would run on, re-parented to PID 1, holding GPUs and ports.
So the launcher exports its pid (PARATRAIN_LAUNCHER_PID) and a rank whose parent it is asks the
kernel for SIGKILL when that parent dies: prctl(PR_SET_PDEATHSIG), Linux only, a no-op elsewhere.
The request fires when the thread that forked the rank exits, here the launcher's main thread,
which lives as long as the launcher. It does not cover a parent that is already gone, so the
parent is checked again after it: a rank whose launcher died while it was starting exits at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID = "PARATRAIN_LAUNCHER_PID"  # exported by `paratrain run`: its own pid
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def attach(env=os.environ) -> None:
    """Under `paratrain run`: die with the launcher."""
    launcher = _int_or_none(env.get(LAUNCHER_PID))
    if launcher is None:
        return
    if sys.platform.startswith("linux"):  # elsewhere a SIGKILLed launcher leaves its ranks running
        _die_with(launcher)


def _die_with(launcher: int) -> None:
    """Have Linux SIGKILL this rank when the launcher exits; exit now if it already has."""
    if os.getppid() != launcher:
        if _alive(launcher):
            return  # a rank's own child (a DataLoader worker, a subprocess): its rank watches
        _exit_now()  # the launcher died before this rank got here
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # 0 for a valid signal
    if os.getppid() != launcher:  # it died between the first check and the prctl
        _exit_now()


def _exit_now() -> None:
    os.kill(os.getpid(), signal.SIGKILL)  # as the death signal would have: no cleanup, no hang


def _alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, not yet reaped by its parent) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None
