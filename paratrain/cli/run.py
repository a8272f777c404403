"""`paratrain run`'s command line: its options and their help (argparse only; what they do:
launch/run.py)."""

from __future__ import annotations

import argparse

from paratrain.launch.run import TORCHRUN_DEFAULT_PORT

RUN_EPILOG = """\
examples:
  paratrain run -n 4 train.py --epochs 3          4 processes on this machine
  paratrain run -n 2 -m paratrain env             run a module, as `python -m` does
  paratrain run --nnodes 2 --node-rank 0 -n 8 --master-addr 10.0.0.1 --master-port 29500 train.py
                                                  node 0 of 2 (run --node-rank 1 on the other node)

  paratrain run --nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7 -n 8 train.py
                                                  elastic: 1 to 4 nodes join at the endpoint

SLURM: either let srun start one launcher per node,
  srun --nodes 2 --ntasks-per-node 1 paratrain run --nnodes 2 --node-rank $SLURM_NODEID \
       -n 8 --master-addr $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1) train.py
or let srun start every rank itself, with no launcher: `srun --ntasks-per-node 8 python train.py`
(paratrain reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and the node list).

Everything after the script (or module) name is passed to it unchanged. Nodes wait up to 900 s
for each other (torchrun's static rendezvous; PET_RDZV_CONF=timeout=SECONDS changes it)."""


def add_run_parser(commands) -> None:
    run = commands.add_parser(
        "run", help="start N processes per node through torch.distributed.run (torchrun)",
        description="Start a training script on N processes per node through PyTorch's elastic "
        "launcher (torch.distributed.run).", epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("-n", "--nproc-per-node", type=int, default=1, metavar="N",
                     help="processes on this node (default: 1)")
    run.add_argument("--nnodes", default="1", metavar="M",
                     help="number of nodes, or MIN:MAX for an elastic job with --rdzv-backend (default: 1)")
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
    run.add_argument("--flight-recorder", type=int, metavar="N",
                     help="each rank keeps its last N collectives for the failure report; 0 turns it off "
                          "(exported as PARATRAIN_FLIGHT_RECORDER; default: 512)")
    run.add_argument("--backend", choices=("gloo", "nccl"),
                     help="exported as PARATRAIN_BACKEND (default: nccl with CUDA, else gloo)")
    run.add_argument("--rdzv-backend", metavar="NAME", help="dynamic rendezvous (c10d, etcd): nodes join at "
                     "--rdzv-endpoint under --rdzv-id and get their node ranks there")
    run.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where nodes meet (with --rdzv-backend)")
    run.add_argument("--rdzv-id", metavar="ID", help="the job's id at the endpoint (with --rdzv-backend)")
    for flag, what in (("--log-dir", "write each rank's output there"),
                       ("--redirects", "redirect ranks' stdout/stderr to files (0-3, or rank:n,…)"),
                       ("--tee", "copy ranks' stdout/stderr to files and the console"),
                       ("--local-addr", "this node's address for the rendezvous")):
        run.add_argument(flag, metavar="VALUE", help=f"torchrun's {flag}: {what}")
    run.add_argument("-m", "--module", action="store_true",
                     help="the target is a module to run as `python -m` does")
    run.add_argument("target", metavar="script.py | module", help="the script (or module) to run")
    rest = run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script, unchanged")
    rest.required = False  # argparse counts an empty REMAINDER as missing
