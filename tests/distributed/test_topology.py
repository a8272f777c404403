import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import paratrain as pt
from paratrain.distributed.topology import DRAIN_S, first_slurm_host, free_port
from paratrain.testing import RankFailure, run_on_ranks
from tests.support import ROOT_DIR
from tests.support.launcher import assert_no_worker_left, running, wait_for


def test_plain_single_process_needs_no_environment():
    topo = pt.Topology.from_env({})
    assert (topo.rank, topo.world_size, topo.local_rank, topo.num_nodes) == (0, 1, 0, 1)
    assert topo.backend == "gloo" and topo.device == torch.device("cpu")
    assert topo.launcher == "single" and topo.is_main


def test_torchrun_environment():
    env = dict(RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4", GROUP_RANK="1",
               MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    topo = pt.Topology.from_env(env)
    assert (topo.rank, topo.local_rank, topo.node_rank, topo.num_nodes) == (5, 1, 1, 2)
    assert (topo.master_addr, topo.master_port, topo.launcher) == ("10.0.0.1", 29500, "torchrun")


def test_slurm_environment():
    env = dict(SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_LOCALID="1", SLURM_NODEID="1",
               SLURM_NNODES="2", SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="gpu[07-08]")
    topo = pt.Topology.from_env(env)
    assert (topo.rank, topo.local_rank, topo.local_world_size, topo.node_rank) == (3, 1, 2, 1)
    assert topo.master_addr == "gpu07" and topo.master_port == 21234 and topo.launcher == "slurm"


def test_spawn_style_arguments():
    topo = pt.Topology.from_env({}, rank=2, world_size=4, local_world_size=2)
    assert (topo.local_rank, topo.node_rank, topo.num_nodes, topo.launcher) == (0, 1, 2, "spawn")


@pytest.mark.parametrize("nodelist,host", [("node1", "node1"), ("gpu[03-05,07],cpu1", "gpu03"),
                                           ("a[9]", "a9"), ("", "127.0.0.1")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


@pytest.mark.parametrize("env,message", [
    (dict(RANK="4", WORLD_SIZE="4"), "not inside a world"),
    (dict(RANK="0", WORLD_SIZE="6", LOCAL_WORLD_SIZE="4"), "same number of processes on every node"),
    (dict(RANK="x", WORLD_SIZE="2"), "not an integer"),
])
def test_bad_environment_is_a_config_error(env, message):
    with pytest.raises(pt.ConfigError, match=message):
        pt.Topology.from_env(env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised when CUDA is absent")
def test_nccl_without_cuda_is_a_clear_error():
    with pytest.raises(pt.ConfigError, match="nccl' needs CUDA"):
        pt.Topology.from_env({}, backend="nccl")


def test_world_of_one_initialises_with_no_environment(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    topo = pt.Topology.from_env().init(timeout=10)
    try:
        x = torch.ones(3)
        torch.distributed.all_reduce(x)
        assert torch.distributed.get_world_size() == 1 and x.tolist() == [1.0, 1.0, 1.0]
        assert topo.master_port > 0
    finally:
        pt.destroy()


def _hold_then_drop(group, held, dropped, seconds):
    ref = group
    held.set()
    time.sleep(seconds)  # as gloo's thread holds a comm hook's closure until it gets the GIL
    del ref
    dropped.set()


@pytest.mark.parametrize("group", ["world", "subgroup"])
def test_destroy_lets_the_last_reference_go_on_its_own_thread(monkeypatch, group):
    # [Note: a group dropped by its own thread] in topology.py
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    pt.Topology.from_env().init(timeout=10)
    target = torch.distributed.group.WORLD if group == "world" else torch.distributed.new_group([0])
    held, dropped = threading.Event(), threading.Event()
    worker = threading.Thread(target=_hold_then_drop, args=(target, held, dropped, 0.02))
    worker.start()
    held.wait()
    del target
    pt.destroy()
    try:
        assert dropped.is_set()  # destroy() waited for the other thread to let its reference go
    finally:
        worker.join()


def test_destroy_waits_briefly_for_a_group_the_caller_keeps(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    pt.Topology.from_env().init(timeout=10)
    kept = torch.distributed.group.WORLD  # a live DDP module holds its group so
    start = time.monotonic()
    pt.destroy()
    assert time.monotonic() - start < DRAIN_S + 0.5 and not torch.distributed.is_initialized()
    del kept


def _groups(topo):
    groups = pt.node_groups(topo)
    x = torch.tensor([float(topo.rank)])
    torch.distributed.all_reduce(x, group=groups.intra_node)
    y = torch.tensor([float(topo.rank)])
    torch.distributed.all_reduce(y, group=groups.inter_node)
    return topo.node_rank, groups.intra_ranks, groups.inter_ranks, x.item(), y.item()


def test_node_groups_are_sliced_from_the_rank_grid():
    out = run_on_ranks(_groups, 4, nodes=2)
    assert out[0] == (0, (0, 1), (0, 2), 1.0, 2.0)
    assert out[1] == (0, (0, 1), (1, 3), 1.0, 4.0)
    assert out[2] == (1, (2, 3), (0, 2), 5.0, 2.0)
    assert out[3] == (1, (2, 3), (1, 3), 5.0, 4.0)


def _raise_on_rank_1(topo):
    if topo.rank == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()


def test_harness_reports_the_failing_rank():
    with pytest.raises(RankFailure, match=r"rank 1 raised:(.|\n)*boom on purpose"):
        run_on_ranks(_raise_on_rank_1, 2, timeout=60)


def _skip_collective(topo):
    if topo.rank == 0:
        torch.distributed.all_reduce(torch.ones(1))


def test_a_rank_that_skips_a_collective_times_out_instead_of_hanging():
    with pytest.raises(RankFailure, match="rank 0"):
        run_on_ranks(_skip_collective, 2, timeout=60, collective_timeout=3)


def _spawned(index, world, port, out):
    # what a torch.multiprocessing.spawn user writes: rank and world size are arguments
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    with pt.Session("ddp", topology=pt.Topology.from_env(rank=index, world_size=world),
                    progress_bar=False) as session:
        model = session.setup(torch.nn.Linear(3, 1))
        model(torch.full((2, 3), float(index))).sum().backward()
        torch.save((session.topology.launcher, model.module.weight.grad), f"{out}/{index}.pt")


def test_runs_under_torch_multiprocessing_spawn(tmp_path):
    torch.multiprocessing.spawn(_spawned, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    (launcher0, grad0), (_, grad1) = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert launcher0 == "spawn"
    assert torch.equal(grad0, grad1) and torch.allclose(grad0, torch.ones(1, 3))  # mean of 0s and 2s


def _skip_on_subgroup(topo):
    groups = pt.node_groups(topo)
    if topo.rank == 0:
        torch.distributed.all_reduce(torch.ones(1), group=groups.intra_node)
    elif topo.rank == 1:
        time.sleep(30)  # alive but absent: only the timeout can end rank 0's wait


def test_subgroups_inherit_the_collective_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 0"):
        run_on_ranks(_skip_on_subgroup, 4, nodes=2, timeout=60, collective_timeout=3)
    assert time.monotonic() - start < 20


CALLER = """
import sys
sys.path.insert(0, {root!r})
from paratrain.testing import run_on_ranks
from tests.support.launcher import sleep_after_writing_pid

if __name__ == "__main__":
    run_on_ranks(sleep_after_writing_pid, 2, {out!r}, timeout=300)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc to see which processes run")
def test_ranks_exit_when_the_caller_is_killed(tmp_path):
    """A caller killed by SIGKILL runs no `finally`: its ranks must see it go by themselves, not
    sleep on (the forkserver that started them outlives the caller while they live)."""
    script = tmp_path / "caller.py"
    script.write_text(CALLER.format(root=ROOT_DIR, out=str(tmp_path)))
    caller = subprocess.Popen([sys.executable, str(script)])
    try:
        wait_for([tmp_path / f"pid{r}" for r in range(2)], timeout=120)
        assert all(running(int((tmp_path / f"pid{r}").read_text())) for r in range(2))
    finally:
        caller.kill()
        caller.wait()
    assert_no_worker_left(tmp_path, 2)
