"""Run a function on N real processes, and compare what they trained with a reference.

`run_on_ranks(fn, world_size, ...)` starts `world_size` processes (a forkserver that has already
imported torch, so each start is cheap), gives each the environment torchrun would, initialises
the default group (gloo, a free port, a collective timeout), calls `fn(topology, *args)` and
returns the per-rank results in rank order. When a rank raises, the others are killed and
`RankFailure` carries that rank's traceback; when the job outlives `timeout`, every process is
killed and the ranks that had not finished are named. Nothing is left running either way, nor
when the caller itself is killed (SIGKILL, or a SIGTERM that skips its `finally`): each rank
exits when its end of a pipe that only the caller holds open reads EOF.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_lib
import threading
import time
import traceback
from typing import Any, Callable

import torch

from paratrain.debug import flight_hooks
from paratrain.distributed.topology import Topology, destroy, free_port
from paratrain.errors import ParatrainError


class RankFailure(ParatrainError, RuntimeError):
    """A rank of `run_on_ranks` raised, died or did not finish in time."""


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, nodes: int = 1,
                 timeout: float = 120.0, collective_timeout: float | None = None,
                 backend: str = "gloo", threads: int | None = None, **kwargs: Any) -> list[Any]:
    """Call `fn(topology, *args, **kwargs)` on `world_size` processes; return their results.

    `fn` must be importable by name (a module-level function). `nodes` splits the ranks into that
    many simulated nodes (LOCAL_RANK, GROUP_RANK follow). `collective_timeout` bounds each
    collective (default: half of `timeout`, at most 60 s).
    """
    if world_size % nodes:
        raise ValueError(f"world_size {world_size} is not divisible by nodes {nodes}")
    ctx = mp.get_context("forkserver")
    # torch.optim imports torch._dynamo on first use (seconds): do it once, in the server
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.nn.parallel", "paratrain"])
    results: "mp.Queue[tuple[int, str, Any]]" = ctx.Queue()
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    collective_timeout = collective_timeout or min(60.0, timeout / 2)
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size // nodes), PARATRAIN_BACKEND=backend)
    # not daemonic, so that a rank may start DataLoader workers as under torchrun; the `finally`
    # below kills every rank on every way out
    # the forkserver outlives a killed caller (its children hold its own lifeline open), so each
    # rank watches a pipe whose only writing end is this process's: EOF means the caller is gone
    caller_gone, caller_alive = ctx.Pipe(duplex=False)
    procs = [ctx.Process(target=_rank_main, daemon=False,
                         args=(fn, rank, env, threads, collective_timeout, args, kwargs, results, caller_gone))
             for rank in range(world_size)]
    try:
        for p in procs:
            p.start()
        return _collect(procs, results, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            if p.pid is not None:
                p.join(5)
        caller_gone.close()
        caller_alive.close()


def _collect(procs, results, timeout: float) -> list[Any]:
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(procs):
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_lib.Empty:
            _check_alive(procs, done, deadline, timeout)
            continue
        if status == "error":
            raise RankFailure(f"rank {rank} raised:\n{payload}")
        done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [done[r] for r in range(len(procs))]


def _check_alive(procs, done, deadline: float, timeout: float) -> None:
    for rank, p in enumerate(procs):
        if rank not in done and p.exitcode is not None:
            raise RankFailure(f"rank {rank} died with exit code {p.exitcode} before reporting")
    if time.monotonic() > deadline:
        missing = [r for r in range(len(procs)) if r not in done]
        raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f} s")


def _exit_with_caller(caller_gone) -> None:
    """Block until the caller's end of the pipe closes (the caller sends nothing), then exit."""
    try:
        caller_gone.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _rank_main(fn, rank, env, threads, collective_timeout, args, kwargs, results, caller_gone) -> None:
    threading.Thread(target=_exit_with_caller, args=(caller_gone,), daemon=True, name="caller-watch").start()
    local_world = int(env["LOCAL_WORLD_SIZE"])
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank % local_world),
                      GROUP_RANK=str(rank // local_world))
    # a fresh process, as under torchrun: the platform's start method, not the forkserver that
    # started this one (each rank's DataLoader workers would start a server of their own: seconds)
    mp.set_start_method(None, force=True)
    torch.set_num_threads(threads)
    flight_hooks.install()  # a job starts here, as in each rank of `paratrain run` (launch/rank.py)
    try:
        topology = Topology.from_env().init(timeout=collective_timeout)
        buffer = io.BytesIO()
        torch.save(fn(topology, *args, **kwargs), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report everything, KeyboardInterrupt included, then die
        results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy()


def max_param_diff(a: torch.nn.Module | dict, b: torch.nn.Module | dict) -> float:
    """Largest absolute difference between two models' (or state dicts') matching tensors."""
    sa = a.state_dict() if isinstance(a, torch.nn.Module) else a
    sb = b.state_dict() if isinstance(b, torch.nn.Module) else b
    if sa.keys() != sb.keys():
        raise AssertionError(f"different keys: {sorted(set(sa) ^ set(sb))}")
    diffs = [(sa[k].double() - sb[k].double()).abs().max().item() for k in sa if sa[k].numel()]
    return max(diffs, default=0.0)


def assert_same_params(a, b, atol: float) -> None:
    """Assert every tensor of `a` equals its twin in `b` within `atol`, naming the worst."""
    sa = a.state_dict() if isinstance(a, torch.nn.Module) else a
    sb = b.state_dict() if isinstance(b, torch.nn.Module) else b
    worst = max_param_diff(sa, sb)
    if worst > atol:
        bad = {k: (sa[k].double() - sb[k].double()).abs().max().item() for k in sa if sa[k].numel()}
        raise AssertionError(f"max difference {worst:.3e} > {atol:.0e}; per tensor: "
                             + ", ".join(f"{k}={v:.2e}" for k, v in bad.items() if v > atol))
