"""Where this process sits in the job: environment → `Topology`, the default group, named groups.

One `Topology` is read from whichever launcher started the process:

- torchrun / `paratrain run` (and `torch.distributed.elastic`): RANK, WORLD_SIZE, LOCAL_RANK,
  LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT;
- SLURM `srun`: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID, SLURM_NNODES,
  SLURM_JOB_NODELIST (the first host is the master unless MASTER_ADDR is set);
- `torch.multiprocessing.spawn`: the caller passes `rank=` and `world_size=`;
- nothing at all: one process, rank 0 of a world of 1, which runs the same code path as N ranks.

`Topology.init` creates the default group; every other group is sliced from one rank grid by
`grid.ProcessGrid`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from paratrain.errors import ConfigError, UsageError

DEFAULT_TIMEOUT_S = 600.0  # every collective gives up after this; PARATRAIN_TIMEOUT overrides it


@dataclass(frozen=True)
class Topology:
    """This process's place in the job. Build it with `Topology.from_env()`."""

    rank: int  # global rank, 0 … world_size-1
    local_rank: int  # rank inside this node; also the index of this process's GPU
    world_size: int  # processes on all nodes
    local_world_size: int  # processes on this node (the same on every node)
    node_rank: int  # which node, 0 … num_nodes-1
    num_nodes: int
    backend: str  # "nccl" for CUDA tensors, "gloo" for CPU tensors
    device: torch.device  # cuda:LOCAL_RANK under nccl, else cpu
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: not known yet (a single process picks a free port at init)
    launcher: str = "single"  # torchrun | slurm | spawn | single
    timeout_s: float | None = None  # every collective's limit, set by init(); groups inherit it

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank that prints, logs and writes single files."""
        return self.rank == 0

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        local_world_size: int | None = None,
        backend: str | None = None,
    ) -> "Topology":
        """Read the launcher's environment; `rank`/`world_size` are for `mp.spawn`-style starts."""
        env = os.environ if env is None else env
        if rank is not None or world_size is not None:
            fields = _from_spawn(env, rank, world_size, local_world_size)
        elif "RANK" in env and "WORLD_SIZE" in env:
            fields = _from_torchrun(env)
        elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            fields = _from_slurm(env)
        else:
            fields = dict(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                          num_nodes=1, launcher="single")
            fields["master_addr"] = env.get("MASTER_ADDR", "127.0.0.1")
            fields["master_port"] = int(env.get("MASTER_PORT", 0))
        _validate(fields)
        backend, device = pick_backend(backend or env.get("PARATRAIN_BACKEND"), fields["local_rank"])
        return cls(backend=backend, device=device, **fields)

    def init(self, timeout: float | None = None, *, debug_collectives: bool | None = None) -> "Topology":
        """Create the default process group (idempotent). `timeout` in seconds bounds every collective;
        `debug_collectives` (default PARATRAIN_DEBUG_COLLECTIVES) checks that ranks agree on each one."""
        debug = debug_collectives_requested(debug_collectives)
        if dist.is_initialized():
            if debug and dist.get_debug_level() != dist.DebugLevel.DETAIL:
                raise UsageError("debug_collectives must be on before the process group is created, and "
                                 "this process already has one: set PARATRAIN_DEBUG_COLLECTIVES=1 (or "
                                 "`paratrain run --debug-collectives`) so that it applies from the start")
            return self
        if debug:
            enable_collective_checks()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        port = self.master_port or free_port()
        timeout = resolve_timeout(timeout)
        delta = datetime.timedelta(seconds=timeout)
        if self.launcher == "torchrun":
            dist.init_process_group(backend=self.backend, store=self._elastic_store(port, delta),
                                    rank=self.rank, world_size=self.world_size, timeout=delta)
        else:
            dist.init_process_group(backend=self.backend, init_method=f"tcp://{self.master_addr}:{port}",
                                    rank=self.rank, world_size=self.world_size, timeout=delta)
        return dataclasses.replace(self, master_port=port, timeout_s=timeout)

    def _elastic_store(self, port: int, timeout: datetime.timedelta) -> dist.Store:
        """torchrun's store (the elastic agent's, when it hosts one), under a prefix per restart.
        A restarted group must not read what its killed predecessor published there: without the
        prefix gloo was seen connecting to a dead rank's port after `--max-restarts` restarted it."""
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = dist.TCPStore(self.master_addr, port, self.world_size, timeout=timeout,
                              is_master=not agent_hosts and self.rank == 0)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"paratrain/attempt_{attempt}/", store)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size}, "
                f"node {self.node_rank}/{self.num_nodes}) backend={self.backend} device={self.device} "
                f"launcher={self.launcher} master={self.master_addr}:{self.master_port}")


def debug_collectives_requested(flag: bool | None) -> bool:
    """The argument, else PARATRAIN_DEBUG_COLLECTIVES (1/true/yes/on)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("PARATRAIN_DEBUG_COLLECTIVES", "").strip().lower() in ("1", "true", "yes", "on")


def enable_collective_checks() -> None:
    """Make every process group created from now on check, before each collective, that all its
    ranks issue the same one (op, tensor shapes, dtypes, sequence number), and fail at once naming
    both fingerprints ("Detected mismatch between collectives on ranks. Rank 0 is running
    collective: CollectiveFingerPrint(... OpType=ALLREDUCE ...), but Rank 1 ... BROADCAST").

    This is torch's TORCH_DISTRIBUTED_DEBUG=DETAIL: `_new_process_group_helper` in
    torch/distributed/distributed_c10d.py wraps gloo and nccl groups in a ProcessGroupWrapper whose
    checks run over a side gloo group. It costs an extra gather per collective: for debugging. The
    level is set through the API, because torch reads the variable only when it is imported."""
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # for child processes and torch's own checks
    dist.set_debug_level(dist.DebugLevel.DETAIL)


DRAIN_S = 0.05  # at most this long, destroy() lets backend threads drop what they still hold


def destroy() -> None:
    """Tear down the default process group if there is one (and every group made from it),
    never on one of a group's own threads ([Note: a group dropped by its own thread])."""
    if not dist.is_initialized():
        return
    world = getattr(dist.distributed_c10d, "_world", None)  # torch's registry of groups (private)
    groups = list(getattr(world, "pg_map", None) or [dist.group.WORLD])
    dist.destroy_process_group()
    deadline = time.monotonic() + DRAIN_S
    while any(sys.getrefcount(g) > 3 for g in groups) and time.monotonic() < deadline:
        time.sleep(0.001)  # releases the GIL: a gloo thread waiting for it drops its callbacks
    groups.clear()  # here, on this thread, the last reference when nothing else holds one


# [Note: a group dropped by its own thread]
# A comm hook's future callbacks (torch's PowerSGD hook) are Python closures that hold the group
# they issue collectives on. gloo runs them on the group's worker thread, which drops them (taking
# the GIL) only after it has woken whoever waited on the step's future. If the main thread has
# meanwhile destroyed the process group, that closure holds the group's last reference: the
# group's destructor then runs on its own worker thread, joins it, and the process aborts
# ("terminate called after throwing ... Resource deadlock avoided"; seen once in a CI run of
# tests/parallel/test_ddp_comm_hooks.py's PowerSGD case). So destroy() keeps a reference to every group
# across destroy_process_group(), sleeps (releasing the GIL) until the worker threads have
# dropped theirs, at most DRAIN_S, and lets the last one go here. A group the caller still holds
# (a live DDP module) outlives the wait and is destroyed when the caller lets it go.


def resolve_timeout(timeout: float | None) -> float:
    """Seconds a collective may wait: the argument, else PARATRAIN_TIMEOUT, else 600."""
    if timeout is None:
        value = os.environ.get("PARATRAIN_TIMEOUT", DEFAULT_TIMEOUT_S)
        try:
            timeout = float(value)
        except ValueError:
            raise ConfigError(f"PARATRAIN_TIMEOUT={value!r} is not a number of seconds") from None
    if timeout <= 0:
        raise ConfigError(f"timeout must be a positive number of seconds; got {timeout}")
    return timeout


def pick_backend(requested: str | None, local_rank: int) -> tuple[str, torch.device]:
    """nccl + cuda:LOCAL_RANK where CUDA is present, else gloo + cpu; a request is checked."""
    cuda = torch.cuda.is_available()
    backend = (requested or ("nccl" if cuda else "gloo")).lower()
    if backend not in ("nccl", "gloo"):
        raise ConfigError(f"backend must be 'nccl' or 'gloo'; got {backend!r}")
    if backend == "gloo":
        return backend, torch.device("cpu")
    if not cuda:
        raise ConfigError("backend 'nccl' needs CUDA, and this machine has no CUDA device: "
                          "use backend='gloo' (or leave it unset to choose automatically)")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"local rank {local_rank} has no GPU: this node has "
                          f"{torch.cuda.device_count()}; start at most that many processes per node")
    return backend, torch.device("cuda", local_rank)


def _from_spawn(env, rank, world_size, local_world_size) -> dict:
    if rank is None or world_size is None:
        raise ConfigError("pass both rank= and world_size= (as torch.multiprocessing.spawn gives them)")
    lws = local_world_size or world_size
    return dict(rank=rank, local_rank=rank % lws, world_size=world_size, local_world_size=lws,
                node_rank=rank // lws, num_nodes=max(1, world_size // lws), launcher="spawn",
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=int(env.get("MASTER_PORT", 0)))


def _from_torchrun(env) -> dict:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    lws = _int(env, "LOCAL_WORLD_SIZE", world)
    return dict(rank=rank, local_rank=_int(env, "LOCAL_RANK", rank % lws), world_size=world,
                local_world_size=lws, node_rank=_int(env, "GROUP_RANK", rank // lws),
                num_nodes=max(1, world // lws), launcher="torchrun",
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT", 0))


def _from_slurm(env) -> dict:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    nnodes = _int(env, "SLURM_NNODES", _int(env, "SLURM_JOB_NUM_NODES", 1))
    job_id = _int(env, "SLURM_JOB_ID", 0)
    return dict(rank=rank, local_rank=_int(env, "SLURM_LOCALID", 0), world_size=world,
                local_world_size=max(1, world // nnodes), node_rank=_int(env, "SLURM_NODEID", 0),
                num_nodes=nnodes, launcher="slurm",
                master_addr=env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", "")),
                # one port per job, so two jobs sharing a node do not collide
                master_port=_int(env, "MASTER_PORT", 20000 + job_id % 20000))


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[03-05,07],cpu1' → 'gpu03'."""
    if not nodelist:
        return "127.0.0.1"
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    prefix, ranges = match.group(1), match.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def _int(env, name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise ConfigError(f"environment variable {name} is missing; start the job with "
                              "`paratrain run`, torchrun or srun")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def _validate(f: dict) -> None:
    if f["world_size"] < 1 or not 0 <= f["rank"] < f["world_size"]:
        raise ConfigError(f"rank {f['rank']} is not inside a world of size {f['world_size']}")
    if f["world_size"] % f["local_world_size"]:
        raise ConfigError(f"world size {f['world_size']} is not a multiple of the processes per node "
                          f"({f['local_world_size']}): start the same number of processes on every node")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
