"""What a rank started by `paratrain run` does for its launcher: die with it, and leave a note.

`attach()` runs first thing in each rank `paratrain run` starts (launch/rank.py), and does nothing
in any process that `paratrain run` did not start itself (plain python, torchrun, srun, a rank's
own children).

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

[Note: last words]
A rank that waits in a collective for another gives up first (a timeout, or "connection closed
by peer" when the other has exited), so the agent's "first failure" is often the victim. Each
rank therefore writes a note into PARATRAIN_REPORT_DIR, named by its pid: how it ended ("exit",
"exception", or "collective" for an exception raised by torch.distributed after a timeout or a
lost peer) and when. When the launcher stops it with SIGTERM, faulthandler writes where it was
(`<pid>.stack`). paratrain/debug/postmortem.py reads them to name the rank at fault. A rank whose
error another rank's fault can raise too (a NaN gradient averaged in from a rank whose loss was
NaN) notes that (`echo`) and leaves only once the other ranks have noted theirs: exiting first, it
would have the launcher stop the rank at fault before that rank's note named the cause.

Each rank also writes its flight recorder's ring (`<pid>.ring`, debug/flight_recorder.py): when a
collective fails, on an uncaught exception, at exit, and on SIGTERM. The last is the hard one: a
rank blocked inside a collective is in C++, and Python runs a signal handler only when the main
thread comes back to Python, after the collective's timeout, long after the launcher has given up
and sent SIGKILL. So SIGTERM also wakes a thread (through `signal.set_wakeup_fd`, which the
interpreter's C-level handler writes to at once), and that thread writes the ring while the main
thread waits in C++ without the GIL, then ends the process by SIGTERM as before. When another
handler has taken SIGTERM since (Session(checkpoint_on_preempt=...)), the thread leaves it alone;
code that installs a wakeup fd of its own (an asyncio loop, while it runs) leaves only the
main-thread path.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import functools
import glob
import json
import os
import re
import signal
import sys
import threading
import time

from paratrain.debug import flight_recorder

LAUNCHER_PID = "PARATRAIN_LAUNCHER_PID"  # exported by `paratrain run`: its own pid
REPORT_DIR = "PARATRAIN_REPORT_DIR"  # exported by `paratrain run`: where ranks leave their notes
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# What torch.distributed (gloo, the TCPStore) says when a peer never answers or is gone
_PEER_LOST = re.compile(r"timed out|timeout|closed by peer|reset by peer|broken pipe|connection refused",
                        re.IGNORECASE)
# gloo's errors start with their C++ source: "[/…/third_party/gloo/gloo/transport/tcp/pair.cc:553] …"
_GLOO_SOURCE = re.compile(r"\[[^\]]*/gloo/[^\]]*:\d+\]")


def attach(env=os.environ) -> None:
    """Under `paratrain run`: die with the launcher, and leave a note for its failure summary."""
    launcher = _int_or_none(env.get(LAUNCHER_PID))
    if launcher is None:
        return
    if sys.platform.startswith("linux"):  # elsewhere a SIGKILLed launcher leaves its ranks running
        _die_with(launcher)
    if os.getppid() == launcher and env.get(REPORT_DIR):  # not in a rank's own children
        _leave_notes(env[REPORT_DIR], env, rank=int(env.get("RANK", 0)),
                     attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


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


def _leave_notes(directory: str, env, *, rank: int, attempt: int) -> None:
    """Write `<pid>.json` now, on an uncaught exception and at exit; `<pid>.stack` on SIGTERM."""
    pid = os.getpid()
    path = os.path.join(directory, f"{pid}.json")
    note = dict(rank=rank, attempt=attempt, pid=pid, kind="running", time=time.time())
    _write(path, note)
    ring = functools.partial(flight_recorder.dump, os.path.join(directory, f"{pid}.ring"),
                             rank=rank, attempt=attempt, world=_int_or_none(env.get("WORLD_SIZE")))
    flight_recorder.RECORDER.on_failure = ring
    if flight_recorder.RECORDER.capacity:  # off: SIGTERM ends the rank as it always did
        _dump_ring_on_sigterm(ring)  # first: faulthandler, registered next, chains to it
    _dump_stack_on_sigterm(os.path.join(directory, f"{pid}.stack"))
    previous = sys.excepthook

    def excepthook(exc_type, value, tb):
        if os.getpid() == pid:  # not a forked child, which inherits the hook
            kind = _exception_kind(value, tb)
            echo = bool(getattr(value, "may_echo_another_rank", False))
            note.update(kind=kind, error=_describe_exception(value, brief=kind == "collective"),
                        echo=echo, time=time.time())
            _write(path, note)
            ring()
            if echo:
                _let_the_others_speak(directory, note)
        previous(exc_type, value, tb)

    def at_exit():
        if os.getpid() == pid:
            if note["kind"] == "running":
                note.update(kind="exit", time=time.time())
            _write(path, note)
            ring()

    sys.excepthook = excepthook
    atexit.register(at_exit)
    _ends.append(at_exit)


_ends: list = []  # the note's exit, once attached: script_ended() writes it
ECHO_WAIT = 3.0  # seconds an echoing rank waits for the others' notes before it exits


def _let_the_others_speak(directory: str, mine: dict) -> None:
    """Wait (at most ECHO_WAIT s) until every other rank of this node has left its note, or its
    note says it is no longer running. An error that another rank's fault can raise here too (a
    NaN gradient averaged in from a rank whose loss was NaN) must not exit first: the launcher
    would stop the rank at fault before it noted its own error, and the summary would blame the
    echo. Both ranks raise at the same step, so the wait is a few milliseconds."""
    deadline = time.monotonic() + ECHO_WAIT
    local_world = _int_or_none(os.environ.get("LOCAL_WORLD_SIZE")) or 1
    while time.monotonic() < deadline:
        notes = [n for n in map(_read_note, glob.glob(os.path.join(directory, "*.json")))
                 if n and n.get("attempt") == mine["attempt"] and n.get("pid") != mine["pid"]]
        if len(notes) >= local_world - 1 and all(n.get("kind") != "running" for n in notes):
            return
        time.sleep(0.02)


def _read_note(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def script_ended() -> None:
    """The script ran to its end (or called sys.exit): note it now, before the interpreter's exit
    handlers run, so that a crash in one of them (a library's teardown) is not taken for a rank
    that failed in its script (launch/rank.py calls this; at exit it is noted again)."""
    for end in _ends:
        end()


def note_preempted(checkpoint: str | None, env=os.environ, error: str | None = None) -> None:
    """Tell `paratrain run` that this rank checkpointed on preemption and leaves with status 0
    (`<pid>.preempted`): when every rank on the node did, the launcher exits 0 too, not 128+signal.
    `error`: the checkpoint failed (a full disk), and why; the launcher says so."""
    if env.get(REPORT_DIR) and os.getppid() == _int_or_none(env.get(LAUNCHER_PID)):
        _write(os.path.join(env[REPORT_DIR], f"{os.getpid()}.preempted"),
               dict(rank=int(env.get("RANK", 0)), checkpoint=checkpoint, error=error))


def preempted_ranks(directory: str) -> tuple[dict[int, str], dict[int, str]]:
    """The ranks that left a `note_preempted` in `directory`: those that checkpointed, with the
    checkpoint each wrote, and those whose checkpoint failed, with why."""
    saved, failed = {}, {}
    for name in os.listdir(directory):
        if name.endswith(".preempted"):
            try:
                with open(os.path.join(directory, name)) as f:
                    note = json.load(f)
                if note.get("error"):
                    failed[note["rank"]] = note["error"]
                else:
                    saved[note["rank"]] = note["checkpoint"]
            except (OSError, ValueError, KeyError):
                pass  # a half-written note is no note
    return saved, failed


def _dump_ring_on_sigterm(dump) -> None:
    """On SIGTERM, `dump()` the flight recorder's ring, then die of SIGTERM ([Note: last words])."""
    if not hasattr(signal, "set_wakeup_fd") or threading.current_thread() is not threading.main_thread():
        return
    pid, once = os.getpid(), threading.Lock()

    def last_words(signum=signal.SIGTERM, frame=None) -> None:
        if os.getpid() == pid and once.acquire(blocking=False):
            dump()
            _die_of(signal.SIGTERM)

    readable, writable = os.pipe()
    os.set_blocking(writable, False)  # set_wakeup_fd's requirement

    def watch() -> None:
        while True:
            signums = os.read(readable, 64)
            if signal.SIGTERM in signums and signal.getsignal(signal.SIGTERM) is last_words:
                last_words()

    signal.signal(signal.SIGTERM, last_words)  # the main thread's way, when it is in Python
    signal.set_wakeup_fd(writable, warn_on_full_buffer=False)
    threading.Thread(target=watch, name="paratrain-last-words", daemon=True).start()
    # a forked child (a DataLoader worker) shares the pipe: its own SIGTERM must not end the rank
    os.register_at_fork(after_in_child=_forget_sigterm)


def _forget_sigterm() -> None:
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # forked from another thread: it cannot change handlers, nor get our SIGTERM's dump
        pass


def _die_of(signum: int) -> None:
    """End this process by `signum`'s default action, from any thread (Python's signal.signal
    is for the main thread only; libc's is not)."""
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(int(signum), ctypes.c_void_p(0))  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(5)
    os.kill(os.getpid(), signal.SIGKILL)  # never reached: the signal has ended the process


def _dump_stack_on_sigterm(path: str) -> None:
    """Where every thread is when the launcher stops this rank; faulthandler writes it from the
    signal handler, so it works while the main thread is blocked inside a collective."""
    if not hasattr(faulthandler, "register"):
        return  # Windows
    # chain=True: after the dump the previous handler runs (_dump_ring_on_sigterm's, or the default)
    faulthandler.register(signal.SIGTERM, file=open(path, "w"), all_threads=True, chain=True)
    # a forked child (a DataLoader worker) shares the rank's process group, so it gets the
    # launcher's SIGTERM too: it must not write into the rank's file
    os.register_at_fork(after_in_child=lambda: faulthandler.unregister(signal.SIGTERM))


def _exception_kind(value: BaseException, tb) -> str:
    """'collective' when torch.distributed raised it about a peer that never answered or is gone:
    also from a work's wait() in paratrain's own code (DDP's buckets, ZeRO's gathers), where no
    frame is torch's: gloo names itself in the message's source location, or (its later works:
    "Application timeout caused pair closure") the flight recorder saw a work fail."""
    in_dist = type(value).__module__.startswith("torch.distributed")  # DistStoreError, DistBackendError
    in_dist = in_dist or _GLOO_SOURCE.match(str(value)) is not None or flight_recorder.RECORDER.any_failed()
    while tb is not None and not in_dist:
        in_dist = f"{os.sep}torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename
        tb = tb.tb_next
    return "collective" if in_dist and _PEER_LOST.search(str(value)) else "exception"


def _describe_exception(value: BaseException, *, brief: bool = False) -> str:
    """'Type: first line of the message', at most 200 characters. `brief` keeps the first sentence
    only, without gloo's source location: "[…/pair.cc:553] Connection closed by peer [addr]:port.
    This is typically caused by …" becomes "Connection closed by peer [addr]:port."."""
    lines = str(value).strip().splitlines()
    message = lines[0] if lines else ""
    if brief:
        message = re.split(r"(?<=\.)\s", re.sub(r"^\[[^\]]+:\d+\]\s*", "", message))[0]
    text = f"{type(value).__name__}: {message}" if message else type(value).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _write(path: str, note: dict) -> None:
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(note, f)
        os.replace(path + ".tmp", path)  # the launcher never reads half a note
    except OSError:
        pass  # the launcher removed the folder: nobody is left to read it


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None
