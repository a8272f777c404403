"""`paratrain run`: start a job through PyTorch's elastic launcher (torch.distributed.run).

It builds an argument list for torchrun and calls its `main`, so the elastic agent starts the N
workers per node, watches them, restarts the group up to `--max-restarts` times, and kills the
survivors when one rank fails: no orphans, no home-made process manager. What torchrun reports
as `ChildFailedError` becomes a short summary naming the rank at fault (debug/postmortem.py, from the
notes the ranks leave: launch/worker.py), and where each rank was in its collectives (debug/hang_report.py). The ranks die with this process, even when it is SIGKILLed.

Rendezvous: one node with no --master-port, torchrun's standalone c10d rendezvous on a free port;
several nodes with --master-addr, a static one (node ranks given); with --rdzv-backend (c10d,
etcd), a dynamic one: nodes join at --rdzv-endpoint under --rdzv-id, --nnodes may be MIN:MAX
(elastic), and torchrun assigns the node ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile

import torch.distributed as dist
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError

from paratrain.debug import postmortem
from paratrain.distributed.topology import pick_backend
from paratrain.errors import ConfigError
from paratrain.launch import cpu_malloc, stopped, worker

TORCHRUN_DEFAULT_PORT = 29500  # what torchrun uses for a static rendezvous with no --master-port
PASSED_THROUGH = ("log_dir", "redirects", "tee", "local_addr")  # torchrun's own, unchanged

def run(args: argparse.Namespace) -> int:
    """Launch the job; return the exit status (0, or the status of the rank the summary names)."""
    _check_run_args(args)
    export_env(args)
    notes = tempfile.mkdtemp(prefix="paratrain-run-")  # the ranks' last words (launch/worker.py)
    os.environ[worker.REPORT_DIR] = notes
    try:
        with stopped.wake_stopped(notes):  # a stopped rank ends at once, not 30 s later (launch/stopped.py)
            torchrun.main(torchrun_argv(args))
    except ChildFailedError as e:
        return postmortem.report(e, notes)
    except SignalException as e:  # the agent has already stopped the workers (SIGTERM, then SIGKILL)
        return _stopped_by(e.sigval, *worker.preempted_ranks(notes), local_ranks=args.nproc_per_node)
    except (RendezvousError, dist.DistError) as e:  # the agents never met; no worker started
        _report_no_meeting(args, e)
        return 1
    finally:
        shutil.rmtree(notes, ignore_errors=True)
    return 0


def _stopped_by(sigval: signal.Signals, preempted: dict[int, str], failed: dict[int, str], *,
                local_ranks: int) -> int:
    """0 when every rank here checkpointed on the signal and left on its own (Session(
    checkpoint_on_preempt=...)): the job stopped as asked and resumes from that checkpoint; else
    the shell's status for a process killed by the signal, with why the ranks' checkpoint on the
    signal failed (`failed`: rank → error) where one did."""
    if len(preempted) >= local_ranks and not failed:
        print(f"paratrain run: stopped by {sigval.name}; every rank checkpointed "
              f"({next(iter(preempted.values()))}) and exited 0", file=sys.stderr)
        return 0
    line = f"paratrain run: stopped by {sigval.name}"
    if failed:
        errors = {error: [r for r, e in sorted(failed.items()) if e == error] for error in failed.values()}
        why = "; ".join(f"{'ranks' if len(r) > 1 else 'rank'} {', '.join(map(str, r))}: {error}"
                        for error, r in errors.items())
        line += (f"; the checkpoint on {sigval.name} failed ({why}). A resume starts from the newest checkpoint "
                 "saved before it")
    print(line, file=sys.stderr)
    return 128 + int(sigval)


def _report_no_meeting(args: argparse.Namespace, error: Exception) -> None:
    if _port_taken(error):  # node 0's agent could not host the store (torch's TCPStore server)
        print(f"paratrain run: port {args.master_port or TORCHRUN_DEFAULT_PORT} on "
              f"{args.master_addr or '127.0.0.1'} is already in use; pass another --master-port "
              "(or leave it out on a single node, which picks a free port)", file=sys.stderr)
        return
    print(f"paratrain run: the nodes could not meet: {error}\n"
          "paratrain run: start every node with the same --nnodes, --master-addr and --master-port, "
          "and check that node 0 is reachable at that address", file=sys.stderr)


def _port_taken(error: BaseException | None) -> bool:
    """EADDRINUSE anywhere in the chain: torch says "name: EADDRINUSE, message: address already in use"."""
    while error is not None:
        if "EADDRINUSE" in str(error) or "address already in use" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def node_counts(nnodes: str) -> tuple[int, int]:
    """(fewest, most) nodes from "M" or "MIN:MAX"."""
    try:
        low, _, high = str(nnodes).partition(":")
        counts = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"--nnodes takes a number of nodes or MIN:MAX; got {nnodes!r}") from None
    if not 1 <= counts[0] <= counts[1]:
        raise ConfigError(f"--nnodes must be at least 1 (and MIN <= MAX); got {nnodes}")
    return counts


def _check_run_args(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise ConfigError(f"-n must be at least 1 process per node; got {args.nproc_per_node}")
    fewest, most = node_counts(args.nnodes)
    if args.rdzv_backend:
        if not args.rdzv_endpoint:
            raise ConfigError(f"--rdzv-backend {args.rdzv_backend} needs --rdzv-endpoint HOST:PORT, where the nodes meet")
    elif fewest != most:
        raise ConfigError(f"--nnodes {args.nnodes} (elastic) needs a dynamic rendezvous: --rdzv-backend c10d "
                          "--rdzv-endpoint HOST:PORT")
    elif not 0 <= args.node_rank < fewest:
        raise ConfigError(f"--node-rank must be in 0 … {fewest - 1} for --nnodes {fewest}; got {args.node_rank}")
    _check_static(args, fewest)
    _check_limits(args)


def _check_static(args: argparse.Namespace, nnodes: int) -> None:
    if nnodes > 1 and not args.master_addr and not args.rdzv_backend:
        raise ConfigError(f"--nnodes {nnodes} needs --master-addr: the address of node 0, "
                          "which every node must be able to reach")


def _check_limits(args: argparse.Namespace) -> None:
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ConfigError(f"--master-port must be in 1 … 65535; got {args.master_port}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more; got {args.max_restarts}")
    if args.flight_recorder is not None and args.flight_recorder < 0:
        raise ConfigError(f"--flight-recorder is a number of collectives to keep, 0 or more; got {args.flight_recorder}")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds; got {args.timeout:g}")
    if args.backend:
        pick_backend(args.backend, args.nproc_per_node - 1)  # nccl needs one GPU per process
    if not args.module and not os.path.isfile(args.target):
        raise ConfigError(f"script {args.target!r} not found (to run a module, pass -m {args.target})")


def export_env(args: argparse.Namespace) -> None:
    """Settings for the workers travel as environment variables, which the agent passes on."""
    if args.timeout is not None:
        os.environ["PARATRAIN_TIMEOUT"] = str(args.timeout)
    if args.backend:
        os.environ["PARATRAIN_BACKEND"] = args.backend
    if args.flight_recorder is not None:  # read when a rank imports paratrain (debug/flight_recorder.py)
        os.environ["PARATRAIN_FLIGHT_RECORDER"] = str(args.flight_recorder)
    if args.debug_collectives:  # read by Topology.init, before the process group exists
        os.environ["PARATRAIN_DEBUG_COLLECTIVES"] = "1"
    os.environ[worker.LAUNCHER_PID] = str(os.getpid())  # the ranks die with this process (launch/worker.py)
    # torchrun would set 1 and print a warning banner; share this node's cores instead
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))
    cpu_malloc.launch_env(os.environ)  # freed large blocks stay in the heap for the next step (launch/cpu_malloc.py)


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The `torchrun` command line that does what `args` asks."""
    argv = ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts)]
    if args.rdzv_backend:  # dynamic: torchrun assigns node ranks as the nodes join
        argv += ["--rdzv-backend", args.rdzv_backend, "--rdzv-endpoint", args.rdzv_endpoint,
                 "--rdzv-id", args.rdzv_id or "paratrain", "--nnodes", str(args.nnodes)]
    elif node_counts(args.nnodes)[0] == 1 and args.master_port is None:
        # c10d rendezvous on a free port: two single-node jobs on one machine never collide
        argv += ["--standalone"]
    else:
        # static rendezvous: node 0 hosts the store at master-addr:master-port, ranks follow node rank
        argv += ["--rdzv-backend", "static", "--nnodes", str(args.nnodes),
                 "--node-rank", str(args.node_rank),
                 "--master-addr", args.master_addr or "127.0.0.1",
                 "--master-port", str(args.master_port or TORCHRUN_DEFAULT_PORT)]
    for name in PASSED_THROUGH:
        if getattr(args, name):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    # every rank starts in launch/rank.py, which attaches the worker and the flight recorder and
    # then runs the target; after "--" torchrun's parser reads none of the script's arguments
    # (`--n 5` would be an ambiguous abbreviation of its --nnodes/--nproc-per-node)
    return argv + ["-m", "paratrain.launch.rank", "--", *(["-m"] if args.module else []), args.target, *args.args]
