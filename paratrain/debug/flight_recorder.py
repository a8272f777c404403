"""The collective flight recorder: every rank's last collectives and p2p operations, in a ring.

When a job hangs or the ranks fall out of step, a timeout says *that* a rank gave up, not *where*
each rank was. So every rank keeps its last N operations (PARATRAIN_FLIGHT_RECORDER=N, default
512; 0 turns it off), each with:

    seq         this rank's count of operations, over every group
    op          the torch.distributed function called ("all_reduce", "isend", ...)
    group       the global ranks of its process group; gseq counts this rank's operations on it,
                so ranks compare "#k on ranks 0-3" however many other groups they used
    tensors     (shape, dtype) of each tensor argument, and bytes: the largest (the message)
    site        the caller's file, line and function: the first frame outside paratrain, torch
                and the standard library, found by walking frames (sys._getframe), not by
                formatting a traceback: a few microseconds per call
    within      the collective call of the user's it was issued in ("session.checkpoint"; see
                `within`), or None
    label       what the library issued it for, where the call site alone does not say: the
                K, V blocks of context parallelism's ring attention, issued from the model's
                attention line (see `labelled`), or None
    state       started → completed, or failed (and the error); for async_op=True, completed
                or failed when its work's future says so (a callback: a future that holds an
                error is a failure, a timeout or a lost peer that DDP's or ZeRO's wait() will
                raise), or for a backend without futures (gloo's send/recv) when the work,
                weakly held, says so as the ring is written

The hooks that feed it are in debug/flight_hooks.py; launch/worker.py writes the ring to the launcher's notes
folder when a rank fails, exits or is stopped, and debug/hang_report.py turns the rings into the
report `paratrain run` prints. Importing this module does not import torch (launch/worker.py imports
it before torch loads), and the ring is written as JSON so the launcher reads it without torch.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import json
import os
import re
import sys
import sysconfig
import time
from typing import Callable, Iterator

DEFAULT_CAPACITY = 512  # entries; about 250 bytes each in memory
ENV = "PARATRAIN_FLIGHT_RECORDER"  # 0/off: no recorder; N: keep the last N operations

# frames under these are the library's, not the caller's ("<frozen runpy>" starts a script): the
# whole paratrain package, of which this file is paratrain/debug/flight_recorder.py
_NOT_USER = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep, sysconfig.get_paths()["stdlib"] + os.sep,
             "<frozen ")
_PAIR_CLOSED = "Application timeout caused pair closure"  # gloo's word for the others (Entry.failed)
_not_user_code: dict = {}  # code object -> bool: each file path is tested once


def capacity_from_env(env=os.environ) -> int:
    """Entries to keep: PARATRAIN_FLIGHT_RECORDER (0, off, false, no: none), else 512."""
    value = env.get(ENV, "").strip().lower()
    if value in ("", "on", "true", "yes"):
        return DEFAULT_CAPACITY
    if value in ("off", "false", "no"):
        return 0
    try:
        return max(0, int(value))
    except ValueError:
        return DEFAULT_CAPACITY  # a typo must not stop training; the default records


def skip_paths(*paths: str) -> None:
    """Treat frames under `paths` (torch's folder) as library frames too."""
    global _NOT_USER
    _NOT_USER = tuple(dict.fromkeys(_NOT_USER + tuple(p.rstrip(os.sep) + os.sep for p in paths)))
    _not_user_code.clear()


def call_site(depth: int = 2) -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame outside paratrain, torch and the standard
    library, starting `depth` frames up; None when there is none (a hook run by a C++ thread)."""
    frame = sys._getframe(depth)
    while frame is not None:
        code = frame.f_code
        library = _not_user_code.get(code)
        if library is None:
            library = _not_user_code[code] = code.co_filename.startswith(_NOT_USER)
        if not library:
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return None


class Entry:
    """One operation. Plain slots, filled in by the hooks: recording must stay cheap."""

    __slots__ = ("seq", "op", "group", "gseq", "tensors", "nbytes", "detail", "site", "within", "label", "state",
                 "error", "started", "ended", "works")

    def __init__(self, seq, op, group, gseq, tensors, nbytes, detail, site, within=None, label=None):
        self.seq, self.op, self.group, self.gseq = seq, op, group, gseq
        self.tensors, self.nbytes, self.detail, self.site, self.within = tensors, nbytes, detail, site, within
        self.label = label
        self.state, self.error, self.started, self.ended = "started", None, time.time(), None
        self.works: list | None = None  # weak references to async works that have no future

    def current_state(self) -> str:
        """The state, asking the works (weakly held) of a backend without futures (gloo's p2p):
        'released' when a handle was dropped before anyone saw it complete (usually after wait()).
        Whether such a work failed is not asked: torch deprecates Work.exception() and is_success()."""
        if self.state != "started" or not self.works:
            return self.state
        works = [ref() for ref in self.works]
        if any(w is None for w in works):
            return "released"
        return "completed" if all(w.is_completed() for w in works) else "started"

    def done(self) -> None:
        """Completed: a synchronous call returned, or every future of an async one succeeded."""
        self.state, self.ended = "completed", time.time()

    def settled(self, future) -> bool:
        """A done-callback's future: False, and failed, when it completed with an error (a timed-out
        or lost-peer collective waited on later, by DDP's or ZeRO's step); its error is then the
        entry's, not "completed"."""
        try:
            future.value()
        except Exception as error:  # what wait() raises on the calling thread: torch's RuntimeError
            self.failed(error)
            return False
        return True

    def failed(self, error: BaseException) -> None:
        """Raised: the error's first sentence, without gloo's source location ("[…/pair.cc:553]").
        When one operation on a gloo connection times out, gloo closes it and fails the others
        pending on it with "Application timeout caused pair closure"; which of them times out
        first is a race, so every one of them says it timed out."""
        lines = str(error).strip().splitlines()
        message = re.split(r"(?<=\.)\s", re.sub(r"^\[[^\]]+:\d+\]\s*", "", lines[0] if lines else ""))[0]
        if message.startswith(_PAIR_CLOSED):
            message = f"Timed out: gloo closed the connection when an operation on it timed out ({_PAIR_CLOSED})"
        text = f"{type(error).__name__}: {message}" if message else type(error).__name__
        self.state, self.ended, self.error = "failed", time.time(), text[:200]

    def as_dict(self) -> dict:
        file, line, function = self.site or (None, None, None)
        return dict(seq=self.seq, op=self.op, group=list(self.group), gseq=self.gseq,
                    tensors=[describe_tensor(*t) for t in self.tensors], bytes=self.nbytes,
                    detail=self.detail, file=file, line=line, function=function, within=self.within,
                    label=self.label,
                    state=self.current_state(),
                    error=self.error, started=self.started, ended=self.ended)


def describe_tensor(shape: tuple, dtype, count: int | None = None) -> str:
    """'float32[4, 8]'; a list of 2 of them: '2 x float32[4, 8]'."""
    text = f"{str(dtype).removeprefix('torch.')}{list(shape)}"
    return text if count is None else f"{count} x {text}"


class FlightRecorder:
    """This process's ring of operations, and the counters that number them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        self.capacity = capacity
        self.ring: collections.deque[Entry] = collections.deque(maxlen=max(capacity, 1))
        self.on_failure: Callable[[], None] | None = None  # launch/worker.py: write the ring to the notes
        self.within: str | None = None  # the collective call of the user's the operations are issued in
        self.label: str | None = None  # what the library issues them for (`labelled`)
        self.reset()

    def reset(self) -> None:
        """A new process group: numbering starts again (torch's sequence numbers do too)."""
        self.ring.clear()
        self._seq = itertools.count()
        self.issued: dict[tuple, int] = {}  # group ranks -> operations issued on it

    def start(self, op: str, group: tuple, tensors: list, nbytes: int, detail, site) -> Entry:
        gseq = self.issued.get(group, 0)
        self.issued[group] = gseq + 1
        entry = Entry(next(self._seq), op, group, gseq, tensors, nbytes, detail, site, self.within, self.label)
        self.ring.append(entry)
        return entry

    def failed(self, entry: Entry, error: BaseException) -> None:
        """The operation raised (a timeout, a lost peer): write the ring now, before anything
        else can go wrong."""
        entry.failed(error)
        if self.on_failure is not None:
            self.on_failure()

    def any_failed(self) -> bool:
        """Whether an operation in the ring failed: raised, or its future held an error."""
        return any(e.state == "failed" for e in list(self.ring))

    def snapshot(self, **about) -> dict:
        """What a dump holds: who wrote it, the counters, and the entries oldest first."""
        return dict(about, capacity=self.capacity, time=time.time(),
                    issued=[[list(g), n] for g, n in self.issued.items()],
                    entries=[e.as_dict() for e in list(self.ring)])


RECORDER = FlightRecorder(capacity_from_env())


def within(name: str):
    """Decorate a method that is a collective of the user's (Session.checkpoint: every rank must
    call it): the operations it issues are recorded as issued in `name` (the outermost such call:
    checkpoint's save is checkpoint's), so the report can say "rank 0 called session.checkpoint
    alone" where the ranks part (debug/hang_report.py)."""
    def decorate(method):
        @functools.wraps(method)
        def recorded(*args, **kwargs):
            outer = RECORDER.within
            RECORDER.within = outer or name
            try:
                return method(*args, **kwargs)
            finally:
                RECORDER.within = outer

        return recorded

    return decorate


@contextlib.contextmanager
def labelled(label: str) -> Iterator[None]:
    """Record the operations issued in the block as issued for `label` ("ring attention (cp): K, V"):
    the report then says what a rank was doing at the user's line, which is the model's own
    attention call for the collectives context parallelism issues inside it."""
    outer = RECORDER.label
    RECORDER.label = label
    try:
        yield
    finally:
        RECORDER.label = outer


def dump(path: str, **about) -> None:
    """Write the ring as JSON to `path` (atomically: the launcher never reads half of it);
    nothing when the recorder is off."""
    if not RECORDER.capacity:
        return
    try:
        snapshot = RECORDER.snapshot(pid=os.getpid(), **about)
        with open(path + ".tmp", "w") as f:
            json.dump(snapshot, f)
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError, ValueError):
        pass  # the notes folder is gone, or the ring changed under a signal: nobody can read it


def read(path: str) -> dict | None:
    """A dump, or None when it is missing or cut short."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
