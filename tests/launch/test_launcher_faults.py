"""`paratrain run` when things go wrong around the ranks: a SIGKILLed
launcher takes its workers with it, the failure summary names the rank at fault rather than the
one that gave up waiting for it, and a master port in use is reported as such."""

from __future__ import annotations

import json
import os
import signal
import socket
import textwrap
import time

import pytest
import torch

from paratrain.debug import postmortem
from paratrain.launch import worker
from tests.support.launcher import paratrain, running, start, wait_for

# Writes its pid, then (second argument "gate") waits for a file before importing paratrain, so
# that a test can kill the launcher before the worker has asked to die with it.
SLEEPER = textwrap.dedent("""
    import os, sys, time
    out, gate = sys.argv[1], sys.argv[2]
    rank = os.environ["RANK"]
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    while gate == "gate" and not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)
    import paratrain
    open(os.path.join(out, f"armed{rank}"), "w").close()
    time.sleep(120)
""")

# Two ranks train in lock step; the mode picks the rank that goes wrong and how.
STEPS = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    import paratrain as pt

    topo = pt.Topology.from_env().init()
    for step in range(40):
        if sys.argv[1] == "rank0-sleeps" and topo.rank == 0 and step == 2:
            time.sleep(60)  # STRAGGLER: rank 1 waits for it in the all_reduce below
        if sys.argv[1] == "rank1-exits" and topo.rank == 1 and step == 2:
            sys.exit(0)
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)
""")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="PR_SET_PDEATHSIG and /proc are Linux's")
@pytest.mark.parametrize("when", ["running", "starting"])
def test_workers_die_when_the_launcher_is_sigkilled(tmp_path, monkeypatch, when):
    """'running': the workers had imported paratrain; 'starting': the launcher died first, and
    each worker finds it gone when it imports paratrain (the race that PR_SET_PDEATHSIG misses)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the killed launcher leaves its notes folder
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    out = tmp_path / "out"
    out.mkdir()
    launcher = start("run", "-n", "2", "sleeper.py", str(out), "gate" if when == "starting" else "-",
                     cwd=tmp_path)
    pids = []
    try:
        wait_for([out / "pid0", out / "pid1"])
        pids = [int((out / f"pid{r}").read_text()) for r in range(2)]
        if when == "running":
            wait_for([out / "armed0", out / "armed1"])
        os.kill(launcher.pid, signal.SIGKILL)  # what the OOM killer does
        launcher.wait(10)
        if when == "starting":
            while any(running(p) and _parent(p) == launcher.pid for p in pids):
                time.sleep(0.05)  # re-parented: the launcher is gone before they import paratrain
            (out / "go").touch()
        deadline = time.monotonic() + 10
        while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, f"workers {alive} outlived their SIGKILLed launcher by 10 s"
    finally:
        for pid in [p for p in pids if running(p)]:
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()


@pytest.fixture
def steps(tmp_path, monkeypatch):
    monkeypatch.delenv("PARATRAIN_DEBUG_COLLECTIVES", raising=False)  # it changes torch's messages
    (tmp_path / "steps.py").write_text(STEPS)
    return tmp_path


def test_summary_blames_the_rank_that_never_reached_the_collective(steps):
    proc = paratrain("run", "-n", "2", "--timeout", "3", "steps.py", "rank0-sleeps", cwd=steps)
    summary = [line for line in proc.stderr.splitlines() if line.startswith("paratrain run:")]
    line = STEPS.splitlines().index(next(s for s in STEPS.splitlines() if "STRAGGLER" in s)) + 1
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert summary[0] == ("paratrain run: rank 0 never reached the collective that rank 1 was waiting "
                          f"in: when the launcher stopped it, rank 0 was at steps.py:{line} (in <module>)")
    assert summary[1].startswith("paratrain run: rank 1 gave up waiting in a collective (exit code 1")
    assert "Timed out" in summary[1]


def test_summary_names_a_rank_that_exited_cleanly_while_others_trained(steps):
    proc = paratrain("run", "-n", "2", "--timeout", "5", "steps.py", "rank1-exits", cwd=steps)
    summary = [line for line in proc.stderr.splitlines() if line.startswith("paratrain run:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert summary[0].startswith("paratrain run: rank 1 exited cleanly (exit code 0) at "), summary
    assert summary[0].endswith(" while rank 0 was still training; the others then failed waiting for it")
    assert summary[1].startswith("paratrain run: rank 0 gave up waiting in a collective (exit code 1")


def test_master_port_in_use_is_reported_as_such(tmp_path):
    (tmp_path / "hello.py").write_text("print('hello')\n")
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = paratrain("run", "-n", "1", "--master-port", str(port), "hello.py", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.endswith(
        f"paratrain run: port {port} on 127.0.0.1 is already in use; pass another --master-port "
        "(or leave it out on a single node, which picks a free port)\n"), proc.stderr[-3000:]
    assert "hello" not in proc.stdout and "could not meet" not in proc.stderr


def _end(rank, exitcode, kind, stack="", t=0.0, error=""):
    return postmortem.RankEnd(rank, exitcode, 100 + rank, dict(kind=kind, time=t, error=error), stack)


IN_ALL_REDUCE = textwrap.dedent("""\
    Current thread 0x1 (most recent call first):
      File "/x/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
      File "/home/me/train.py", line 9 in <module>
""").replace("/x/site-packages/torch/", os.path.dirname(torch.__file__) + "/")


def test_a_stopped_rank_the_agent_does_not_list_is_read_as_stopped(tmp_path):
    """torch 2.9's agent lists only the rank that failed, not those it then stopped: a rank whose
    note is there without a failure is stopped (its SIGTERM stack was written), or exited with 0."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    for rank, pid, kind in ((0, 100, "running"), (1, 101, "collective"), (2, 102, "exit")):
        (tmp_path / f"{pid}.json").write_text(json.dumps(dict(rank=rank, attempt=0, pid=pid, kind=kind, time=1.0)))
        (tmp_path / f"{pid}.stack").write_text(IN_SLEEP if rank == 0 else "")  # made at start, written on SIGTERM
    failed = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(tmp_path / "none.json"))
    ends = postmortem.read_ends(ChildFailedError("steps.py", {1: failed}), str(tmp_path))
    assert [(e.rank, e.exitcode, bool(e.stack)) for e in ends.values()] == [(0, -signal.SIGTERM, True), (1, 1, False),
                                                                            (2, 0, False)]
    assert postmortem._stopped(ends[0]) and not postmortem._stopped(ends[2])


IN_SLEEP = textwrap.dedent("""\
    Current thread 0x1 (most recent call first):
      File "/home/me/steps.py", line 9 in <module>
""")


def test_a_rank_own_exception_is_blamed_before_a_clean_exit():
    """Rank 2 finished early, but rank 1's own ValueError came first in the blame order."""
    ends = {0: _end(0, 1, "collective", t=3.0), 1: _end(1, 1, "exception", t=4.0, error="ValueError: x"),
            2: _end(2, 0, "exit", t=1.0)}
    lines, status = postmortem.summarize(ends, first_rank=0)
    assert lines == ["rank 1 failed (exit code 1, pid 101): ValueError: x; see its output above",
                     "also failed: rank 0 (exit code 1)"]
    assert status == 1


def test_every_rank_that_raised_is_named_by_its_exception_not_by_the_signal_that_ended_it():
    """Both ranks raised the same ConfigError in setup; rank 1 was then killed as it exited (the
    launcher's SIGTERM reaching its teardown, seen as SIGSEGV): it failed by its exception."""
    error = "ConfigError: zero3 shards the optimizer: pass it to setup(model, optimizer, …)"
    ends = {0: _end(0, 1, "exception", t=1.0, error=error), 1: _end(1, -signal.SIGSEGV, "exception", t=1.0, error=error)}
    lines, status = postmortem.summarize(ends, first_rank=0)
    assert lines == [f"rank 0 failed (exit code 1, pid 100): {error}; see its output above",
                     "also failed: rank 1 with the same ConfigError (then killed by SIGSEGV as it exited)"]
    assert status == 1
    ends[1] = _end(1, 1, "exception", t=1.0, error="ValueError: y")
    assert postmortem.summarize(ends, first_rank=0)[0][1] == "also failed: rank 1 with ValueError: y (exit code 1)"


def test_ranks_waiting_in_collectives_everywhere_are_not_called_stragglers():
    """Rank 1 was stopped inside another collective: the ranks disagree, or the culprit is on
    another node; neither rank is named as the one that never came."""
    ends = {0: _end(0, 1, "collective", t=3.0), 1: _end(1, -signal.SIGTERM, "running", IN_ALL_REDUCE)}
    lines, _ = postmortem.summarize(ends, first_rank=0)
    assert lines[0].startswith("rank 0 gave up waiting in a collective (exit code 1, pid 100)")
    assert lines[1].startswith("every rank on this node was waiting in a collective (rank 1 in all_reduce)")
    assert "--debug-collectives" in lines[1] and "never reached" not in " ".join(lines)


def test_a_rank_that_crashed_in_teardown_after_its_script_ended_is_not_blamed():
    """Rank 1 ran its script to the end while rank 0 still waited on it, then gloo aborted as its
    process exited (seen in CI: SIGABRT, "terminate called without an active exception"). The
    fault is the early exit, and the job's status is rank 0's, not 128 + SIGABRT."""
    ends = {0: _end(0, 1, "collective", t=3.0), 1: _end(1, -signal.SIGABRT, "exit", t=1.0)}
    lines, status = postmortem.summarize(ends, first_rank=1)
    assert lines[0].startswith("rank 1 ran to the end of the script (then was killed by SIGABRT as the "
                               "process exited) at "), lines
    assert lines[0].endswith(" while rank 0 was still training; the others then failed waiting for it")
    assert lines[1].startswith("rank 0 gave up waiting in a collective (exit code 1, pid 100)")
    assert len(lines) == 2 and status == 1


def test_a_teardown_crash_after_every_rank_finished_is_no_failure_of_the_job():
    """Every rank ran its script to the end; rank 1 then crashed as it exited (seen in CI:
    SIGABRT, "terminate called without an active exception"), and the launcher stopped rank 0."""
    ends = {0: _end(0, -signal.SIGTERM, "exit", t=1.0), 1: _end(1, -signal.SIGABRT, "exit", t=1.0)}
    assert postmortem.finished_everywhere(ends)
    assert postmortem.finished_everywhere({0: _end(0, 0, "exit"), 1: _end(1, -signal.SIGSEGV, "exit")})
    # a rank still in its script, a status of its own, or a rank that left no note: a failure
    assert not postmortem.finished_everywhere({0: _end(0, -signal.SIGTERM, "running"), 1: _end(1, -6, "exit")})
    assert not postmortem.finished_everywhere({0: _end(0, 0, "exit"), 1: _end(1, 3, "exit")})
    assert not postmortem.finished_everywhere({0: _end(0, 0, "exit"), 1: _end(1, -6, "exception")})
    assert not postmortem.finished_everywhere({0: postmortem.RankEnd(0, -6, 100, {}, ""), 1: _end(1, 0, "exit")})


# Each rank ends its script (launch/rank.py notes it before any exit handler runs); then rank 0
# aborts in an exit handler, once rank 1 has finished too, as a crash in teardown would.
# ABORT=early: rank 0 aborts before its script ends.
TEARDOWN = textwrap.dedent("""
    import atexit, os, sys, time
    out, when = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])

    def after_paratrain():
        open(os.path.join(out, f"ended{rank}"), "w").close()
        while rank == 0 and not os.path.exists(os.path.join(out, "ended1")):
            time.sleep(0.02)
        if rank == 0:
            os.abort()
    atexit.register(after_paratrain)
    import torch, torch.distributed as dist
    import paratrain as pt
    topo = pt.Topology.from_env().init()
    dist.all_reduce(torch.ones(1))
    if when == "early" and rank == 0:
        os.abort()
    pt.destroy()
""")


@pytest.mark.parametrize("when", ["teardown", "early"])
def test_a_rank_that_aborts_after_its_script_ended_does_not_fail_the_job(tmp_path, when):
    (tmp_path / "teardown.py").write_text(TEARDOWN)
    done = paratrain("run", "-n", "2", "teardown.py", str(tmp_path), when, cwd=tmp_path, timeout=90)
    if when == "teardown":
        assert done.returncode == 0, done.stderr[-3000:]
        assert "paratrain run: every rank ran its script to the end; then rank 0 was killed by SIGABRT as " \
               "the process exited" in done.stderr and "exit status 0" in done.stderr
    else:
        assert done.returncode == 128 + signal.SIGABRT, done.stderr[-3000:]
        assert "rank 0 failed (killed by SIGABRT" in done.stderr and "ran its script to the end" not in done.stderr


def test_a_rank_stopped_while_it_was_giving_up_in_a_collective_is_not_called_stopped():
    """Seen in CI: rank 1 skipped an all-reduce, ran to the end and crashed in teardown; rank 0 had
    already given up waiting ("connection closed by peer", its note written) when the launcher's
    SIGTERM reached it. Rank 1's early exit is the fault; the job's status is rank 0's exception's."""
    ends = {0: _end(0, -signal.SIGTERM, "collective", t=2.0, error="RuntimeError: Connection closed by peer"),
            1: _end(1, -signal.SIGABRT, "exit", t=1.0)}
    lines, status = postmortem.summarize(ends, first_rank=1)
    assert lines[0].startswith("rank 1 ran to the end of the script (then was killed by SIGABRT as the "
                               "process exited) at "), lines
    assert lines[1].startswith("rank 0 gave up waiting in a collective (killed by SIGTERM, pid 100)"), lines
    assert status == 1 and not any(line.startswith("then stopped by the launcher") for line in lines)


def test_a_rank_stopped_while_still_waiting_for_one_that_finished_early_is_its_victim():
    """The same job, the other order: the launcher stopped rank 0 while it still waited in the
    all-reduce rank 1 never issued, before it gave up (its note: running)."""
    ends = {0: _end(0, -signal.SIGTERM, "running", stack=IN_ALL_REDUCE, t=0.5),
            1: _end(1, -signal.SIGABRT, "exit", t=1.0)}
    lines, status = postmortem.summarize(ends, first_rank=1)
    assert lines[0].startswith("rank 1 ran to the end of the script (then was killed by SIGABRT as the "
                               "process exited) at "), lines
    assert lines[0].endswith("while rank 0 was still training; the others then failed waiting for it")
    assert lines[1] == "rank 0 was waiting in all_reduce when the launcher stopped it" and status == 1


# Rank 1's loss turns NaN at step 2; averaged over the ranks, its gradients turn rank 0's NaN too,
# so both ranks raise at that step: rank 1 the loss's error, rank 0 "a gradient is NaN … although
# the loss was finite" (an error that may echo another rank's).
NAN_LOSS = textwrap.dedent("""
    import sys
    import torch, torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    import paratrain as pt

    session = pt.Session(sys.argv[1], progress_bar=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    model, opt, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8))
    for step, (x, y) in enumerate(loader):
        if session.topology.rank == 1 and step == 2:
            x = x * float("nan")
        session.train_step((x, y), F.cross_entropy)
""")


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_the_rank_whose_loss_was_nan_leads_the_summary(tmp_path, monkeypatch, strategy):
    monkeypatch.delenv("PARATRAIN_DEBUG_COLLECTIVES", raising=False)
    (tmp_path / "nan_loss.py").write_text(NAN_LOSS)
    proc = paratrain("run", "-n", "2", "--timeout", "5", "nan_loss.py", strategy, cwd=tmp_path, timeout=90)
    summary = [line for line in proc.stderr.splitlines() if line.startswith("paratrain run:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    # (exit code 1, or a signal that reached its teardown: the launcher stops it as rank 0 exits)
    assert summary[0].startswith("paratrain run: rank 1 failed ("), summary
    assert "UsageError: the loss is nan at optimizer step 2 (micro-batch 2, epoch 0) on rank 1" in summary[0]
    assert summary[1].startswith("paratrain run: also failed: rank 0 with UsageError: a gradient is NaN or "
                                 "infinite although the loss was finite"), summary
    assert not any("rank 0 failed" in line for line in summary), summary


def test_an_error_that_may_echo_another_ranks_comes_after_one_with_a_cause_of_its_own():
    """The agent's first failure and the earliest note are rank 0's NaN gradient; rank 1's NaN
    loss, noted later, is the cause."""
    ends = {0: postmortem.RankEnd(0, 1, 100, dict(kind="exception", time=1.0, echo=True,
                                                  error="UsageError: a gradient is NaN"), ""),
            1: _end(1, 1, "exception", t=2.0, error="UsageError: the loss is nan")}
    lines, status = postmortem.summarize(ends, first_rank=0)
    assert lines == ["rank 1 failed (exit code 1, pid 101): UsageError: the loss is nan; see its output above",
                     "also failed: rank 0 with UsageError: a gradient is NaN (exit code 1)"]
    assert status == 1


def test_an_echoing_rank_waits_for_the_others_notes_before_it_exits(tmp_path, monkeypatch):
    """Rank 0 raised an error that may echo rank 1's: it leaves only once rank 1's note says it
    stopped running (here 0.3 s later), or after ECHO_WAIT seconds without one."""
    import threading

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    mine = dict(rank=0, attempt=0, pid=100, kind="exception")
    other = tmp_path / "101.json"
    other.write_text(json.dumps(dict(rank=1, attempt=0, pid=101, kind="running")))
    later = threading.Timer(0.3, lambda: other.write_text(json.dumps(dict(rank=1, attempt=0, pid=101,
                                                                            kind="exception"))))
    later.start()
    began = time.monotonic()
    worker._let_the_others_speak(str(tmp_path), mine)
    assert 0.25 < time.monotonic() - began < worker.ECHO_WAIT
    later.join()
    other.write_text(json.dumps(dict(rank=1, attempt=0, pid=101, kind="running")))
    monkeypatch.setattr(worker, "ECHO_WAIT", 0.2)
    began = time.monotonic()
    worker._let_the_others_speak(str(tmp_path), mine)  # rank 1 never stops: bounded
    assert 0.2 <= time.monotonic() - began < 2


# Rank 1 stops itself (SIGSTOP, as a job-control stop or a debugger would) at step 3; rank 0 waits
# for it in the all-reduce until the collective timeout.
STOPS = textwrap.dedent("""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import paratrain as pt

    topo = pt.Topology.from_env().init()
    for step in range(40):
        if topo.rank == 1 and step == 3:
            open(sys.argv[1], "w").write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # STOP
        dist.all_reduce(torch.ones(1))  # ALL_REDUCE
""")


def test_a_stopped_rank_is_ended_within_the_timeout_and_named(tmp_path, monkeypatch):
    """torch's agent waits 30 s after its SIGTERM, which a stopped process never runs, before it
    sends SIGKILL: the job must end within --timeout + 10 s of the stop all the same."""
    monkeypatch.delenv("PARATRAIN_DEBUG_COLLECTIVES", raising=False)
    (tmp_path / "stops.py").write_text(STOPS)
    timeout = 10
    proc = paratrain("run", "-n", "2", "--timeout", str(timeout), "stops.py", str(tmp_path / "stopped"),
                     cwd=tmp_path, timeout=120)
    took = time.time() - float((tmp_path / "stopped").read_text())
    summary = [line for line in proc.stderr.splitlines() if line.startswith("paratrain run:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert took < timeout + 10, f"the job ran {took:.1f} s after rank 1 was stopped"
    line = next(i for i, s in enumerate(STOPS.splitlines(), 1) if "# ALL_REDUCE" in s)
    assert summary[0].startswith(f"paratrain run: rank 1 is not running (stopped); rank 0 waited in all_reduce "
                                 f"at stops.py:{line}. "), summary
