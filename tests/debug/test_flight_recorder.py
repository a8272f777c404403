"""The collective flight recorder (flight_recorder.py, flight_hooks.py): a bounded ring, the
caller's line past paratrain and torch, bytes and shapes, and what it sees on real ranks: our
DDP's bucket all-reduces, a Session's, the user's own torch.distributed calls, p2p batches."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import paratrain as pt
from paratrain.debug import flight_hooks, flight_recorder
from paratrain.debug.flight_recorder import RECORDER, FlightRecorder
from paratrain.distributed import comm
from paratrain.testing import run_on_ranks
from tests.support.models import make_batches, make_model


def _here() -> int:
    """The line that called this function."""
    return sys._getframe(1).f_lineno


def _entries() -> list[dict]:
    return RECORDER.snapshot()["entries"]


def test_the_ring_keeps_the_last_n_and_counts_every_one():
    ring = FlightRecorder(capacity=3)
    for i in range(5):
        ring.start("all_reduce", (0, 1), [((4,), torch.float32, None)], 16, None, ("a.py", i, "f"))
    ring.start("barrier", (0, 2), [], 0, None, None)
    entries = ring.snapshot()["entries"]
    assert [e["seq"] for e in entries] == [3, 4, 5]
    assert [e["gseq"] for e in entries] == [3, 4, 0]  # numbered per group
    assert ring.snapshot()["issued"] == [[[0, 1], 5], [[0, 2], 1]]
    assert entries[0]["tensors"] == ["float32[4]"] and entries[0]["line"] == 3


def test_capacity_comes_from_the_environment():
    assert flight_recorder.capacity_from_env({}) == flight_recorder.DEFAULT_CAPACITY
    assert flight_recorder.capacity_from_env({"PARATRAIN_FLIGHT_RECORDER": "0"}) == 0
    assert flight_recorder.capacity_from_env({"PARATRAIN_FLIGHT_RECORDER": "off"}) == 0
    assert flight_recorder.capacity_from_env({"PARATRAIN_FLIGHT_RECORDER": "64"}) == 64


def test_switched_off_torch_functions_stay_torch_own():
    code = ("import paratrain as pt, torch.distributed as d; pt.install_flight_recorder(); "
            "print(d.all_reduce is d.distributed_c10d.all_reduce)")
    own = {v: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PARATRAIN_FLIGHT_RECORDER": v}).stdout.strip()
           for v in ("0", "16")}
    assert own == {"0": "True", "16": "False"}
    flight_hooks.install()  # this process may not have started a Session yet
    original = flight_hooks._originals["all_reduce"]
    with flight_hooks.off():
        assert dist.all_reduce is original
    assert dist.all_reduce is not original and flight_hooks.installed()


def _calls_through_paratrain(topo):
    x = torch.ones(3, 5)
    line = _here() + 1
    comm.all_reduce(x, average=True)  # paratrain/distributed/comm.py, then torch: both skipped
    comm.all_gather_cat(x)  # all_gather_single: the output holds world x the input's bytes
    dist.all_gather([torch.empty(2) for _ in range(topo.world_size)], torch.ones(2))
    return _entries(), line


def test_call_site_is_the_users_line_and_bytes_are_the_message():
    (entries, line), _ = run_on_ranks(_calls_through_paratrain, 2, timeout=60)
    reduce, gather, listed = entries
    assert (reduce["op"], reduce["file"], reduce["line"]) == ("all_reduce", __file__, line)
    assert reduce["function"] == "_calls_through_paratrain" and reduce["group"] == [0, 1]
    assert reduce["bytes"] == 3 * 5 * 4 and reduce["tensors"] == ["float32[3, 5]"]
    assert reduce["state"] == "completed" and reduce["ended"] >= reduce["started"]
    assert gather["op"] in ("all_gather_single", "all_gather_into_tensor") and gather["line"] == line + 1
    assert gather["bytes"] == 2 * 3 * 5 * 4 and gather["tensors"] == ["float32[6, 5]", "float32[3, 5]"]
    assert listed["tensors"] == ["2 x float32[2]", "float32[2]"] and listed["bytes"] == 2 * 2 * 4
    assert [e["gseq"] for e in entries] == [0, 1, 2]


def _ddp_and_own_calls(topo):
    model = pt.DistributedDataParallel(make_model("mlp"))
    xs, ys = make_batches(1, 8, seed=topo.rank)
    x, y = xs[0], ys[0]
    before = len(_entries())
    backward = _here() + 1
    F.cross_entropy(model(x), y).backward()  # the buckets' all-reduces, from autograd hooks
    in_backward = _entries()[before:]
    own = _here() + 1
    dist.all_reduce(torch.ones(1))  # the user's own call, between paratrain's
    return in_backward, _entries()[-1], backward, own


def test_it_sees_our_ddps_bucket_all_reduces_and_the_users_own_calls():
    for in_backward, own, backward, own_line in run_on_ranks(_ddp_and_own_calls, 2, timeout=60):
        buckets = [e for e in in_backward if e["op"] == "all_reduce"]
        assert buckets and all(e["line"] == backward and e["file"] == __file__ for e in buckets)
        assert all(e["state"] == "completed" for e in buckets)  # async: completed by its future
        assert sum(e["bytes"] for e in buckets) >= sum(p.numel() * 4 for p in make_model("mlp").parameters())
        assert (own["op"], own["line"], own["group"]) == ("all_reduce", own_line, [0, 1])


def _session_step(topo):
    session = pt.Session("ddp", topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = make_batches(1, 8, seed=topo.rank)
    before = len(_entries())
    line = _here() + 1
    session.train_step((xs[0], ys[0]), F.cross_entropy)
    return _entries()[before:], line


def test_a_sessions_collectives_name_the_line_that_called_train_step():
    entries, line = run_on_ranks(_session_step, 2, timeout=60)[0]
    assert entries and all(e["line"] == line for e in entries), entries


def _exchange(topo):
    pt.ring_all_reduce(torch.arange(4.0))  # batch_isend_irecv of P2POps built on dist.isend/irecv
    peer = 1 - topo.rank
    waiting = dist.irecv(torch.empty(2), peer) if topo.rank == 0 else None
    started = _entries()[-1]["state"] if waiting else None
    dist.barrier()
    if topo.rank == 1:
        dist.send(torch.ones(2), peer)
    else:
        waiting.wait()
    dist.barrier()
    return [e for e in _entries() if e["op"] not in ("barrier",)], started


def test_p2p_batches_and_async_receives_are_recorded():
    (rank0, started), (rank1, _) = run_on_ranks(_exchange, 2, timeout=60)
    batches = [e for e in rank0 if e["op"] == "batch_isend_irecv"]
    assert batches and batches[0]["group"] == ["p2p", 0, 1]
    assert batches[0]["detail"] in ("recv from 1, send to 1", "send to 1, recv from 1")
    assert started == "started"  # rank 1 had not sent yet
    recv = rank0[-1]
    assert (recv["op"], recv["detail"], recv["state"]) == ("irecv", "from 1", "completed")
    assert (rank1[-1]["op"], rank1[-1]["detail"]) == ("send", "to 0")


def _compiled(topo):
    import torch._dynamo

    @torch.compile(backend="eager", fullgraph=True)  # fullgraph: a graph break would raise
    def step(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    before = len(_entries())
    return step(torch.ones(3)), len(_entries()) - before


def test_compiled_code_traces_torchs_own_collective():
    out, recorded = run_on_ranks(_compiled, 1, timeout=120)[0]
    assert torch.equal(out, torch.full((3,), 3.0)) and recorded == 0  # not covered, and not in the way


def test_an_async_collective_whose_future_fails_is_recorded_failed_not_completed():
    """DDP's and ZeRO's async all-reduces and gathers end by their works' futures (a done-callback,
    flight_hooks._finish): one that holds an error (a gloo timeout, a lost peer) is the
    operation's failure, with the error's first sentence. (A real gloo timeout's ring:
    tests/debug/test_hang_report.py's Session scenarios.)"""
    ring = FlightRecorder(capacity=4)
    failed, completed = (ring.start("all_reduce", (0, 1), [], 0, None, None) for _ in range(2))
    future = torch.futures.Future()
    future.set_exception(RuntimeError("[/src/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                                      "Timed out waiting 5000ms for recv operation to complete. More."))
    assert not failed.settled(future)
    assert (failed.state, failed.error) == ("failed", "RuntimeError: Timed out waiting 5000ms for recv "
                                                      "operation to complete.")
    # the other operations pending on that connection: gloo closed it, and they timed out too
    closed = ring.start("broadcast", (0, 1), [], 0, None, None)
    future = torch.futures.Future()
    future.set_exception(RuntimeError("Application timeout caused pair closure"))
    assert not closed.settled(future)
    assert closed.error == ("RuntimeError: Timed out: gloo closed the connection when an operation on it timed "
                            "out (Application timeout caused pair closure)")
    future = torch.futures.Future()
    future.set_result([torch.ones(1)])
    assert completed.settled(future) and completed.state == "started"  # done once every work is
