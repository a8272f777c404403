"""Benchmark: our pipeline schedules against torch.distributed.pipelining's, on the same cuts.

    python bench/pipeline.py [--rounds 10] [--steps 6] [--batch 1024] [--microbatches 4 8] [--gpt-batch 32] [--quick]

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

Phase 4, a GPT cut at named blocks: bench/common.py's TinyGPT (9.7 M parameters, 7 encoder
blocks, untied head) on 2 stages, ours as `Pipeline(stages=2, cut=...)` at `blocks.layers.4`,
torch's `Schedule1F1B` over stages built from the same cut parts (cut.py's `prune`, wrapped in a
module that runs the stage), 1F1B at m=4 on `--gpt-batch` sequences of 64 tokens. Timed as phase 2;
reported in `gpt`.

Phase 3, stages × replicas: world 4 = 2 stages × 2 replicas (4 ranks on 2 cores: both libraries
share the oversubscription), 1F1B at the largest `--microbatches`, each replica reading its half
of `--batch`. Ours: `Pipeline(stages=2)`, whose replicas average gradients through DDP's bucketed
path during the last micro-batch's backward. Torch: its `PipelineStage` over a torch
`DistributedDataParallel` of the same half (torch's schedule runs `no_sync()` on every backward
but the last), groups sliced the same way. Timed as phase 2; reported in `replicas`.

Phase 5, schedules with less bubble: world 2, at the largest `--microbatches`. Ours:
`Pipeline(stages=2, virtual=2, schedule="interleaved-1f1b")` (the model cut into 4 chunks, rank s
holding chunks s and s + 2) and `schedule="zb-h1"`; torch: `ScheduleInterleaved1F1B` over
`PipelineStage`s of deep copies of the same 4 chunks on the same ranks, and
`ScheduleInterleavedZeroBubble` over one stage per rank (the zero-bubble schedule of ZB-H1's shape:
backward split into input and weight gradients). Both as phase 2, with our 1F1B timed in the
same rounds: reported in `schedules`, with each schedule's gain over our 1F1B.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, for the ranks too
from common import (  # noqa: E402
    SEQ,
    add_write_options,
    interleave,
    load_at_start,
    make_batches,
    make_model,
    peak_rss_mb,
    print_table,
    reset_peak_rss,
    return_freed_memory_to_os,
    rss_mb,
    slowest_rank,
    write_results,
)

from paratrain.parallel.pipeline import Cut, Pipeline, split_model  # noqa: E402
from paratrain.parallel.pipeline.cut import prune  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

WORLD, STAGES, THREADS, LR, WIDTH, DEPTH = 2, 2, 1, 1e-3, 512, 8
GPT_MICROBATCHES = 4
IMPLS = ["ours-gpipe", "torch-gpipe", "ours-1f1b", "torch-1f1b"]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


class Ours:
    """paratrain's Pipeline strategy on this rank's half (with `virtual`, its chunks)."""

    def __init__(self, topo, schedule: str, m: int, virtual: int = 1):
        strategy = Pipeline(stages=STAGES, schedule=schedule, microbatches=m, virtual=virtual)
        self.grid = strategy.grid(topo)
        self.stage, _ = strategy.setup(model(), None, self.grid)
        self.module = self.stage.module
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=0.9)

    def forward_backward(self, x, y) -> None:
        self.stage.forward_backward(x, y, F.cross_entropy, 1.0)


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


class TorchChunks(Torch):
    """torch's multi-stage schedule (`kind`) over this rank's `virtual` chunks, virtual stages
    rank, rank + STAGES, ... of the model cut into STAGES × virtual parts, as ours cuts it."""

    def __init__(self, topo, kind, m: int, group, virtual: int):
        from torch.distributed.pipelining import PipelineStage

        self.index = topo.rank  # the last virtual stage is on the last rank: it takes the targets
        parts = split_model(model(), STAGES * virtual)
        mine = [c * STAGES + self.index for c in range(virtual)]
        copies = [copy.deepcopy(parts[k]) for k in mine]
        # one module with the chunks' layers under their names in the model, as our stage holds them
        self.module = nn.Sequential(OrderedDict((n, layer) for part in copies for n, layer in part._modules.items()))
        stages = [PipelineStage(part, k, STAGES * virtual, torch.device("cpu"), group=group)
                  for part, k in zip(copies, mine)]
        self.schedule = kind(stages, m, loss_fn=F.cross_entropy)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=0.9)


def build_schedules(topo, m: int) -> dict:
    """Phase 5's implementations: our 1F1B, interleaved 1F1B (v=2) and ZB-H1 against torch's
    ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble on the same cuts."""
    from torch.distributed.pipelining import ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

    torch_group = dist.new_group([0, 1])
    return {"ours-1f1b": Ours(topo, "1f1b", m),
            "ours-interleaved": Ours(topo, "interleaved-1f1b", m, virtual=2),
            "torch-interleaved": TorchChunks(topo, ScheduleInterleaved1F1B, m, torch_group, virtual=2),
            "ours-zb": Ours(topo, "zb-h1", m),
            "torch-zb": TorchChunks(topo, ScheduleInterleavedZeroBubble, m, torch_group, virtual=1)}


class TorchReplicated(Torch):
    """torch's 1F1B over a torch DDP of this stage, whose replicas are the `dp_group`."""

    def __init__(self, stage: int, m: int, pp_group, dp_group):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.index = stage
        self.module = copy.deepcopy(split_model(model(), STAGES)[self.index])
        ddp = torch.nn.parallel.DistributedDataParallel(self.module, process_group=dp_group)
        stage = PipelineStage(ddp, self.index, STAGES, torch.device("cpu"), group=pp_group)
        self.schedule = Schedule1F1B(stage, m, loss_fn=F.cross_entropy)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=0.9)


def build_replicated(topo, m: int) -> dict:
    """Ours and torch's 1F1B on 2 stages × 2 replicas; torch's groups are our grid's lines."""
    ours = Ours(topo, "1f1b", m)
    grid = ours.grid
    pp = {tuple(r): dist.new_group(r) for r in grid.lines("pp")}
    dp = {tuple(r): dist.new_group(r) for r in grid.lines("dp")}
    mine = lambda groups: next(g for ranks, g in groups.items() if topo.rank in ranks)  # noqa: E731
    return {"ours-1f1b": ours, "torch-1f1b": TorchReplicated(grid.stage, m, mine(pp), mine(dp))}


_MASKS: dict[int, torch.Tensor] = {}


def _causal(x: torch.Tensor) -> torch.Tensor:
    length = x.shape[1]
    if length not in _MASKS:
        _MASKS[length] = nn.Transformer.generate_square_subsequent_mask(length)
    return _MASKS[length]


GPT_CUT = Cut("blocks.layers", embed=lambda model, tokens: model.embed(tokens) + model.pos,
              head=lambda model, h: model.head(model.norm(h)),
              block=lambda block, h: block(h, src_mask=_causal(h), is_causal=True))
GPT_SPLIT = ("blocks.layers.4",)


class OursGPT(Ours):
    def __init__(self, topo, m: int):
        strategy = Pipeline(stages=STAGES, microbatches=m, cut=GPT_CUT, split_at=GPT_SPLIT)
        self.stage, _ = strategy.setup(make_model("transformer"), None, strategy.grid(topo))
        self.module = self.stage.module
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR, momentum=0.9)

    def forward_backward(self, x, y) -> None:
        self.stage.forward_backward(x, y, loss_of_logits, 1.0)


class _Run(nn.Module):
    """A cut stage as torch's PipelineStage wants it: a module whose forward runs the stage."""

    def __init__(self, part: nn.Module, run):
        super().__init__()
        self.part, self.run = part, run

    def forward(self, x):
        return self.run(x)


class TorchGPT(Torch):
    def __init__(self, topo, m: int, group):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.index = topo.rank
        part = copy.deepcopy(make_model("transformer"))
        run, = prune(part, GPT_CUT, [(0, 4) if self.index == 0 else (4, 7)], first=self.index == 0,
                     last=self.index == STAGES - 1)
        self.module = part
        stage = PipelineStage(_Run(part, run), self.index, STAGES, torch.device("cpu"), group=group)
        self.schedule = Schedule1F1B(stage, m, loss_fn=loss_of_logits)
        self.opt = torch.optim.SGD(part.parameters(), lr=LR, momentum=0.9)


def loss_of_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def speed_gpt(topo, m: int, sequences: int, warmup: int, rounds: int, steps: int) -> dict:
    """Phase 4: ours and torch's 1F1B on the GPT cut at the same block."""
    torch_group = dist.new_group([0, 1])
    (x, y), = make_batches("transformer", sequences * SEQ, 1, seed=7)
    impls = {"ours-1f1b": OursGPT(topo, m), "torch-1f1b": TorchGPT(topo, m, torch_group)}
    return timed(impls, x, y, warmup, rounds, steps)


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
    return timed(build(topo, m), x, y, warmup, rounds, steps)


def speed_schedules(topo, m: int, batch: int, warmup: int, rounds: int, steps: int) -> dict:
    """Phase 5: as phase 2, the schedules with less bubble."""
    x, y = batch_of(batch)
    return timed(build_schedules(topo, m), x, y, warmup, rounds, steps)


def speed_replicated(topo, m: int, batch: int, warmup: int, rounds: int, steps: int) -> dict:
    """Phase 3: as phase 2, 2 stages × 2 replicas, each replica on its half of the batch."""
    x, y = batch_of(batch)
    impls = build_replicated(topo, m)
    grid = impls["ours-1f1b"].grid
    return timed(impls, x.chunk(grid.dp)[grid.replica], y.chunk(grid.dp)[grid.replica], warmup, rounds, steps)


def timed(impls: dict, x, y, warmup: int, rounds: int, steps: int) -> dict:
    """Interleaved timed steps of `impls`; their parameters compared per schedule at the end."""
    names = list(impls)
    cpu: dict[str, list[float]] = {name: [] for name in names}

    def run_block(name: str, n: int) -> list[float]:
        dist.barrier()
        times = []
        for _ in range(n):
            start, start_cpu = time.perf_counter(), time.thread_time()
            step(impls[name], x, y)
            times.append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
        return times

    interleave(run_block, names, 1, warmup)
    for warm in cpu.values():
        warm.clear()  # keep the timed steps only
    times = interleave(run_block, names, rounds, steps)
    diff = {s: max_param_diff(impls[f"ours-{s}"].module, impls[f"torch-{s}"].module)
            for s in {n.split("-", 1)[1] for n in names} if f"ours-{s}" in impls and f"torch-{s}" in impls}
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


def bench_replicated(m: int, args) -> dict:
    """Phase 3's row: 1F1B on 2 stages × 2 replicas, ours against torch."""
    results = run_on_ranks(speed_replicated, 2 * WORLD, m, args.batch, args.warmup, args.rounds, args.steps,
                           threads=THREADS, timeout=1200, collective_timeout=300)
    ms = {name: 1e3 * statistics.median(slowest_rank([r["times"][name] for r in results]))
          for name in ("ours-1f1b", "torch-1f1b")}
    return dict(schedule="1f1b", stages=STAGES, replicas=2, microbatches=m, ours_ms=ms["ours-1f1b"],
                torch_ms=ms["torch-1f1b"], ratio=ms["ours-1f1b"] / ms["torch-1f1b"],
                max_param_diff=max(r["diff"]["1f1b"] for r in results))


def bench_schedules(m: int, args) -> list[dict]:
    """Phase 5's rows: interleaved 1F1B and ZB-H1, ours against torch, and each one's gain over
    our 1F1B at the same p and m."""
    results = run_on_ranks(speed_schedules, WORLD, m, args.batch, args.warmup, args.rounds, args.steps,
                           threads=THREADS, timeout=1200, collective_timeout=300)
    names = ("ours-1f1b", "ours-interleaved", "torch-interleaved", "ours-zb", "torch-zb")
    ms = {name: 1e3 * statistics.median(slowest_rank([r["times"][name] for r in results])) for name in names}
    rows = []
    for key, schedule, virtual, theirs in (("interleaved", "interleaved-1f1b", 2, "ScheduleInterleaved1F1B"),
                                           ("zb", "zb-h1", 1, "ScheduleInterleavedZeroBubble")):
        ours = ms[f"ours-{key}"]
        rows.append(dict(schedule=schedule, virtual=virtual, microbatches=m, torch_schedule=theirs, ours_ms=ours,
                         torch_ms=ms[f"torch-{key}"], ratio=ours / ms[f"torch-{key}"],
                         ours_1f1b_ms=ms["ours-1f1b"], gain_over_1f1b=ms["ours-1f1b"] / ours,
                         max_param_diff=max(r["diff"][key] for r in results)))
    return rows


def bench_gpt(args) -> dict:
    """Phase 4's row."""
    results = run_on_ranks(speed_gpt, WORLD, GPT_MICROBATCHES, args.gpt_batch, args.warmup, args.rounds,
                           args.steps, threads=THREADS, timeout=1200, collective_timeout=300)
    ms = {name: 1e3 * statistics.median(slowest_rank([r["times"][name] for r in results]))
          for name in ("ours-1f1b", "torch-1f1b")}
    return dict(schedule="1f1b", model="gpt", stages=STAGES, microbatches=GPT_MICROBATCHES,
                split_at=list(GPT_SPLIT), ours_ms=ms["ours-1f1b"], torch_ms=ms["torch-1f1b"],
                ratio=ms["ours-1f1b"] / ms["torch-1f1b"], max_param_diff=max(r["diff"]["1f1b"] for r in results))


def _parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per implementation first")
    parser.add_argument("--batch", type=int, default=1024, help="rows per step (the whole pipeline's batch)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8],
                        help="micro-batch counts to run (torch's 1F1B needs at least 2)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "pipeline.json"))
    parser.add_argument("--gpt-batch", type=int, default=32, help="sequences of 64 tokens per step (phase 4)")
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke check")
    add_write_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(rounds=2, steps=2, warmup=1, batch=256, microbatches=[4, 8], gpt_batch=8)
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
    load_before = load_at_start(args)
    rows = []
    for m in args.microbatches:
        print(f"benchmarking m={m} ...", flush=True)
        rows += bench(m, args)
    settings = dict(world=WORLD, stages=STAGES, backend="gloo", rounds=args.rounds, steps=args.steps,
                    warmup=args.warmup, batch=args.batch, threads_per_rank=THREADS,
                    model=f"{DEPTH} x (Linear {WIDTH}->{WIDTH}, ReLU), Linear {WIDTH}->10",
                    params=sum(p.numel() for p in model().parameters()),
                    optimizer=f"SGD(lr={LR}, momentum=0.9)")
    print(f"benchmarking {STAGES} stages x 2 replicas, 1f1b m={max(args.microbatches)} ...", flush=True)
    replicated = bench_replicated(max(args.microbatches), args)
    print(f"benchmarking the GPT cut at {GPT_SPLIT[0]}, 1f1b m={GPT_MICROBATCHES} ...", flush=True)
    gpt = bench_gpt(args)
    print(f"benchmarking interleaved 1f1b and zb-h1, m={max(args.microbatches)} ...", flush=True)
    schedules = bench_schedules(max(args.microbatches), args)
    _report(rows)
    print_table([replicated], [("stages", "stages", "d"), ("replicas", "replicas", "d"),
                               ("microbatches", "m", "d"), ("ours_ms", "ours ms", ".1f"),
                               ("torch_ms", "torch ms", ".1f"), ("ratio", "ratio", ".3f"),
                               ("max_param_diff", "max diff", ".1e")])
    print_table([gpt], [("model", "model", ""), ("split_at", "split at", ""), ("microbatches", "m", "d"),
                        ("ours_ms", "ours ms", ".1f"), ("torch_ms", "torch ms", ".1f"), ("ratio", "ratio", ".3f"),
                        ("max_param_diff", "max diff", ".1e")])
    print_table(schedules, [("schedule", "schedule", ""), ("virtual", "v", "d"), ("microbatches", "m", "d"),
                            ("torch_schedule", "torch's", ""), ("ours_ms", "ours ms", ".1f"),
                            ("torch_ms", "torch ms", ".1f"), ("ratio", "ratio", ".3f"),
                            ("gain_over_1f1b", "gain over 1f1b", ".3f"), ("max_param_diff", "max diff", ".1e")])
    missed = [f"{r['schedule']}: ratio {r['ratio']:.3f} > 1.00" for r in [gpt, *schedules] if r["ratio"] > 1.0]
    if missed:
        print("targets missed: " + "; ".join(missed))
    write_results(args, settings, load_before, ranks=2 * WORLD, results=rows, replicas=replicated, gpt=gpt,
                  schedules=schedules)


if __name__ == "__main__":
    main()
