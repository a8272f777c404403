"""Benchmark: how long `paratrain run` takes to start a job and to end it, against torchrun.

    python bench/launch.py [--rounds 12] [-n 2] [--out bench/results/launch.json] [--quick]

Each round launches the same script once with each launcher, the order alternating by round:

    torchrun    python -m torch.distributed.run --standalone --nproc-per-node N script.py
    paratrain   python -m paratrain run -n N script.py

The script (SCRIPT) is a training script with no training in it: `import paratrain`, a
`Session("ddp")` (the process group, one barrier), `close()`. Each rank writes the wall-clock
times of its first line, the end of its imports and its last line. Reported per launcher, as
medians over rounds (the slowest rank's time where the ranks differ):

    start     the launch command until the script's first line runs
    imports   its first line until `import paratrain` is done
    script    its imports until its last line (the session: process group, barrier, close)
    exit      its last line until the launch command has exited
    total     the launch command until it has exited

and the ratio of the totals, paratrain / torchrun: a job's fixed cost, paid by every
`paratrain run` and twice by every `paratrain verify` of one strategy. paratrain's bytecode is
written first, as `pip install` writes it (where PYTHONDONTWRITEBYTECODE is set, as on the
development machines, every process would otherwise compile paratrain from source: ~0.3 s each).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py
from common import add_write_options, load_at_start, print_table, write_results  # noqa: E402

import paratrain  # noqa: E402

SCRIPT = '''\
import time
first = time.time()
import json, os, sys
import paratrain as pt
imported = time.time()
session = pt.Session("ddp", progress_bar=False)
session.close()
times = dict(first=first, imported=imported, last=time.time())
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(times, f)
'''

LAUNCHERS = {
    "torchrun": lambda n: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(n)],
    "paratrain": lambda n: [sys.executable, "-m", "paratrain", "run", "-n", str(n)],
}
PHASES = ("start", "imports", "script", "exit", "total")


def launch(name: str, n: int, script: Path, directory: Path) -> dict[str, float]:
    """One job under launcher `name`; the seconds of each phase (PHASES)."""
    for old in directory.glob("*.json"):
        old.unlink()
    env = dict(os.environ, OMP_NUM_THREADS="1")  # torchrun's own default, without its banner
    began = time.time()
    done = subprocess.run([*LAUNCHERS[name](n), str(script), str(directory)], env=env,
                          capture_output=True, text=True, timeout=300)
    ended = time.time()
    if done.returncode != 0:
        raise SystemExit(f"{name} failed with exit status {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    if len(ranks) != n:
        raise SystemExit(f"{name}: {len(ranks)} of {n} ranks wrote their times")
    first = max(r["first"] for r in ranks)
    imported = max(r["imported"] for r in ranks)
    last = max(r["last"] for r in ranks)
    return dict(start=first - began, imports=imported - first, script=last - imported, exit=ended - last,
                total=ended - began)


def bench(args: argparse.Namespace) -> list[dict]:
    compileall.compile_dir(os.path.dirname(paratrain.__file__), quiet=1)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-launch-") as tmp:
        script, directory = Path(tmp) / "script.py", Path(tmp) / "times"
        script.write_text(SCRIPT)
        directory.mkdir()
        order = list(LAUNCHERS)
        for round_ in range(args.warmup + args.rounds):
            for name in order if round_ % 2 == 0 else order[::-1]:
                times = launch(name, args.nproc_per_node, script, directory)
                if round_ >= args.warmup:
                    samples[name].append(times)
            print(f"round {round_ + 1 - args.warmup} of {args.rounds}" if round_ >= args.warmup else "warm-up",
                  flush=True)
    rows = []
    for name, runs in samples.items():
        row = dict(launcher=name, processes=args.nproc_per_node)
        row.update({f"{phase}_s": statistics.median(r[phase] for r in runs) for phase in PHASES})
        row["total_s_min"], row["total_s_max"] = min(r["total"] for r in runs), max(r["total"] for r in runs)
        rows.append(row)
    reference = rows[0]["total_s"]
    for row in rows:
        row["ratio"] = row["total_s"] / reference
    return rows


def _parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds, each one job per launcher")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("-n", "--nproc-per-node", type=int, default=2, help="ranks per job")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "launch.json"),
                        help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="2 rounds, no warm-up: a smoke check")
    add_write_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup = 2, 0
    if args.rounds < 1 or args.warmup < 0 or args.nproc_per_node < 1:
        parser.error("--rounds and -n must be at least 1, --warmup at least 0")
    return args


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = load_at_start(args)
    rows = bench(args)
    print_table(rows, [("launcher", "launcher", ""), ("processes", "ranks", "d")]
                + [(f"{p}_s", f"{p} s", ".2f") for p in PHASES] + [("ratio", "ratio", ".3f")])
    settings = dict(rounds=args.rounds, warmup=args.warmup, processes=args.nproc_per_node,
                    script="import paratrain; Session('ddp'); close()", python=sys.version.split()[0])
    write_results(args, settings, load_before, ranks=args.nproc_per_node, results=rows)


if __name__ == "__main__":
    main()
