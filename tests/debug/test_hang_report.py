"""Hangs and desyncs through `paratrain run` on real ranks: the job ends within
the collective timeout + 10 s, and the report names the operation, the ranks, and the user's
file and line where the ranks' collective histories part, from their flight recorders."""

from __future__ import annotations

import re
import textwrap
import time

import pytest

from paratrain.debug import hang_report
from tests.support.launcher import paratrain

TIMEOUT = 5  # seconds each collective may wait (paratrain run --timeout)

PROLOGUE = """\
import sys, time
import torch, torch.distributed as dist
import paratrain as pt

topo = pt.Topology.from_env().init()
x = torch.ones(4)


def parted():  # notes when the ranks go separate ways
    open(f"{sys.argv[1]}{topo.rank}", "w").write(repr(time.time()))

"""

SCRIPTS = {
    "skip": PROLOGUE + textwrap.dedent("""
        for step in range(4):
            if step == 2:
                parted()
            if topo.rank == 1 and step == 2:
                continue  # rank 1 leaves one all-reduce out
            dist.all_reduce(x)  # ALL_REDUCE
        """),
    "other_op": PROLOGUE + textwrap.dedent("""
        dist.all_reduce(x)
        parted()
        if topo.rank == 1:
            dist.broadcast(x, src=0)  # BROADCAST
        else:
            dist.all_reduce(x)  # ALL_REDUCE
        dist.all_reduce(x)
        """),
    "barrier": PROLOGUE + textwrap.dedent("""
        def sync():
            dist.barrier()  # BARRIER


        for step in range(3):
            dist.all_reduce(x)  # ALL_REDUCE
            if topo.rank == 1 and step == 1:
                parted()
                time.sleep(120)  # STUCK: rank 1 never reaches the barrier in sync()
            sync()
        """),
}


def _line(script: str, marker: str) -> int:
    return next(i for i, text in enumerate(SCRIPTS[script].splitlines(), 1) if f"# {marker}" in text)


def _run(tmp_path, script: str, *flags: str) -> list[str]:
    (tmp_path / f"{script}.py").write_text(SCRIPTS[script])
    parted = tmp_path / "parted"
    proc = paratrain("run", "-n", "2", "--timeout", str(TIMEOUT), *flags, f"{script}.py", str(parted),
                     cwd=tmp_path, timeout=90)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    took = ended - min(float(p.read_text()) for p in tmp_path.glob("parted*"))
    assert took < TIMEOUT + 10, f"the job ran {took:.1f} s after the ranks parted"
    return [line.removeprefix("paratrain run: ") for line in proc.stderr.splitlines()
            if line.startswith("paratrain run: ")]


@pytest.fixture(autouse=True)
def plain(monkeypatch):
    monkeypatch.delenv("PARATRAIN_DEBUG_COLLECTIVES", raising=False)
    monkeypatch.delenv("PARATRAIN_FLIGHT_RECORDER", raising=False)


def test_a_rank_that_skips_an_all_reduce(tmp_path):
    report = _run(tmp_path, "skip")
    at = f"skip.py:{_line('skip', 'ALL_REDUCE')} (in <module>)"
    world = "the world group (ranks 0, 1)"
    assert f"  behind on {world}: rank 1 (issued up to #2; rank 0 up to #3)" in report, report
    assert report[-1] == (f"  the histories diverge at #3 on {world}: rank 0 called all_reduce(float32[4]) "
                          f"at {at}; rank 1 never issued #3")
    assert any(re.fullmatch(rf"  rank 0 gave up in #3 all_reduce\(float32\[4\]\) on {re.escape(world)} at "
                            rf"{re.escape(at)}: .*(closed by peer|Timed out).*", line) for line in report), report


def test_a_rank_that_broadcasts_where_the_others_all_reduce(tmp_path):
    report = _run(tmp_path, "other_op")
    assert report[-1] == (
        "  the histories diverge at #1 on the world group (ranks 0, 1): rank 0 called all_reduce(float32[4]) at "
        f"other_op.py:{_line('other_op', 'ALL_REDUCE')} (in <module>); rank 1 called broadcast(float32[4]) at "
        f"other_op.py:{_line('other_op', 'BROADCAST')} (in <module>)"), report
    assert not any(line.startswith("  behind") for line in report)  # both issued #1


def test_a_rank_that_never_reaches_a_barrier_in_a_user_function(tmp_path):
    report = _run(tmp_path, "barrier")
    barrier = f"barrier.py:{_line('barrier', 'BARRIER')} (in sync)"
    world = "the world group (ranks 0, 1)"
    assert report[-1] == f"  the histories diverge at #3 on {world}: rank 0 called barrier at {barrier}; rank 1 never issued #3"
    assert any(line.startswith(f"  rank 0 gave up in #3 barrier on {world} at {barrier}: ") for line in report)
    # rank 1 was sleeping when the launcher stopped it: its ring came from the SIGTERM path
    assert (f"  rank 1 is in no collective; its last was #2 all_reduce(float32[4]) on {world} at "
            f"barrier.py:{_line('barrier', 'ALL_REDUCE')} (in <module>), completed") in report
    assert report[0].endswith(f"rank 1 was at barrier.py:{_line('barrier', 'STUCK')} (in <module>)")


def test_no_collectives_section_with_the_recorder_off(tmp_path):
    report = _run(tmp_path, "skip", "--flight-recorder", "0")
    assert report and not any("collectives (" in line or "diverge" in line for line in report), report


def _ring(entries, issued, world=2):
    return dict(world=world, capacity=4, time=10.0, issued=issued, entries=[
        dict(seq=i, op=op, group=[0, 1], gseq=k, tensors=[shape] if shape else [], bytes=0, detail=None,
             file="/job/train.py", line=line, function="step", state=state, error=None, started=1.0 + i, ended=None)
        for i, (k, op, shape, line, state) in enumerate(entries)])


def test_report_compares_what_both_rings_still_hold_and_names_a_shape_mismatch():
    rank0 = _ring([(5, "all_reduce", "float32[4]", 9, "completed"), (6, "all_reduce", "float32[4]", 9, "started")],
                  [[[0, 1], 7]])
    rank1 = _ring([(3, "broadcast", "float32[4]", 7, "completed"),  # rank 0's #3 left its ring: not compared
                   (5, "all_reduce", "float32[4]", 9, "completed"), (6, "all_reduce", "float32[5]", 9, "started")],
                  [[[0, 1], 7]])
    lines = hang_report.describe({0: rank0, 1: rank1})
    assert lines[1] == ("  rank 0 is blocked in #6 all_reduce(float32[4]) on the world group (ranks 0, 1) at "
                        "/job/train.py:9 (in step), for 8.0 s when its ring was written")
    assert lines[-1] == ("  the histories diverge at #6 on the world group (ranks 0, 1): rank 0 called "
                         "all_reduce(float32[4]) at /job/train.py:9 (in step); rank 1 called all_reduce(float32[5]) "
                         "at /job/train.py:9 (in step)")
    assert hang_report.describe({}) == []


# A Session trains in lock step, and rank 1 goes wrong at step 3: it sleeps (rank 0 times out in
# the step's collective), it leaves the loop (`break`), or its stream, sharding itself by rank
# where the Session shards it again, runs out a step before rank 0's; or rank 0 checkpoints alone. The collectives are the
# strategies' own async ones (DDP's buckets, ZeRO-3's gathers), waited on inside the step.
SESSION = textwrap.dedent("""\
    import itertools, os, sys, time
    import torch, torch.nn.functional as F, torch.distributed as dist
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset
    import paratrain as pt

    strategy, mode, parted = sys.argv[1], sys.argv[2], sys.argv[3]


    class Stream(IterableDataset):  # shards itself: 18 rows for rank 0, 17 for rank 1
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            rows = [(torch.randn(8, generator=g), i % 2) for i in range(35)]
            return itertools.islice(rows, dist.get_rank(), None, dist.get_world_size())


    session = pt.Session(strategy, progress_bar=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    loader = DataLoader(Stream(), batch_size=4) if mode == "stream" else DataLoader(data, batch_size=8)
    model, opt, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    rank = session.topology.rank
    for step, batch in enumerate(loader):
        if step == 3 or (mode == "stream" and step == 4):
            open(f"{parted}{rank}", "w").write(repr(time.time()))
        if mode == "sleep" and rank == 1 and step == 3:
            time.sleep(120)  # SLEEP
        if mode == "break" and rank == 1 and step == 3:
            break
        if mode == "checkpoint" and rank == 0 and step == 3:
            session.checkpoint(os.path.join(os.path.dirname(parted), "checkpoints"))  # ALONE
        session.train_step(batch, F.cross_entropy)  # STEP
    """)


def _session_report(tmp_path, strategy: str, mode: str) -> list[str]:
    (tmp_path / "session.py").write_text(SESSION)
    proc = paratrain("run", "-n", "2", "--timeout", str(TIMEOUT), "session.py", strategy, mode,
                     str(tmp_path / "parted"), cwd=tmp_path, timeout=90)
    ended = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    took = ended - min(float(p.read_text()) for p in tmp_path.glob("parted*"))
    assert took < TIMEOUT + 10, f"the job ran {took:.1f} s after the ranks parted"
    return [line.removeprefix("paratrain run: ") for line in proc.stderr.splitlines()
            if line.startswith("paratrain run: ")]


def _session_line(marker: str) -> int:
    return next(i for i, text in enumerate(SESSION.splitlines(), 1) if f"# {marker}" in text)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_session_rank_that_sleeps_in_step_3_is_named_not_the_rank_that_waited(tmp_path, strategy):
    report = _session_report(tmp_path, strategy, "sleep")
    assert report[0] == ("rank 1 never reached the collective that rank 0 was waiting in: when the launcher "
                         f"stopped it, rank 1 was at session.py:{_session_line('SLEEP')} (in <module>)"), report
    assert report[1].startswith("rank 0 gave up waiting in a collective (exit code 1, pid "), report
    # the step's collective that timed out is recorded as failed, not completed
    at = f"session.py:{_session_line('STEP')} (in <module>)"
    assert any(line.startswith("  rank 0 gave up in #") and at in line and "Timed out" in line for line in report), report
    assert any(line.startswith("  rank 1 is in no collective; its last was #") and line.endswith(", completed")
               for line in report), report


@pytest.mark.parametrize("strategy, mode", [("ddp", "break"), ("zero3", "break"), ("ddp", "stream")])
def test_a_session_rank_that_stops_early_is_named_as_having_exited(tmp_path, strategy, mode):
    report = _session_report(tmp_path, strategy, mode)
    assert report[0].startswith("rank 1 exited cleanly (exit code 0) at "), report
    assert report[0].endswith(" while rank 0 was still training; the others then failed waiting for it"), report
    assert report[1].startswith("rank 0 gave up waiting in a collective (exit code 1, pid "), report
    assert any(line.startswith("  rank 0 gave up in #") for line in report), report


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_session_checkpoint_called_on_one_rank_only_is_named(tmp_path, strategy):
    report = _session_report(tmp_path, strategy, "checkpoint")
    assert report[0].startswith(f"rank 0 called session.checkpoint alone (at session.py:{_session_line('ALONE')}): "
                                "at #"), report
    assert (f"rank 1 called {'all_reduce(float32[178])' if strategy == 'ddp' else 'broadcast(float32[89])'} at "
            f"session.py:{_session_line('STEP')} (in <module>) instead. session.checkpoint is a collective: call it "
            "on every rank, at the same point of the loop") in report[0], report


def test_a_collective_call_every_rank_made_alike_is_not_called_alone():
    """Both ranks were in session.save where they parted (a shape differs inside it): no rank
    called it alone. Rank 1 in another of them (session.load): rank 0 called save alone."""
    rank0 = _ring([(0, "all_reduce", "float32[4]", 9, "completed"), (1, "broadcast", "float32[4]", 12, "started")],
                  [[[0, 1], 2]])
    rank1 = _ring([(0, "all_reduce", "float32[4]", 9, "completed"), (1, "broadcast", "float32[5]", 12, "started")],
                  [[[0, 1], 2]])
    for ring in (rank0, rank1):
        ring["entries"][1]["within"] = "session.save"
    assert hang_report.alone({0: rank0, 1: rank1}) is None
    rank1["entries"][1]["within"] = "session.load"
    assert hang_report.alone({0: rank0, 1: rank1}).startswith(
        "rank 0 called session.save alone (at /job/train.py:12): at #1 on the world group (ranks 0, 1), rank 1 called "
        "broadcast(float32[5]) at /job/train.py:12 (in step) in session.load instead.")
    del rank0["entries"][1]["within"]  # a ring written before `within` existed
    assert hang_report.alone({0: rank0, 1: rank1}).startswith("rank 1 called session.load alone")


CP_SESSION = textwrap.dedent("""\
    import sys, time
    import torch, torch.nn.functional as F
    import paratrain as pt

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x):  # x: (B, T, 8)
            if self.training and step[0] == 2 and pt.Topology.from_env().rank == 1:
                time.sleep(120)  # SLEEP: rank 1 never reaches the ring's exchange
            q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # ATTENTION
            return y.transpose(1, 2).flatten(2)

    step = [0]
    session = pt.Session(pt.Mesh(cp=2), progress_bar=False)
    torch.manual_seed(0)
    model = Attention()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(2, 16, 8), torch.randn(2, 16, 8)
    for step[0] in range(4):
        if step[0] == 2:
            open(f"{sys.argv[1]}{session.topology.rank}", "w").write(repr(time.time()))
        session.train_step((x, y), F.mse_loss)
    """)


def test_a_context_parallel_rank_waiting_in_ring_attention_says_so_at_the_models_attention_line(tmp_path):
    """The ring's exchange is issued from the model's own SDPA call: the report names that line,
    and what the exchange was for (flight_recorder.labelled), and blames the rank that slept."""
    (tmp_path / "session.py").write_text(CP_SESSION)
    proc = paratrain("run", "-n", "2", "--timeout", str(TIMEOUT), "session.py", str(tmp_path / "parted"),
                     cwd=tmp_path, timeout=90)
    assert proc.returncode == 1, proc.stderr[-3000:]
    report = [line.removeprefix("paratrain run: ") for line in proc.stderr.splitlines()
              if line.startswith("paratrain run: ")]
    line = next(i for i, text in enumerate(CP_SESSION.splitlines(), 1) if "# ATTENTION" in text)
    sleep = next(i for i, text in enumerate(CP_SESSION.splitlines(), 1) if "# SLEEP" in text)
    assert report[0].startswith("rank 1 never reached the collective that rank 0 was waiting in: when the launcher "
                                f"stopped it, rank 1 was at session.py:{sleep} (in forward)"), report
    assert any(text.startswith("  rank 0 ") and "batch_isend_irecv" in text and "send to 1, recv from 1 for ring "
               f"attention (cp): K, V at session.py:{line} (in forward)" in text for text in report), report
    assert report[-1] == ("  the ranks of this node issued the same collectives, in the same order (point-to-point "
                          "operations are not compared)"), report
