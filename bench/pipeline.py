"""Benchmark: our GPipe and 1F1B against torch.distributed.pipelining's ScheduleGPipe and Schedule1F1B.

    python bench/pipeline.py [--rounds 10] [--steps 6] [--batch 1024] [--microbatches 4 8] [--quick]

World 2 on gloo, 2 stages, one thread per rank (2 ranks on 2 cores), ranks started by
`paratrain.testing.run_on_ranks`. The model: 8 × (Linear 512→512, ReLU) and Linear 512→10, an
nn.Sequential of 2,106,378 parameters, cut by `paratrain`'s `split_model` into the same two
halves for both libraries (torch's stage gets a deep copy of the same half). Both take the same
`--batch` rows per step in m micro-batches, the mean cross-entropy loss (torch: `scale_grads=True`,
so both divide by m), and SGD(lr 1e-3, momentum 0.9).

Phase 1, peak activation memory, per stage: each rank fixes glibc's mmap threshold so freed
blocks leave RSS (bench/common.py), runs one warm-up step of an implementation (gradients and
momentum now exist), resets the kernel's high-water mark, and runs one forward-backward of the
batch without stepping: VmHWM - VmRSS before it is what the schedule kept alive (activations,
received tensors, send buffers). Implementations are measured one after another in the same
processes, each against the RSS just before its own forward-backward.

Phase 2, speed: in fresh processes, with glibc's default allocator (a fixed mmap threshold makes
every large tensor a new mapping and its pages new faults, a cost no real run pays), `--rounds`
rounds in which each of the four implementations (ours/torch × gpipe/1f1b) runs `--steps` timed
steps (forward-backward, optimizer step, zero_grad), the order rotated each round; ranks meet
at a barrier before each block. A step takes as long as its slowest rank; reported: the median
over all timed steps. Ratio = ours/torch, per schedule. Also reported: each round's median (to
show the noise) and, as *_cpu_ms, the median CPU time of the training thread per step (larger
rank), which leaves out waiting (for the peer stage, and for other processes on a busy machine).
Both implementations of a schedule then took the same steps from the same start: max_param_diff
is the largest |ours - torch| over the stage's parameters.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, for the ranks too
from common import (interleave, peak_rss_mb, print_table, reset_peak_rss, return_freed_memory_to_os,  # noqa: E402
                    rss_mb, slowest_rank, write_results)
from paratrain.parallel.pipeline import Pipeline, split_model  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

WORLD, STAGES, THREADS, LR, WIDTH, DEPTH = 2, 2, 1, 1e-3, 512, 8
IMPLS = ["ours-gpipe", "torch-gpipe", "ours-1f1b", "torch-1f1b"]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


class Ours:
    """paratrain's Pipeline strategy on this rank's half."""

    def __init__(self, topo, schedule: str, m: int):
        self.strategy = Pipeline(stages=STAGES, schedule=schedule, microbatches=m)
        self.stage = self.strategy.wrap(model(), topo)
        self.module = self.stage.module
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=0.9)

    def forward_backward(self, x, y) -> None:
        self.strategy.forward_backward(self.stage, x, y, F.cross_entropy, 1.0)


class Torch:
    """torch.distributed.pipelining on a deep copy of the same half."""

    def __init__(self, topo, schedule: str, m: int, group):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.index = topo.rank
        self.module = copy.deepcopy(split_model(model(), STAGES)[self.index])
        stage = PipelineStage(self.module, self.index, STAGES, torch.device("cpu"), group=group)
        kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = kind(stage, m, loss_fn=F.cross_entropy)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=0.9)

    def forward_backward(self, x, y) -> None:
        if self.index == 0:
            self.schedule.step(x)
        else:
            self.schedule.step(target=y, losses=[])


def build(topo, m: int) -> dict:
    torch_group = dist.new_group([0, 1])  # torch's p2p apart from ours (they never overlap anyway)
    impls = {}
    for name in IMPLS:
        lib, schedule = name.split("-")
        impls[name] = Ours(topo, schedule, m) if lib == "ours" else Torch(topo, schedule, m, torch_group)
    return impls


def step(impl, x, y) -> None:
    impl.forward_backward(x, y)
    impl.opt.step()
    impl.opt.zero_grad()


def peak_memory(impl, x, y) -> float:
    """MiB one forward-backward raised RSS above its level before (phase 1)."""
    step(impl, x, y)
    impl.opt.zero_grad(set_to_none=False)  # gradients stay allocated: only the schedule's memory counts
    dist.barrier()
    reset_peak_rss()
    baseline = rss_mb()
    impl.forward_backward(x, y)
    peak = peak_rss_mb() - baseline
    impl.opt.zero_grad()
    return peak


def batch_of(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(size, WIDTH, generator=g), torch.randint(0, 10, (size,), generator=g)


def memory(topo, m: int, batch: int) -> dict:
    """Phase 1: peak activation MiB of each implementation on this rank."""
    return_freed_memory_to_os()
    x, y = batch_of(batch)
    return {name: peak_memory(impl, x, y) for name, impl in build(topo, m).items()}


def speed(topo, m: int, batch: int, warmup: int, rounds: int, steps: int) -> dict:
    """Phase 2, in fresh processes with glibc's default allocator: interleaved timed steps."""
    x, y = batch_of(batch)
    impls = build(topo, m)
    cpu: dict[str, list[float]] = {name: [] for name in IMPLS}

    def run_block(name: str, n: int) -> list[float]:
        dist.barrier()
        times = []
        for _ in range(n):
            start, start_cpu = time.perf_counter(), time.thread_time()
            step(impls[name], x, y)
            times.append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
        return times

    interleave(run_block, IMPLS, 1, warmup)
    for warm in cpu.values():
        warm.clear()  # keep the timed steps only
    times = interleave(run_block, IMPLS, rounds, steps)
    diff = {s: max_param_diff(impls[f"ours-{s}"].module, impls[f"torch-{s}"].module) for s in ("gpipe", "1f1b")}
    return dict(times=times, cpu=cpu, diff=diff)


def bench(m: int, args) -> list[dict]:
    memories = run_on_ranks(memory, WORLD, m, args.batch, threads=THREADS, timeout=600)
    results = run_on_ranks(speed, WORLD, m, args.batch, args.warmup, args.rounds, args.steps,
                           threads=THREADS, timeout=1200, collective_timeout=300)
    steps = {name: slowest_rank([r["times"][name] for r in results]) for name in IMPLS}
    ms = {name: 1e3 * statistics.median(t) for name, t in steps.items()}
    cpu_ms = {name: 1e3 * max(statistics.median(r["cpu"][name]) for r in results) for name in IMPLS}
    rounds = {name: [round(1e3 * statistics.median(t[i:i + args.steps]), 1)
                     for i in range(0, len(t), args.steps)] for name, t in steps.items()}
    rows = []
    for schedule in ("gpipe", "1f1b"):
        ours, theirs = f"ours-{schedule}", f"torch-{schedule}"
        rows.append(dict(schedule=schedule, microbatches=m, ours_ms=ms[ours], torch_ms=ms[theirs],
                         ratio=ms[ours] / ms[theirs], ours_cpu_ms=cpu_ms[ours], torch_cpu_ms=cpu_ms[theirs],
                         ours_round_ms=rounds[ours], torch_round_ms=rounds[theirs],
                         ours_peak_mb=[mem[ours] for mem in memories],
                         torch_peak_mb=[mem[theirs] for mem in memories],
                         max_param_diff=max(r["diff"][schedule] for r in results)))
    return rows


def _parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first")
    parser.add_argument("--batch", type=int, default=1024, help="rows per step (the whole pipeline's batch)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8],
                        help="micro-batch counts to run (torch's 1F1B needs at least 2)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline.json"))
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke check")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(rounds=2, steps=2, warmup=1, batch=256, microbatches=[4, 8])
        args = parser.parse_args(argv)
    if any(m < STAGES or args.batch % m for m in args.microbatches):
        parser.error(f"every --microbatches must be at least {STAGES} and divide --batch")
    return args


def _report(rows: list[dict]) -> None:
    table = [dict(r, ours_mem=max(r["ours_peak_mb"]), torch_mem=max(r["torch_peak_mb"]),
                  stage0=r["ours_peak_mb"][0]) for r in rows]
    print_table(table, [("schedule", "schedule", ""), ("microbatches", "m", "d"),
                        ("ours_ms", "ours ms", ".1f"), ("torch_ms", "torch ms", ".1f"),
                        ("ratio", "ratio", ".3f"), ("ours_cpu_ms", "ours cpu", ".1f"),
                        ("torch_cpu_ms", "torch cpu", ".1f"), ("ours_mem", "ours MiB", ".1f"),
                        ("torch_mem", "torch MiB", ".1f"), ("max_param_diff", "max diff", ".1e")])
    missed = [f"{r['schedule']} m={r['microbatches']}: ratio {r['ratio']:.3f} > 1.00"
              for r in rows if r["ratio"] > 1.0]
    for m in sorted({r["microbatches"] for r in rows}):
        gp, ofob = [next(r for r in rows if r["schedule"] == s and r["microbatches"] == m) for s in ("gpipe", "1f1b")]
        if m >= 2 * STAGES and not max(ofob["ours_peak_mb"]) < max(gp["ours_peak_mb"]):
            missed.append(f"m={m}: 1F1B peak {max(ofob['ours_peak_mb']):.1f} MiB not below GPipe's")
    print("targets missed: " + "; ".join(missed) if missed else "all targets met")


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    for m in args.microbatches:
        print(f"benchmarking m={m} ...", flush=True)
        rows += bench(m, args)
    settings = dict(world=WORLD, stages=STAGES, backend="gloo", rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup, batch=args.batch, threads_per_rank=THREADS,
                    model=f"{DEPTH} x (Linear {WIDTH}->{WIDTH}, ReLU), Linear {WIDTH}->10",
                    params=sum(p.numel() for p in model().parameters()),
                    optimizer=f"SGD(lr={LR}, momentum=0.9)")
    _report(rows)
    write_results(args, settings, load_before, results=rows)


if __name__ == "__main__":
    main()
