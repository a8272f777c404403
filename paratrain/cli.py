"""`paratrain run` starts a job through PyTorch's elastic launcher; `paratrain env` shows what a rank sees.

`paratrain run` builds an argument list for `torch.distributed.run` (torchrun) and calls its
`main`, so the elastic agent starts the N workers per node, watches them, restarts the group up
to `--max-restarts` times, and kills the survivors when one rank fails: no orphans, no
home-made process manager. What torchrun reports as `ChildFailedError` becomes a short summary
naming the rank at fault (postmortem.py, from the notes the ranks leave: worker.py) and a
non-zero exit status. The ranks die with this process, even when it is SIGKILLed (worker.py).

Bad input exits with status 2 and one line saying what to change (as argparse does).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from importlib import metadata

import torch
import torch.distributed as dist
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError

from paratrain import postmortem, worker
from paratrain.errors import ConfigError
from paratrain.grid import ProcessGrid
from paratrain.topology import Topology, pick_backend, resolve_timeout

TORCHRUN_DEFAULT_PORT = 29500  # what torchrun uses for a static rendezvous with no --master-port

RUN_EPILOG = """\
examples:
  paratrain run -n 4 train.py --epochs 3          4 processes on this machine
  paratrain run -n 2 -m paratrain env             run a module, as `python -m` does
  paratrain run --nnodes 2 --node-rank 0 -n 8 --master-addr 10.0.0.1 --master-port 29500 train.py
                                                  node 0 of 2 (run --node-rank 1 on the other node)

Everything after the script (or module) name is passed to it unchanged. Nodes wait up to 900 s
for each other (torchrun's static rendezvous; PET_RDZV_CONF=timeout=SECONDS changes it)."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paratrain", description="Launch and inspect paratrain jobs.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,env}",
                                     parser_class=_Parser)
    _add_run_parser(commands)
    commands.add_parser("env", help="print what a script would see: ranks, groups, backend, device",
                        description="Print this process's place in the job (rank, local rank, "
                        "world, node, backend, device, groups), one line prefixed by the rank.")
    return parser


def _add_run_parser(commands) -> None:
    run = commands.add_parser(
        "run", help="start N processes per node through torch.distributed.run (torchrun)",
        description="Start a training script on N processes per node through PyTorch's elastic "
        "launcher (torch.distributed.run).", epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("-n", "--nproc-per-node", type=int, default=1, metavar="N",
                     help="processes on this node (default: 1)")
    run.add_argument("--nnodes", type=int, default=1, metavar="M", help="number of nodes (default: 1)")
    run.add_argument("--node-rank", type=int, default=0, metavar="I",
                     help="this node's index, 0 … M-1 (default: 0)")
    run.add_argument("--master-addr", metavar="ADDR",
                     help="address of node 0; required when --nnodes > 1")
    run.add_argument("--master-port", type=int, metavar="PORT",
                     help=f"port on node 0 (default: a free port on one node, "
                     f"{TORCHRUN_DEFAULT_PORT} on several)")
    run.add_argument("--max-restarts", type=int, default=0, metavar="R",
                     help="restart the whole group up to R times after a failure (default: 0)")
    run.add_argument("--timeout", type=float, metavar="SECONDS",
                     help="every collective gives up after this long (exported as PARATRAIN_TIMEOUT; "
                     "default: 600)")
    run.add_argument("--debug-collectives", action="store_true",
                     help="check that every rank issues the same collective and fail naming both when they "
                          "differ, instead of hanging (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL; slower)")
    run.add_argument("--backend", choices=("gloo", "nccl"),
                     help="exported as PARATRAIN_BACKEND (default: nccl with CUDA, else gloo)")
    run.add_argument("-m", "--module", action="store_true",
                     help="the target is a module to run as `python -m` does")
    run.add_argument("target", metavar="script.py | module", help="the script (or module) to run")
    rest = run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script, unchanged")
    rest.required = False  # argparse counts an empty REMAINDER as missing


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            sys.exit(run(args))
        env()
    except ConfigError as e:
        parser.exit(2, f"paratrain {args.command}: error: {e}\n")


def run(args: argparse.Namespace) -> int:
    """Launch the job; return the exit status (0, or the status of the rank the summary names)."""
    _check_run_args(args)
    _export_env(args)
    notes = tempfile.mkdtemp(prefix="paratrain-run-")  # the ranks' last words (worker.py)
    os.environ[worker.REPORT_DIR] = notes
    try:
        torchrun.main(torchrun_argv(args))
    except ChildFailedError as e:
        return postmortem.report(e, notes)
    except SignalException as e:  # the agent has already stopped the workers
        print(f"paratrain run: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    except (RendezvousError, dist.DistError) as e:  # the agents never met; no worker started
        _report_no_meeting(args, e)
        return 1
    finally:
        shutil.rmtree(notes, ignore_errors=True)
    return 0


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


def _check_run_args(args: argparse.Namespace) -> None:
    if args.nproc_per_node < 1:
        raise ConfigError(f"-n must be at least 1 process per node; got {args.nproc_per_node}")
    if args.nnodes < 1:
        raise ConfigError(f"--nnodes must be at least 1; got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be in 0 … {args.nnodes - 1} for --nnodes {args.nnodes}; "
                          f"got {args.node_rank}")
    if args.nnodes > 1 and not args.master_addr:
        raise ConfigError(f"--nnodes {args.nnodes} needs --master-addr: the address of node 0, "
                          "which every node must be able to reach")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise ConfigError(f"--master-port must be in 1 … 65535; got {args.master_port}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more; got {args.max_restarts}")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds; got {args.timeout:g}")
    if args.backend:
        pick_backend(args.backend, args.nproc_per_node - 1)  # nccl needs one GPU per process
    if not args.module and not os.path.isfile(args.target):
        raise ConfigError(f"script {args.target!r} not found (to run a module, pass -m {args.target})")


def _export_env(args: argparse.Namespace) -> None:
    """Settings for the workers travel as environment variables, which the agent passes on."""
    if args.timeout is not None:
        os.environ["PARATRAIN_TIMEOUT"] = str(args.timeout)
    if args.backend:
        os.environ["PARATRAIN_BACKEND"] = args.backend
    if args.debug_collectives:  # read by Topology.init, before the process group exists
        os.environ["PARATRAIN_DEBUG_COLLECTIVES"] = "1"
    os.environ[worker.LAUNCHER_PID] = str(os.getpid())  # the ranks die with this process (worker.py)
    # torchrun would set 1 and print a warning banner; share this node's cores instead
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)))


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The `torchrun` command line that does what `args` asks."""
    argv = ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts)]
    if args.nnodes == 1 and args.master_port is None:
        # c10d rendezvous on a free port: two single-node jobs on one machine never collide
        argv += ["--standalone"]
    else:
        # static rendezvous: node 0 hosts the store at master-addr:master-port, ranks follow node rank
        argv += ["--rdzv-backend", "static", "--nnodes", str(args.nnodes),
                 "--node-rank", str(args.node_rank),
                 "--master-addr", args.master_addr or "127.0.0.1",
                 "--master-port", str(args.master_port or TORCHRUN_DEFAULT_PORT)]
    if args.module:
        argv += ["-m"]
    return argv + [args.target, *args.args]


def env() -> None:
    """Print one line describing this process; under a launcher every rank prints its own."""
    topo = Topology.from_env()
    grid = ProcessGrid(topo)  # the ranks of this rank's groups; builds none (grid.py)
    intra, inter = grid.ranks("local"), grid.ranks("node")
    fields = dict(
        rank=topo.rank, local_rank=topo.local_rank, world_size=topo.world_size,
        local_world_size=topo.local_world_size, node_rank=topo.node_rank, nodes=topo.num_nodes,
        backend=topo.backend, device=topo.device, launcher=topo.launcher,
        master=f"{topo.master_addr}:{topo.master_port}", timeout=f"{resolve_timeout(None):g}s",
        intra_node_ranks=",".join(map(str, intra)), inter_node_ranks=",".join(map(str, inter)),
    )
    line = f"[rank {topo.rank}] " + " ".join(f"{k}={v}" for k, v in fields.items())
    sys.stdout.write(line + "\n")  # one write, so the ranks' lines do not interleave
    sys.stdout.flush()


def _version() -> str:
    try:
        version = metadata.version("paratrain")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"paratrain {version} (torch {torch.__version__})"
