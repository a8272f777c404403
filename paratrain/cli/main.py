"""The `paratrain` command: `run` starts a job through PyTorch's elastic launcher (launch/run.py),
`verify` checks a job on N processes against one (cli/verify.py, debug/verify.py), `env` shows what a rank sees
(cli/env.py), `ckpt info|export` what a checkpoint holds and its model as one file (cli/ckpt.py),
`plan` what a training step of a model costs, and `plan --calibrate` this machine (cli/plan.py).

Bad input exits with status 2 and one line saying what to change (as argparse does).

[Note: a quick exit]
A Python process that has imported torch spends most of a second leaving: the interpreter's last
collections walk, and free, every object the imports made (some 170,000: torch's modules,
functions and classes). So the `paratrain` command moves what exists once its imports are done
into the collector's permanent generation (gc.freeze): no collection walks them again, and at
exit they are left to the operating system (a job of two ranks that does nothing ends 0.6-0.7 s
sooner on 2 cores: README "Starting and ending a job"). No user code has run in this process by
then, and what the command makes afterwards (`plan` imports the user's model) is collected as
before. The ranks are left as Python has them: there a reference cycle the script keeps in a
global is freed only by those last collections, and an open file in it would lose its buffered
lines (tests/cli/test_cli.py); Python does not promise to finalize such objects, but scripts rely on it.
"""

from __future__ import annotations

import argparse
import gc
import sys
from importlib import metadata

import torch

from paratrain.cli.ckpt import add_ckpt_parser, ckpt
from paratrain.cli.env import env
from paratrain.cli.plan import add_plan_parser, plan
from paratrain.cli.run import add_run_parser
from paratrain.cli.verify import add_verify_parser, verify
from paratrain.errors import ParatrainError
from paratrain.launch.run import run


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage block), exit status 2, and which
    takes no abbreviated options: everything after a script's name is the script's (`paratrain run
    -n 2 train.py --n 5` gives train.py `--n 5`), and argparse matches abbreviations against every
    word, the script's included (`--n` "could match --nnodes, --nproc-per-node")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paratrain", description="Launch and inspect paratrain jobs.")
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,verify,env,ckpt,plan}",
                                     parser_class=_Parser)
    add_run_parser(commands)
    add_verify_parser(commands)
    commands.add_parser("env", help="print what a script would see: ranks, groups, backend, device",
                        description="Print this process's place in the job (rank, local rank, "
                        "world, node, backend, device, groups), one line prefixed by the rank.")
    add_ckpt_parser(commands)
    add_plan_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:  # this process is the `paratrain` command, not a caller's: [Note: a quick exit]
        gc.freeze()
    try:
        if args.command == "run":
            sys.exit(run(args))
        if args.command == "verify":
            sys.exit(verify(args))
        if args.command == "ckpt":
            return ckpt(args)
        if args.command == "plan":
            return plan(args)
        env()
    except ParatrainError as e:  # a bad argument, or what it names (a damaged checkpoint): one line
        parser.exit(2, f"paratrain {args.command}: error: {e}\n")


def _version() -> str:
    try:
        version = metadata.version("paratrain")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return f"paratrain {version} (torch {torch.__version__})"
