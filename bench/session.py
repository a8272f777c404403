"""Benchmark: what `Session.train_step` costs over the plain loop it replaces, same wrapper.

    python bench/session.py [--rounds 200] [--steps 1] [--tiny-steps 50] [--batch 128]
                            [--out bench/results/session.json] [--quick]
    python bench/session.py --no-nan-check --out bench/results/session_no_nan_check.json
    python bench/session.py --control --out /tmp/control.json    # an A/A run (below)
    python bench/session.py --glibc-malloc --out /tmp/glibc.json     # ranks with glibc's default malloc

World 2 on gloo, one thread per rank, ranks started by `paratrain.testing.run_on_ranks`. For
each model (bench/common.py's MLP of 18.9 M parameters and GPT of 9.7 M, and a tiny MLP
64 → 128 → 10 at 32 rows per rank) and each case:

    ddp           plain: pt.DistributedDataParallel, loss.backward(), step, zero_grad
    zero2, zero3  plain: pt.shard(model, optimizer, stage=2|3), the same loop
    ddp-acc4      plain: 4 micro-batches, no_sync() on the first 3, each loss / 4, then the step

against `Session(strategy, accumulate=…)` with the same model copy and optimizer settings calling
`session.train_step((x, y), loss_fn)` once per micro-batch, with every check on (nan_check,
the finite-gradient check, the loss checks; `--no-nan-check` turns them off, to show what they
cost: one read of the gradients this rank holds per optimizer step and, where they are sharded,
one all-reduce of a flag; `--control` puts a second plain loop in the session's place, an A/A
run: what this benchmark reads for two identical loops). Each rank keeps freed large blocks for
the next step, as `paratrain run` starts ranks (paratrain/launch/cpu_malloc.py), both loops alike;
`--glibc-malloc` leaves glibc's default mmap threshold instead, under which ZeRO-3's session
read 1-2 % dearer than its plain loop with every check off and with equal thread CPU time
(README, "`Session.train_step` against the plain loop it replaces").
Both sides see the same batches; after `--warmup`
untimed optimizer steps each (10 × as many for the tiny model), `--rounds` interleaved rounds of
`--steps` optimizer steps each (`--tiny-steps` for the tiny model, whose step is ~2 ms)
(bench/common.py `time_interleaved`; a step as long as its slowest rank; a round's time the median of its steps),
half of them in a job that builds the plain loop's model first and half in one that builds the
session's first (ORDERS).

Reported per case: plain and session ms per optimizer step (medians), the time the session adds
per optimizer step — the median over rounds of the round's session time minus its plain time
(`paired_difference`), shown per micro-batch — and the ratio 1 + that / plain (the ratio of the
two medians is kept as ratio_of_medians: drift between blocks moves it by a few %) with its
standard error (ratio_error), and max_param_diff (both did the same steps from the same start).
Targets: ratio <= 1.02 on the MLP and the GPT, <= 0.1 ms added per micro-batch on the
tiny model.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, for the ranks too
from common import (  # noqa: E402
    MODELS,
    SEQ,
    bench_parser,
    load_at_start,
    loss_of,
    make_batches,
    parse_bench_args,
    print_table,
    summarize_times,
    time_interleaved,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.launch.cpu_malloc import keep_freed_blocks  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

WORLD, THREADS, LR, DATA_BATCHES = 2, 1, 1e-3, 4
CASES = {"ddp": ("ddp", 1), "zero2": ("zero2", 1), "zero3": ("zero3", 1), "ddp-acc4": ("ddp", 4)}
# Each case runs as two jobs of half the rounds: the plain loop's model built first, then the
# session's first. Which of two identical models a process builds first moved their ratio by
# about 1.3 % (GPT ddp-acc4, 3 jobs each way: 1.005-1.023 plain first, 1.025-1.057 session first).
ORDERS = (False, True)
TINY_BATCH = 32


def tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return tiny() if name == "tiny" else MODELS[name]()


def _batches(name: str, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if name != "tiny":
        return make_batches(name, batch, DATA_BATCHES, seed)
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(TINY_BATCH, 64, generator=g), torch.randint(0, 10, (TINY_BATCH,), generator=g))
            for _ in range(DATA_BATCHES)]


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def _plain(model: nn.Module, strategy: str, accumulate: int):
    """The loop a user writes with the wrapper `strategy` uses; returns (step(x, y), module)."""
    if strategy == "ddp":
        wrapped = pt.DistributedDataParallel(model)
        opt = _optimizer(wrapped)
    else:
        wrapped, opt = pt.shard(model, _optimizer(model), stage=int(strategy[-1]))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for micro, (xm, ym) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
            if micro < accumulate - 1:
                with wrapped.no_sync():
                    (loss_of(wrapped, xm, ym) / accumulate).backward()
            else:
                loss = loss_of(wrapped, xm, ym) / accumulate
                loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, wrapped


def _session(topo, model: nn.Module, strategy: str, accumulate: int, nan_check: bool = True,
             control: bool = False):
    """(step(x, y), the full state dict's maker); `control`: a second plain loop instead."""
    if control:
        step, wrapped = _plain(model, strategy, accumulate)
        return step, functools.partial(pt.full_state_dict, wrapped)
    session = pt.Session(strategy, accumulate=accumulate, topology=topo, progress_bar=False, nan_check=nan_check)
    wrapped, _ = session.setup(model, _optimizer(model))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate)):
            loss = session.train_step((xm, ym), _loss)
        return loss

    return step, session.full_state_dict


def speed(topo, name: str, case: str, batch: int, warmup: int, rounds: int, steps: int, nan_check: bool,
          session_first: bool = False, control: bool = False, keep_blocks: bool = False) -> dict:
    """Both loops on deep copies of one model, interleaved; the parameters compared after.
    `session_first`: the session's copy is built first (see ORDERS)."""
    if keep_blocks and not keep_freed_blocks():
        raise RuntimeError("mallopt refused to raise the mmap threshold (run with --glibc-malloc to go without)")
    strategy, accumulate = CASES[case]
    model = _model(name)
    if session_first:
        ours, ours_state = _session(topo, copy.deepcopy(model), strategy, accumulate, nan_check, control)
    plain, wrapped = _plain(copy.deepcopy(model), strategy, accumulate)
    if not session_first:
        ours, ours_state = _session(topo, copy.deepcopy(model), strategy, accumulate, nan_check, control)
    # one optimizer step takes `accumulate` micro-batches of the per-rank batch
    data = [(torch.cat([x] * accumulate), torch.cat([y] * accumulate))
            for x, y in _batches(name, batch, seed=100 + topo.rank)]
    timed = time_interleaved({"plain": plain, "session": ours}, data, warmup=warmup, rounds=rounds, steps=steps)
    return dict(**timed, diff=max_param_diff(pt.full_state_dict(wrapped), ours_state()))


def bench_case(name: str, case: str, args) -> dict:
    # a tiny step is ~2 ms: its rounds take --tiny-steps steps, so each lasts about half a second
    steps, warmup = (args.tiny_steps, 10 * args.warmup) if name == "tiny" else (args.steps, args.warmup)
    jobs = [run_on_ranks(speed, WORLD, name, case, args.batch, warmup, max(1, args.rounds // len(ORDERS)), steps,
                         not args.no_nan_check, session_first, args.control, args.keep_freed_blocks,
                         threads=THREADS, timeout=1200, collective_timeout=300)
            for session_first in ORDERS]
    results = [dict(times={impl: [t for job in ranks for t in job["times"][impl]] for impl in ("plain", "session")},
                    cpu={impl: [t for job in ranks for t in job["cpu"][impl]] for impl in ("plain", "session")},
                    diff=max(job["diff"] for job in ranks))
               for ranks in zip(*jobs)]  # each rank's rounds of both jobs
    times = summarize_times(results, ["plain", "session"], steps)
    accumulate = CASES[case][1]
    added, spread = paired_difference(times["plain_round_ms"], times["session_round_ms"])
    return dict(model=name, case=case, accumulate=accumulate, ratio=1 + added / times["plain_ms"],
                ratio_error=spread / times["plain_ms"], added_ms_per_microbatch=added / accumulate,
                ratio_of_medians=times["session_ms"] / times["plain_ms"],
                max_param_diff=max(r["diff"] for r in results), **times)


def paired_difference(plain_rounds: list[float], session_rounds: list[float]) -> tuple[float, float]:
    """The median over rounds of (session − plain), and its standard error (1.2533 σ/√n, the
    median's for normal noise): each round's two blocks ran back to back (which first
    alternates), so the machine's drift over a run, several % here, cancels in each difference
    where it would not between two medians."""
    differences = [s - p for p, s in zip(plain_rounds, session_rounds)]
    spread = statistics.stdev(differences) if len(differences) > 1 else float("nan")
    return statistics.median(differences), 1.2533 * spread / len(differences) ** 0.5


def _parse_args(argv) -> argparse.Namespace:
    parser = bench_parser(__doc__, out_name="session.json", rounds=200, steps=1, warmup=3, batch=128)
    parser.add_argument("--models", nargs="+", default=["tiny", *MODELS], help="models to run")
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="cases to run")
    parser.add_argument("--tiny-steps", type=int, default=50, help="optimizer steps per round for the tiny model")
    parser.add_argument("--no-nan-check", action="store_true",
                        help="the session without its NaN checks (Session(nan_check=False)): what they cost")
    parser.add_argument("--control", action="store_true",
                        help="an A/A run: a second plain loop in the session's place (the benchmark's own bias)")
    parser.add_argument("--glibc-malloc", dest="keep_freed_blocks", action="store_false",
                        help="glibc's default mmap threshold in each rank, not the kept blocks paratrain run sets")
    return parse_bench_args(parser, argv, quick=dict(rounds=2, steps=2, tiny_steps=5, warmup=1, batch=SEQ))


def _report(rows: list[dict]) -> None:
    print_table(rows, [("model", "model", ""), ("case", "case", ""), ("plain_ms", "plain ms", ".2f"),
                       ("session_ms", "session ms", ".2f"), ("ratio", "ratio", ".3f"), ("ratio_error", "±", ".3f"),
                       ("added_ms_per_microbatch", "added ms/mb", ".3f"),
                       ("plain_cpu_ms", "plain cpu", ".2f"), ("session_cpu_ms", "session cpu", ".2f"),
                       ("max_param_diff", "max diff", ".1e")])
    missed = [f"{r['model']} {r['case']}: ratio {r['ratio']:.3f} > 1.02" for r in rows
              if r["model"] != "tiny" and r["ratio"] > 1.02]
    missed += [f"tiny {r['case']}: {r['added_ms_per_microbatch']:.3f} ms added per micro-batch > 0.1"
               for r in rows if r["model"] == "tiny" and r["added_ms_per_microbatch"] > 0.1]
    print("targets missed: " + "; ".join(missed) if missed else "all targets met")


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = load_at_start(args)
    rows = []
    for name in args.models:
        for case in args.cases:
            print(f"benchmarking {name} {case} ...", flush=True)
            rows.append(bench_case(name, case, args))
    settings = dict(world=WORLD, backend="gloo", rounds=args.rounds, steps=args.steps, warmup=args.warmup,
                    tiny_steps=args.tiny_steps, tiny_warmup=10 * args.warmup,
                    batch_per_rank=args.batch, tiny_batch_per_rank=TINY_BATCH, threads_per_rank=THREADS,
                    optimizer=f"SGD(lr={LR}, momentum=0.9)", nan_check=not args.no_nan_check,
                    control=args.control, keep_freed_blocks=args.keep_freed_blocks)
    _report(rows)
    write_results(args, settings, load_before, ranks=WORLD, results=rows)


if __name__ == "__main__":
    main()
