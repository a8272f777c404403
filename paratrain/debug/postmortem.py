"""After a failed job, name the rank at fault and why, from what the ranks left behind.

torch's elastic agent reports the ranks that failed with their exit codes (ChildFailedError)
and takes the earliest as the cause. That blames the victim whenever a rank waits in a
collective for another that is elsewhere: the waiting rank gives up first (a timeout, or
"connection closed by peer" when the other has exited), and the agent then stops the rest.
So every rank leaves a note (paratrain/launch/worker.py, [Note: last words]): how it ended, and where
it was when the launcher stopped it. The blame goes, in this order, to

1. a rank that failed on its own: an exception that is not a collective's, or a crash (one whose
   error another rank's can cause, a NaN gradient where another rank's loss was NaN, comes last);
2. a rank that exited cleanly (exit code 0) while the others still ran: they failed waiting.
   A rank that ran its script to the end and then crashed as the process exited (gloo can abort
   in teardown while a peer still waits on it) counts here too, not as a failure of its own;
3. a rank the launcher stopped outside any collective while another gave up waiting in one
   (a rank whose note says it was already failing, an exception or a collective given up, is
   not "stopped" though the launcher's SIGTERM reached it first: its status is then 1, as its
   exception would have left it);
4. failing all of these, the agent's first failure, with what every rank was waiting in.

One failure is no failure of the job: every rank ran its script to the end (its exit handlers
ran: launch/worker.py's note says "exit"), and a rank was then killed by a signal as its process exited
(gloo or the interpreter's teardown aborting, seen in CI about once in some hundred jobs), or was
stopped by the launcher after that. Every rank's work is done, so `paratrain run` says so in one
line and exits 0. A rank whose script called sys.exit(n) with n != 0 and then crashed so is
reported as finished too: its note cannot tell the status it was leaving with.

Then, from the rings the ranks' flight recorders left (debug/hang_report.py): where each rank was in
its collectives, which ranks are behind, and the user's line where their histories first differ.
Where they part inside a collective call of the user's that only some ranks made (session.checkpoint
on rank 0 alone), that call leads the summary, unless a rank failed by an exception of its own.

The notes cover this node's ranks only; with several nodes the rank at fault may be on another.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import sys
import sysconfig
import time
from dataclasses import dataclass

import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from paratrain.debug import hang_report
from paratrain.launch import stopped

# frames under these are not the user's: torch, paratrain, the standard library, installed packages
_LIBRARIES = tuple({os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep,
                    *(sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "purelib", "platlib")), "<"})
_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<func>.+)$')


FAILING = ("exception", "collective")  # a note's kinds for a rank that was failing on its own


@dataclass(frozen=True)
class RankEnd:
    """How one rank of this node ended."""

    rank: int
    exitcode: int  # 0 for a rank the agent did not list as failed
    pid: int | None
    note: dict  # launch/worker.py's note ({} when the rank left none)
    stack: str  # faulthandler's dump when it was stopped by SIGTERM, else ""
    frozen: bool = False  # its process was stopped (SIGSTOP) when the launcher ended it (launch/stopped.py)

    @property
    def kind(self) -> str:
        return self.note.get("kind", "")


def report(error: ChildFailedError, notes_dir: str) -> int:
    """Print the summary on stderr; return the exit status of the failed rank it names."""
    first_rank, _ = error.get_first_failure()
    ends = read_ends(error, notes_dir)
    if finished_everywhere(ends):
        print(f"paratrain run: {_teardown_line(ends)}", file=sys.stderr)
        return 0
    lines, status = summarize(ends, first_rank)
    try:
        rings = hang_report.read_rings(notes_dir, {r: e.pid for r, e in ends.items()})
        # a collective call made on some ranks only (session.checkpoint) is the cause, unless a
        # rank failed on its own; a rank that was not running at all comes before either
        if (lead := hang_report.alone(rings)) and not any(_own_error(e) for e in ends.values()):
            lines.insert(0, lead)
        if frozen := [e for e in ends.values() if e.frozen]:
            lines.insert(0, _frozen_line(frozen, [e for e in ends.values() if not e.frozen], rings))
        lines += hang_report.describe(rings)
    except (KeyError, TypeError, ValueError, IndexError) as e:  # a ring of another version: the rest stands
        lines.append(f"the ranks' flight recorder rings could not be read ({type(e).__name__}: {e})")
    print("\n".join(f"paratrain run: {line}" for line in lines), file=sys.stderr)
    return _status(status)


def _frozen_line(frozen: list[RankEnd], others: list[RankEnd], rings: dict[int, dict]) -> str:
    """'rank 1 is not running (stopped); rank 0 waited in all_reduce at train.py:69'."""
    waits = []
    for e in others:
        if where := hang_report.waited_in(rings.get(e.rank)):
            waits.append(f"rank {e.rank} waited in {where}")
        elif e.kind == "collective":
            waits.append(f"rank {e.rank} gave up waiting in a collective")
    verb = "is" if len(frozen) == 1 else "are"
    them = "it" if len(frozen) == 1 else "them"
    return (f"{_ranks(frozen)} {verb} not running (stopped)" + (f"; {'; '.join(waits)}" if waits else "")
            + f". A stopped process (SIGSTOP, Ctrl-Z, a debugger) runs nothing until it is continued: "
              f"the launcher continued {them} to end the job; look for what stopped {them}")


def _own_error(end: RankEnd) -> bool:
    """The rank raised an exception of its own, not a collective's, nor one that may echo another's."""
    return end.kind == "exception" and not end.note.get("echo")


def read_ends(error: ChildFailedError, notes_dir: str) -> dict[int, RankEnd]:
    """The failed ranks, matched to their notes by pid, and the ranks of the same attempt that
    exited with 0 (the agent does not list those), or that the launcher stopped, unlisted by torch
    2.9's agent."""
    notes = {}
    for path in glob.glob(os.path.join(notes_dir, "*.json")):
        try:
            with open(path) as f:
                note = json.load(f)
            notes[note["pid"]] = note
        except (OSError, ValueError, KeyError):
            continue  # a note cut short: that rank is judged by its exit code alone
    ends = {r: RankEnd(r, f.exitcode, f.pid, notes.get(f.pid, {}), _read(notes_dir, f.pid),
                       stopped.was_stopped(notes_dir, f.pid)) for r, f in error.failures.items()}
    attempt = max((e.note["attempt"] for e in ends.values() if e.note), default=None)
    for note in notes.values():
        if note["attempt"] == attempt and note["rank"] not in ends:
            # torch 2.9's agent does not list the ranks it stopped either: a stack (written only on
            # SIGTERM) says this one was stopped, and its end is the signal's, as 2.13's agent says
            stack = _read(notes_dir, note["pid"])
            ends[note["rank"]] = RankEnd(note["rank"], -signal.SIGTERM if stack else 0, note["pid"], note, stack,
                                         stopped.was_stopped(notes_dir, note["pid"]))
    return dict(sorted(ends.items()))


def finished_everywhere(ends: dict[int, RankEnd]) -> bool:
    """Every rank ran its script to the end, and those that failed were killed by a signal after
    that (in teardown, or by the launcher stopping the rest): the job's work is done."""
    return all(e.kind == "exit" for e in ends.values()) and all(e.exitcode <= 0 for e in ends.values())


def _teardown_line(ends: dict[int, RankEnd]) -> str:
    failed = [e for e in ends.values() if e.exitcode < 0]
    crashed = [e for e in failed if not _stopped(e)] or failed
    line = (f"every rank ran its script to the end; then {', '.join(f'rank {e.rank} was {_exit(e.exitcode)}' for e in crashed)}"
            " as the process exited (after the script's last line and its exit handlers: torch's or the "
            "interpreter's teardown)")
    if stopped := [e for e in failed if e not in crashed]:
        line += f", and the launcher stopped {_ranks(stopped)}"
    return line + ". The job's work is done: exit status 0"


def summarize(ends: dict[int, RankEnd], first_rank: int) -> tuple[list[str], int]:
    """The summary's lines, and the exit code of the failed rank they name first."""
    failed = [e for e in ends.values() if e.exitcode != 0]
    # a rank whose note says it was already failing (an exception, or giving up in a collective)
    # failed on its own, though the launcher's SIGTERM reached it before its exit did
    stopped = [e for e in failed if e.rank != first_rank and _stopped(e) and e.kind not in FAILING]
    waited = _by_time([e for e in failed if e.kind == "collective" and e not in stopped], first_rank)
    finished = [e for e in failed if e.kind == "exit" and e not in stopped]  # crashed in teardown
    alone = [e for e in failed if e not in stopped + waited + finished]  # failed on their own
    waiting = [e for e in stopped if _collective(e.stack)]  # stopped while waiting in a collective
    if finished and waiting and not waited and not alone:  # waiting for the ranks that finished early
        return [_left_line(finished, waiting)] + [f"rank {e.rank} was waiting in {_collective(e.stack)} when "
                                                  "the launcher stopped it" for e in waiting], 1
    own = _by_time(alone, first_rank) or ([] if waited else _by_time(finished, first_rank))
    left = []
    if own:
        named, lines = own[0], [_failed(own[0])]
    elif left := _left_early(ends, waited):
        named, lines = waited[0], [_left_line(left, [e for e in failed if e not in left]), _failed(waited[0])]
    elif stragglers := [e for e in stopped if not _collective(e.stack)]:
        named, lines = waited[0], [_straggler_line(stragglers, waited[0]), _failed(waited[0])]
    else:  # the agent's first failure is in `own` or `waited`: here, waited[0]
        named, lines = waited[0], [_failed(waited[0]), _waiting_everywhere(stopped)]
    pool = own + waited + [e for e in finished if e not in own]
    if others := [e for e in pool if e is not named and e not in left]:
        lines.append("also failed: " + ", ".join(_also(e, named) for e in others))
    if stopped:
        lines.append("then stopped by the launcher: " + ", ".join(f"rank {e.rank}" for e in stopped))
    # killed while leaving with an exception: the status its exception would have given
    return lines, 1 if named.kind in FAILING and named.exitcode < 0 else named.exitcode


def _by_time(ends: list[RankEnd], first_rank: int) -> list[RankEnd]:
    """The agent's first failure first, then by when each rank failed (its note's time); an error
    that another rank's fault can raise (its note's echo: a NaN gradient averaged in from a rank
    whose loss was NaN, errors.ParatrainError.may_echo_another_rank) after every other."""
    return sorted(ends, key=lambda e: (bool(e.note.get("echo")), e.rank != first_rank, e.note.get("time", 0)))


def _failed(end: RankEnd) -> str:
    what = "gave up waiting in a collective" if end.kind == "collective" else "failed"
    pid = f", pid {end.pid}" if end.pid else ""
    error = f": {end.note['error']}" if end.note.get("error") else ""
    return f"rank {end.rank} {what} ({_exit(end.exitcode)}{pid}){error}; see its output above"


def _also(end: RankEnd, named: RankEnd) -> str:
    """Another rank that failed, by its own exception where it raised one: a rank that raised
    and was then killed as it exited (the launcher's SIGTERM reaching its teardown; seen as
    SIGSEGV) failed by its exception, not by the signal."""
    error = end.note.get("error") if end.kind == "exception" else None
    if not error:
        return f"rank {end.rank} ({_exit(end.exitcode)})"
    what = f"the same {error.split(':', 1)[0]}" if error == named.note.get("error") else error
    how = f"then {_exit(end.exitcode)} as it exited" if end.exitcode < 0 else _exit(end.exitcode)
    return f"rank {end.rank} with {what} ({how})"


def _left_early(ends: dict[int, RankEnd], waited: list[RankEnd]) -> list[RankEnd]:
    """Ranks that exited with 0, or ran to the end of their script and crashed in teardown, before
    any rank gave up waiting (a clean exit leaves no time only after os._exit: it counts too)."""
    if not waited:
        return []
    gave_up = min(e.note.get("time", float("inf")) for e in waited)
    return [e for e in ends.values() if (e.exitcode == 0 or e.kind == "exit") and e.note.get("time", 0) <= gave_up]


def _left_line(left: list[RankEnd], running: list[RankEnd]) -> str:
    when = min((e.note["time"] for e in left if e.kind == "exit"), default=None)
    at = f" at {time.strftime('%H:%M:%S', time.localtime(when))}" if when else ""
    verb = "was" if len(running) == 1 else "were"
    how = "exited cleanly (exit code 0)"
    if crashed := [e for e in left if e.exitcode != 0]:
        whom = [("" if len(left) == 1 else f"rank {e.rank} ") + f"was {_exit(e.exitcode)}" for e in crashed]
        how = f"ran to the end of the script (then {', '.join(whom)} as the process exited)"
    return (f"{_ranks(left)} {how}{at} while {_ranks(running)} {verb} still "
            f"training; the others then failed waiting for {'it' if len(left) == 1 else 'them'}")


def _straggler_line(stragglers: list[RankEnd], waiter: RankEnd) -> str:
    line = f"{_ranks(stragglers)} never reached the collective that rank {waiter.rank} was waiting in"
    where = [f"rank {e.rank} was at {_where(e.stack)}" for e in stragglers if _where(e.stack)]
    them = "it" if len(stragglers) == 1 else "them"
    return f"{line}: when the launcher stopped {them}, {'; '.join(where)}" if where else f"{line}"


def _waiting_everywhere(stopped: list[RankEnd]) -> str:
    inside = ", ".join(f"rank {e.rank} in {_collective(e.stack)}" for e in stopped)
    return ("every rank on this node was waiting in a collective" + (f" ({inside})" if inside else "")
            + ": the rank they waited for is on another node, or the ranks called different "
              "collectives (`paratrain run --debug-collectives` names the first that differs)")


def _stopped(end: RankEnd) -> bool:
    return bool(end.stack) or -end.exitcode in (signal.SIGTERM, signal.SIGKILL)


def _frames(stack: str) -> list[re.Match]:
    """The main thread's frames, innermost first (faulthandler lists it last)."""
    main = stack.strip().split("\n\n")[-1] if stack.strip() else ""
    return [m for m in map(_FRAME.match, main.splitlines()) if m]


def _collective(stack: str) -> str | None:
    """The torch.distributed function the stack is inside, if any."""
    for m in _frames(stack):
        if f"{os.sep}torch{os.sep}distributed{os.sep}" in m["file"]:
            return m["func"]
    return None


def _where(stack: str) -> str | None:
    """'train.py:12 (in step)': the innermost frame of the user's code."""
    for m in _frames(stack):
        if not m["file"].startswith(_LIBRARIES):
            path = os.path.relpath(m["file"])
            path = m["file"] if path.startswith("..") else path
            return f"{path}:{m['line']} (in {m['func']})"
    return None


def _ranks(ends: list[RankEnd]) -> str:
    ranks = ", ".join(str(e.rank) for e in ends)
    return f"rank {ranks}" if len(ends) == 1 else f"ranks {ranks}"


def _exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def _status(exitcode: int) -> int:
    if exitcode < 0:
        return 128 - exitcode  # the shell's convention for "killed by signal N"
    return exitcode if 0 < exitcode < 256 else 1


def _read(notes_dir: str, pid: int) -> str:
    try:
        with open(os.path.join(notes_dir, f"{pid}.stack")) as f:
            return f.read()
    except OSError:
        return ""
