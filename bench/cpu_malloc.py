"""Benchmark: what keeping freed large blocks (paratrain/launch/cpu_malloc.py, set by `paratrain run`)
does to a CPU rank's step, against glibc's default.

    python bench/cpu_malloc.py [--rounds 3] [--steps 6] [--warmup 3] [--out bench/results/cpu_malloc.json]

The setting is process-wide, so each job is one process (world 1, one thread, the bench MLP of
18.9 M parameters on 256 rows, Adam) in one mode: `default` (glibc as it starts) or `keep`
(`keep_freed_blocks()` first). Each round runs every strategy in both modes, the order of the
two alternating by round; a job reports the median of its `--steps` step times after `--warmup`,
and its page faults per step (getrusage's minor faults). Before its model, each job also times
Adam over one tensor of 2^24 elements (its temporaries, 64 MiB each, are above glibc's largest
automatic mmap threshold). Reported: the medians over rounds, and keep / default.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, for the ranks too
from common import add_write_options, load_at_start, make_batches, make_model, print_table, write_results  # noqa: E402

import paratrain as pt  # noqa: E402
from paratrain.launch.cpu_malloc import keep_freed_blocks  # noqa: E402
from paratrain.testing import run_on_ranks  # noqa: E402

STRATEGIES, MODES, ADAM_ELEMENTS = ("ddp", "zero1", "zero2", "zero3"), ("default", "keep"), 2**24


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _adam(steps: int) -> tuple[float, float]:
    """Elements/s and page faults per step of Adam over one tensor of ADAM_ELEMENTS."""
    p = torch.nn.Parameter(torch.randn(ADAM_ELEMENTS))
    p.grad = torch.randn(ADAM_ELEMENTS)
    opt = torch.optim.Adam([p], lr=1e-3)
    opt.step()
    faults, started = _faults(), time.perf_counter()
    for _ in range(steps):
        opt.step()
    return ADAM_ELEMENTS * steps / (time.perf_counter() - started), (_faults() - faults) / steps


def _job(topo, strategy: str, mode: str, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    if mode == "keep" and not keep_freed_blocks():
        raise RuntimeError("mallopt refused the thresholds: not glibc?")
    adam_rate, adam_faults = _adam(steps)
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    x, y = make_batches("mlp", 256, 1, seed=0)[0]
    times, faults = [], []
    for i in range(warmup + steps):
        before, started = _faults(), time.perf_counter()
        session.train_step((x, y), lambda out, t: F.cross_entropy(out, t))
        if i >= warmup:
            times.append(time.perf_counter() - started)
            faults.append(_faults() - before)
    return {"step_s": statistics.median(times), "faults": statistics.median(faults), "adam_rate": adam_rate,
            "adam_faults": adam_faults}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "cpu_malloc.json"))
    parser.add_argument("--quick", action="store_true", help="1 round, 2 steps: a smoke check")
    add_write_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 2, 1
    load = load_at_start(args)
    runs: dict = {(s, m): [] for s in STRATEGIES for m in MODES}
    for r in range(args.rounds):
        for strategy in STRATEGIES:
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                runs[strategy, mode].append(run_on_ranks(_job, 1, strategy, mode, args.steps, args.warmup,
                                                         threads=1, timeout=600)[0])
    rows = []
    for strategy in STRATEGIES:
        row: dict = {"strategy": strategy}
        for mode in MODES:
            for key in ("step_s", "faults", "adam_rate", "adam_faults"):
                row[f"{mode}_{key}"] = statistics.median(j[key] for j in runs[strategy, mode])
        row["step_ratio"] = row["keep_step_s"] / row["default_step_s"]
        row["adam_ratio"] = row["keep_adam_rate"] / row["default_adam_rate"]
        rows.append(row)
    print_table(rows, [("strategy", "strategy", ""), ("default_step_s", "default s", ".3f"),
                       ("keep_step_s", "keep s", ".3f"), ("step_ratio", "keep/default", ".3f"),
                       ("default_faults", "faults default", ".0f"), ("keep_faults", "faults keep", ".0f"),
                       ("default_adam_rate", "adam default/s", ".3g"), ("keep_adam_rate", "adam keep/s", ".3g")])
    write_results(args, dict(world=1, threads_per_rank=1, model="mlp", batch=256, rounds=args.rounds,
                             steps=args.steps, warmup=args.warmup, adam_elements=ADAM_ELEMENTS), load, ranks=1,
                  results=rows)


if __name__ == "__main__":
    main()
