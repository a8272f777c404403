"""Benchmark: hierarchical data parallel against flat DDP, 2 nodes × 2 processes (simulated).

    python bench/hierarchical.py [--rounds 3] [--steps 5] [--batch 64] [--quick]
                                 [--out bench/results/hierarchical.json]

World 4 on gloo, split into 2 nodes of 2 by `run_on_ranks(nodes=2)` (LOCAL_RANK / GROUP_RANK as
torchrun sets them), one thread per rank. Both models of bench/common.py. Each rank wraps two deep
copies of one seeded model, `paratrain.DistributedDataParallel` (flat: one all-reduce per bucket
over the world) and `HierarchicalDataParallel` (reduce-scatter in the node, all-reduce across
nodes, all-gather in the node), trains both on the same batches with SGD(lr 1e-3, momentum 0.9)
and reports:

- bytes across the node boundary per step. Hierarchical: what the wrapper counted for its
  inter-node all-reduces (bandwidth-optimal ring accounting, comm.py). Flat: the reference ring
  all-reduce (`paratrain.ring_all_reduce`, real p2p sends, ranks in order) of the same gradient,
  counting what each rank sends to a right neighbour on another node. Given as the largest per
  rank and the total per node; theory: flat 2(N-1)/N·S per node, all through one rank, against
  hierarchical 2(M-1)/M·S per node, S/L·2(M-1)/M per rank (S gradient bytes, N = M·L ranks);
- step time (forward, backward, step; slowest rank; median of interleaved rounds). On one
  machine the "nodes" share memory and loopback, so crossing nodes costs nothing extra and the
  three phases cost more latency than one all-reduce: the time column is an honest measurement of
  the overhead, not of a cluster, where the slower inter-node links are what the scheme saves;
- max_param_diff: largest |flat - hierarchical| over all parameters after the same steps.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common.py, for the ranks too
from common import (  # noqa: E402
    MODELS,
    bench_parser,
    interleave,
    load_at_start,
    make_batches,
    make_model,
    parse_bench_args,
    print_table,
    slowest_rank,
    train_step,
    write_results,
)

import paratrain as pt  # noqa: E402
from paratrain.distributed.comm import ByteCounter  # noqa: E402
from paratrain.parallel.hierarchical import HierarchicalDataParallel  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

WORLD, NODES, THREADS, LR, DATA_BATCHES = 4, 2, 1, 1e-3, 4


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def flat_ring_cross_node(topo, numel: int) -> int:
    """Bytes this rank sends to another node in a ring all-reduce of `numel` float32s."""
    counter = ByteCounter()
    pt.ring_all_reduce(torch.zeros(numel), counter=counter)
    right = (topo.rank + 1) % topo.world_size
    return counter.sent if right // topo.local_world_size != topo.node_rank else 0


def speed(topo, name: str, batch: int, warmup: int, rounds: int, steps: int) -> dict:
    model = make_model(name)
    wrapped = {"flat": pt.DistributedDataParallel(copy.deepcopy(model)),
               "hierarchical": HierarchicalDataParallel(copy.deepcopy(model), groups=pt.node_groups(topo))}
    opts = {impl: _optimizer(m) for impl, m in wrapped.items()}
    batches = make_batches(name, batch, DATA_BATCHES, seed=100 + topo.rank)
    done = {impl: 0 for impl in wrapped}

    def run_block(impl: str, n: int) -> list[float]:
        dist.barrier()
        times = []
        for _ in range(n):
            x, y = batches[done[impl] % len(batches)]
            start = time.perf_counter()
            train_step(wrapped[impl], opts[impl], x, y)
            times.append(time.perf_counter() - start)
            done[impl] += 1
        return times

    interleave(run_block, list(wrapped), 1, warmup)
    times = interleave(run_block, list(wrapped), rounds, steps)
    sent = wrapped["hierarchical"].bytes_sent
    numel = sum(p.numel() for p in model.parameters())
    return dict(times=times, diff=max_param_diff(wrapped["flat"].module, wrapped["hierarchical"].module),
                hier_inter=sent.inter_node.sent / done["hierarchical"],
                hier_intra=sent.intra_node.sent / done["hierarchical"],
                flat_cross=flat_ring_cross_node(topo, numel))


def bench_model(name: str, args) -> dict:
    results = run_on_ranks(speed, WORLD, name, args.batch, args.warmup, args.rounds, args.steps,
                           nodes=NODES, threads=THREADS, timeout=900, collective_timeout=300)
    ms = {impl: 1e3 * statistics.median(slowest_rank([r["times"][impl] for r in results]))
          for impl in ("flat", "hierarchical")}
    hier = [r["hier_inter"] for r in results]
    flat = [r["flat_cross"] for r in results]
    params = sum(p.numel() for p in make_model(name).parameters())
    return dict(params=params, gradient_mb=params * 4 / 2**20,
                flat_cross_mb_per_node=sum(flat) / NODES / 2**20,
                hier_cross_mb_per_node=sum(hier) / NODES / 2**20,
                flat_cross_mb_max_rank=max(flat) / 2**20, hier_cross_mb_max_rank=max(hier) / 2**20,
                hier_intra_mb_per_rank=max(r["hier_intra"] for r in results) / 2**20,
                cross_ratio=sum(hier) / sum(flat), flat_ms=ms["flat"], hier_ms=ms["hierarchical"],
                time_ratio=ms["hierarchical"] / ms["flat"], max_param_diff=max(r["diff"] for r in results))


def _parse_args(argv) -> argparse.Namespace:
    parser = bench_parser(__doc__, out_name="hierarchical.json", rounds=3, steps=5, warmup=2, batch=64)
    return parse_bench_args(parser, argv, quick=dict(rounds=1, steps=1, warmup=1))


def main(argv=None) -> None:
    args = _parse_args(argv)
    load_before = load_at_start(args)
    models = {}
    for name in MODELS:
        print(f"benchmarking {name} ...", flush=True)
        models[name] = bench_model(name, args)
    settings = dict(world=WORLD, nodes=NODES, processes_per_node=WORLD // NODES, backend="gloo",
                    rounds=args.rounds, steps=args.steps, warmup=args.warmup, batch_per_rank=args.batch,
                    threads_per_rank=THREADS, cores=os.cpu_count())
    print_table([dict(model=name, **row) for name, row in models.items()],
                [("model", "model", ""), ("gradient_mb", "grad MiB", ".1f"),
                 ("flat_cross_mb_per_node", "flat x-node/node", ".1f"),
                 ("hier_cross_mb_per_node", "hier x-node/node", ".1f"),
                 ("flat_cross_mb_max_rank", "flat x-node max rank", ".1f"),
                 ("hier_cross_mb_max_rank", "hier x-node max rank", ".1f"),
                 ("cross_ratio", "x-node ratio", ".3f"), ("flat_ms", "flat ms", ".1f"),
                 ("hier_ms", "hier ms", ".1f"), ("max_param_diff", "max diff", ".1e")])
    write_results(args, settings, load_before, ranks=WORLD, models=models)


if __name__ == "__main__":
    main()
