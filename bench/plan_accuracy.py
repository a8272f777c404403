"""Benchmark: what `paratrain plan` predicts against what runs here measure.

    python bench/plan_accuracy.py [--cluster FILE] [--worlds 1,2,4] [--models mlp,transformer]
                                  [--strategies ddp,zero1,zero2,zero3,pipeline] [--steps 6]
                                  [--warmup 2] [--jobs 2] [--out bench/results/plan_accuracy.json]
                                  [--quick] [--force]
    python bench/plan_accuracy.py --accumulate 4 --worlds 2 --out bench/results/plan_accuracy_accumulate.json

The two models of bench/common.py (an MLP of 18.9 M parameters on a global batch of 256 rows; a
GPT of 9.7 M on 32 sequences of 64 tokens) train with Adam under each strategy at each world size
on gloo, one thread per rank, through `pt.Session(strategy).train_step`, as a user runs them.
ZeRO-3's units are the models' blocks (bench/zero.py's); the pipeline has 2 stages (the GPT cut at
`blocks.layers.4`, bench/pipeline.py's), 4 micro-batches, replicas beyond 2 ranks.

Measured, per case: the step time (the slowest rank's, median of `--steps` after `--warmup` in
each of `--jobs` jobs, pooled: one job of the MLP's ddp at world 4 read 0.62 s a step where
three more right after read 0.51), its
ranks keeping freed blocks for the next step as `paratrain run` starts them (cpu_malloc.py; the
calibration's too), and in a job of its own, each rank's peak memory over 3 steps: VmHWM after
the steps minus VmRSS before the model was built (the process's high-water mark, reset there),
both less the pages files back (the libraries' code, which a run pages in as it first executes
each kernel: not tensors; common.file_rss_mb), with glibc's mmap threshold fixed so that freed
blocks leave RSS (common.py; it slows each step by its page faults, hence the separate job);
the larger rank's.

Predicted, from the same model built on the meta device: the fullest rank's device peak
(plan/cost/memory.py, with probe's activations for the global batch and the runs' loss) and the step time
(plan/recommend.predict_time: step_time.py over traffic.py's messages) on the cluster file,
`--cluster`, or one `paratrain plan --calibrate` writes first into bench/inputs/cpu_calibration.json (a planner input, not a result).
Targets: step time within 15 %, peak memory within 10 %, in every case.
`--accumulate K`: every step is K micro-batches of the same global batch, Session(accumulate=K),
against `paratrain plan --accumulate K` (not one of the issue's 28 cases: the second command).

Before each case the bench times a 1024³ matmul and Adam again (`machine_speed`, in the JSON):
this shared machine's rates move by up to 2 × within minutes, which the cluster file, measured
once at the start, cannot follow; the ratios say how far each case's machine was from it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, pipeline.py, for the ranks too
from common import (  # noqa: E402
    SEQ,
    add_write_options,
    file_rss_mb,
    load_at_start,
    make_batches,
    make_model,
    peak_rss_mb,
    print_table,
    reset_peak_rss,
    return_freed_memory_to_os,
    rss_mb,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.launch.cpu_malloc import keep_freed_blocks  # noqa: E402
from paratrain.plan.cluster.calibrate import Settings, calibrate  # noqa: E402
from paratrain.plan.cluster.calibrate_compute import matmul_rates, optimizer_table, traffic_rate  # noqa: E402
from paratrain.plan.cluster.cluster import save_cluster  # noqa: E402
from paratrain.plan.cluster.presets import load_cluster  # noqa: E402
from paratrain.plan.cost.memory import predict  # noqa: E402
from paratrain.plan.model.probe import model_facts  # noqa: E402
from paratrain.plan.model.source import resolve  # noqa: E402
from paratrain.plan.recommend import predict_time  # noqa: E402
from paratrain.testing import run_on_ranks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FACTORY = {"mlp": "common:mlp", "transformer": "common:TinyGPT"}
GLOBAL_BATCH = {"mlp": 256, "transformer": 32 * SEQ}  # rows; tokens
MICROBATCHES = 4


def strategy_of(case: str, model: str) -> pt.Strategy:
    """The strategy each case runs, the same object for the run and the prediction."""
    if case == "pipeline":
        if model == "mlp":
            return pt.Pipeline(stages=2, microbatches=MICROBATCHES)
        from pipeline import GPT_CUT, GPT_SPLIT
        return pt.Pipeline(stages=2, microbatches=MICROBATCHES, cut=GPT_CUT, split_at=GPT_SPLIT)
    if case == "zero3":
        unit = torch.nn.Linear if model == "mlp" else torch.nn.TransformerEncoderLayer
        return pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(unit,)))
    if case.startswith("zero"):
        return pt.ZeRO(stage=int(case[-1]))
    return pt.DDP()


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def _rank(topo, model_name: str, case: str, steps: int, warmup: int, memory: bool, accumulate: int = 1) -> dict:
    """Train `steps` timed optimizer steps (`accumulate` micro-batches each); this rank's step
    times, or (`memory`) its peak memory with freed blocks leaving RSS (which slows every step by
    its page faults: a job of its own)."""
    torch.set_num_threads(1)
    if memory:
        return_freed_memory_to_os()
    else:
        keep_freed_blocks()
    batches = make_batches(model_name, GLOBAL_BATCH[model_name], warmup + steps, seed=1)
    reset_peak_rss()
    base = rss_mb() - file_rss_mb()
    session = pt.Session(strategy_of(case, model_name), topology=topo, progress_bar=False, accumulate=accumulate)
    model = make_model(model_name)
    model, _ = session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    times = []
    for i, (x, y) in enumerate(batches):
        x, y = x.chunk(model.replicas)[model.replica_index], y.chunk(model.replicas)[model.replica_index]
        started = time.perf_counter()
        for xm, ym in zip(x.chunk(accumulate), y.chunk(accumulate)):
            session.train_step((xm, ym), _loss).item()
        if i >= warmup:
            times.append(time.perf_counter() - started)
    return {"times": times, "peak_mb": peak_rss_mb() - file_rss_mb() - base}


def _planned_loss(out: torch.Tensor) -> torch.Tensor:
    """The runs' loss for the planner's fake forward: cross-entropy (what it saves counts)."""
    return _loss(out, torch.zeros(out.shape[:-1], dtype=torch.long))


def measure(model: str, case: str, world: int, args: argparse.Namespace) -> dict:
    """The median step (each its slowest rank's) over `--jobs` jobs, and the peak in one more:
    4 ranks on 2 cores keep a pace through a job that the next job need not keep."""
    slowest = []
    for _ in range(args.jobs):
        ranks = run_on_ranks(_rank, world, model, case, args.steps, args.warmup, False, args.accumulate, threads=1,
                             timeout=600)
        slowest += [max(step) for step in zip(*(r["times"] for r in ranks))]
    peaks = run_on_ranks(_rank, world, model, case, 1, 2, True, args.accumulate, threads=1, timeout=600)
    return {"step_s": statistics.median(slowest), "peak_mb": max(r["peak_mb"] for r in peaks)}


def predicted(model: str, case: str, world: int, cluster, accumulate: int = 1) -> dict:
    source = resolve(FACTORY[model])
    seq = SEQ if model == "transformer" else None
    batch = GLOBAL_BATCH[model] // (SEQ if seq else 1)
    facts = model_facts(source, batch, seq, activation_checkpointing=None, loss_fn=_planned_loss)
    strategy = strategy_of(case, model)
    ranks = predict(source.build(), strategy, world=world, optimizer="adam",
                    activation_bytes=facts.step.activation_peak_bytes, accumulate=accumulate, step=facts.step)
    seconds = predict_time(source, strategy, facts.step, cluster, gpus=world, nodes=1, facts=facts,
                           accumulate=accumulate)
    return {"step_s": seconds.total, "peak_mb": max(r.device_peak for r in ranks) / 2**20,
            "compute_s": seconds.compute, "exposed_comm_s": seconds.exposed_comm, "bubble_s": seconds.bubble}


def machine_speed(cluster) -> dict:
    """The 1024³ fp32 matmul rate, Adam's rate over two 4M-element tensors and the element-wise
    work's traffic rate, measured now (one thread, about a second), over what the calibration
    measured: how far the machine drifted from the cluster file while the cases ran (here the
    first two moved by up to 2 × within minutes; in one run the traffic rate fell to 0.8 × with
    the other two unmoved, and the GPT's steps took 13-24 % longer than predicted)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        quick = Settings(matmul_seconds=0.3, optimizer_sizes=(2**22,))
        matmul = matmul_rates(quick, torch.device("cpu"))["fp32"]
        (_, adam), = optimizer_table(quick, torch.device("cpu"))
        traffic = traffic_rate(quick, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    return {"matmul": matmul / cluster.peak_flops["fp32"], "adam": adam / cluster.optimizer_rate_for(2**22),
            "traffic": traffic / cluster.traffic_rate}


def cases(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    return [(m, s, w) for m in args.models for s in args.strategies for w in args.worlds
            if not (s == "pipeline" and w < 2)]


def main(argv=None) -> None:
    args = _parse_args(argv)
    load = load_at_start(args)
    keep_freed_blocks()  # machine_speed's timings in this process, as the ranks' and the calibration's
    if args.cluster:
        cluster = load_cluster(args.cluster)
    else:
        cluster = calibrate(Settings(), name="cpu-bench")
        save_cluster(cluster, os.path.join(HERE, "inputs", "cpu_calibration.json"))
    rows = []
    for model, case, world in cases(args):
        want = predicted(model, case, world, cluster, args.accumulate)
        speed = machine_speed(cluster)
        got = measure(model, case, world, args)
        print(f"{model} {case} world {world}: step {got['step_s']:.3f} s (predicted {want['step_s']:.3f}), "
              f"peak {got['peak_mb']:.0f} MiB (predicted {want['peak_mb']:.0f})", flush=True)
        rows.append(dict(model=model, strategy=case, world=world, measured_step_s=got["step_s"],
                         predicted_step_s=want["step_s"], step_error=want["step_s"] / got["step_s"] - 1,
                         measured_peak_mb=got["peak_mb"], predicted_peak_mb=want["peak_mb"],
                         peak_error=want["peak_mb"] / got["peak_mb"] - 1, machine_speed=speed,
                         **{f"predicted_{k}": v for k, v in want.items() if k not in ("step_s", "peak_mb")}))
    print_table(rows, [("model", "model", ""), ("strategy", "strategy", ""), ("world", "world", "d"),
                       ("measured_step_s", "step s", ".3f"), ("predicted_step_s", "predicted", ".3f"),
                       ("step_error", "error", "+.1%"), ("measured_peak_mb", "peak MiB", ".0f"),
                       ("predicted_peak_mb", "predicted", ".0f"), ("peak_error", "error", "+.1%")])
    within = [r for r in rows if abs(r["step_error"]) <= 0.15 and abs(r["peak_error"]) <= 0.10]
    print(f"within the targets (step time 15 %, peak 10 %): {len(within)} of {len(rows)} cases")
    for what in ("matmul", "adam", "traffic"):
        seen = [r["machine_speed"][what] for r in rows]
        print(f"this machine's {what} rate before each case: {min(seen):.2f}-{max(seen):.2f} x the calibration's")
    write_results(args, dict(global_batch=GLOBAL_BATCH, microbatches=MICROBATCHES, accumulate=args.accumulate,
                             steps=args.steps,
                             warmup=args.warmup, jobs=args.jobs, cluster=cluster.name, threads_per_rank=1), load,
                  ranks=max(args.worlds), cases=rows)


def _parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cluster", help="a cluster file (default: calibrate this machine first)")
    parser.add_argument("--worlds", default="1,2,4", help="world sizes, comma-separated")
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--strategies", default="ddp,zero1,zero2,zero3,pipeline")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--jobs", type=int, default=2, help="jobs timing each case (their steps pooled)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "plan_accuracy.json"))
    parser.add_argument("--quick", action="store_true", help="world 2, 2 steps: a smoke check")
    add_write_options(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.worlds, args.steps, args.warmup, args.jobs = "2", 2, 1, 1
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.models, args.strategies = args.models.split(","), args.strategies.split(",")
    return args


if __name__ == "__main__":
    main()
