"""Every way to lay a step over the mesh of N devices that fits, ranked by predicted throughput,
each as the `pt.Session(...)` line that runs it (`search`; `paratrain plan --search`).

What is searched, for the global batch the command gives (recommend.py times each one):

    tp              1, 2, 4, 8: within a node, dividing N; the model's plan (or Megatron's cut) must
                    split its rows that many ways
    cp              1, 2, 4, 8 for a model that calls F.scaled_dot_product_attention, where 2·cp
                    divides the sequence (the load-balanced cut); not with a pipeline (Mesh refuses it)
    pp              a pipeline of 2, 4, 8 … stages, at most the model's blocks and dividing what
                    tp · cp leave; its replicas average as ddp does, or with tp = 1 also shard
                    the optimizer state (zero1; Mesh refuses ZeRO with tp > 1 and pp)
    schedule        1f1b; interleaved-1f1b with 2 chunks per rank (virtual) where the blocks divide
                    into pp · 2 and the micro-batches into pp; zb-h1 where there are at least pp
                    micro-batches
    dp strategy     ddp, zero1, zero2, zero3 over the remaining dp ranks (with pp, as above); under
                    --precision bf16 or fp16, also ZeRO with param_dtype of that precision: its
                    parameters held, gathered and reduced in it, so autocast copies no weight
                    (memory.py's weight copies) and the collectives move half the bytes
    micro-batches   with a pipeline, micro-batches of 1, 2, 4 or 8 samples (m = a replica's batch
                    over that); without, gradient accumulation of 1, 2, 4 or 8 micro-batches
    checkpointing   none, and the probe's checkpointed count (--activation-checkpointing auto)

A candidate whose data-parallel replicas outnumber the batch's samples, whose fullest rank does
not fit the device, or that the strategy refuses (a ConfigError, a width the model cannot take)
is dropped. The probe runs once; each candidate reuses its counts (probe.StepCount), the
cut copies (tensor_parallel.cut_copy) and the schedules' figures (schedule_figures.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from paratrain.components.precision import autocast_dtype
from paratrain.errors import ParatrainError
from paratrain.parallel.base import Strategy
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.tensor import mesh
from paratrain.parallel.tensor.mesh import Mesh
from paratrain.parallel.zero import ZeRO
from paratrain.plan.cluster.cluster import Cluster
from paratrain.plan.cost.layouts import reused
from paratrain.plan.model.probe import ModelFacts
from paratrain.plan.model.repeated_blocks import find_stack
from paratrain.plan.model.source import ModelSource
from paratrain.plan.recommend import nodes_for, timed_rows

WIDTHS = (1, 2, 4, 8)  # tp and cp
SAMPLES = (1, 2, 4, 8)  # a pipeline's micro-batch, or accumulation's micro-batches
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")


def candidates(source: ModelSource, facts: ModelFacts, cluster: Cluster, *, gpus: int,
               nodes: int) -> Iterator[tuple[Strategy, int]]:
    """Each (strategy, accumulate) of the search (module docstring), before memory and time."""
    per_node = gpus // nodes
    stack = find_stack(source.shared)
    blocks = stack.length if stack is not None else 0
    seq = facts.seq or 0
    low = autocast_dtype(facts.precision)  # ZeRO's param_dtype candidates, under autocast only
    cps = [c for c in WIDTHS if c == 1 or (facts.step.attention_calls and seq % (2 * c) == 0)]
    for tp, cp in itertools.product(WIDTHS, cps):
        if gpus % (tp * cp) or tp > per_node:
            continue
        rest = gpus // (tp * cp)
        stages = [1] + ([s for s in (2 ** k for k in range(1, 12)) if s <= blocks and rest % s == 0] if cp == 1 else [])
        for pp in stages:
            replicas = rest // pp
            if facts.batch % replicas:
                continue
            share = facts.batch // replicas  # a replica's samples per optimizer step
            if pp == 1:
                for dp, k in itertools.product(DATA_PARALLEL, SAMPLES):
                    if share % k == 0:
                        yield _mesh(tp, cp, dp), k
                        if low is not None and dp != "ddp":
                            yield _mesh(tp, cp, ZeRO(stage=int(dp[-1]), param_dtype=low)), k
                continue
            for samples in SAMPLES:
                if share % samples:
                    continue
                m = share // samples
                yield Mesh(tp=tp, dp="ddp", pp=Pipeline(stages=pp, microbatches=m)), 1
                if tp == 1:  # Megatron's distributed optimizer: the replicas shard the optimizer state
                    yield Mesh(dp="zero1", pp=Pipeline(stages=pp, microbatches=m)), 1
                if m >= pp:  # zero bubble: the weight gradients fill the idle slots
                    yield Mesh(tp=tp, dp="ddp", pp=Pipeline(stages=pp, microbatches=m, schedule="zb-h1")), 1
                if blocks % (2 * pp) == 0 and m % pp == 0:
                    yield Mesh(tp=tp, dp="ddp", pp=Pipeline(stages=pp, microbatches=m, virtual=2,
                                                            schedule="interleaved-1f1b")), 1


def _mesh(tp: int, cp: int, dp: str | Strategy) -> Strategy:
    if tp == 1 and cp == 1:  # the plain strategy: what its row and Session line name
        return dp if isinstance(dp, Strategy) else mesh.DATA_PARALLEL[dp]()
    return Mesh(tp=tp, cp=cp, dp=dp)


def search(source: ModelSource, facts: ModelFacts, cluster: Cluster, *, gpus: int, optimizer: str,
           nodes: int | None = None, top: int = 5) -> list[dict]:
    """The `top` fitting candidates by tokens (or samples) per second per device, fastest first;
    each a plan row (recommend.py) with its `session` line."""
    nodes = nodes_for(gpus, cluster, nodes)
    steps = [facts.step] + ([facts.checkpointed] if facts.checkpointed is not None else [])
    found = []
    with reused():  # the layouts of each cut copy, made once (plan/cost/layouts.py)
        for (strategy, k), step in itertools.product(candidates(source, facts, cluster, gpus=gpus, nodes=nodes),
                                                     steps):
            try:  # one at a time: a width or cut the model cannot take raises for its own candidate only
                row = timed_rows(source, facts, step, cluster, [strategy], gpus=gpus, nodes=nodes,
                                 optimizer=optimizer, accumulate=k)[0]
            except ParatrainError:
                continue
            if "error" not in row and row["fits"]:
                found.append(row)
    found.sort(key=lambda row: -row["per_device_per_second"])
    return found[:top]


def describe_search(rows: list[dict], *, gpus: int, cluster: Cluster, per: str) -> str:
    """The ranking as text: each configuration's throughput, MFU and step, then its Session line."""
    if not rows:
        return f"search: no configuration fits on {gpus} {cluster.name} device(s)"
    lines = [f"search over tp, cp, pp, virtual, the dp strategy, micro-batches and checkpointing on {gpus} "
             f"{cluster.name} device(s), the {len(rows)} fastest that fit:"]
    for i, row in enumerate(rows, 1):
        lines.append(f"  {i}. {row['per_device_per_second']:.4g} {per}s/s per device, MFU {row['mfu']:.1%}, "
                     f"{row['step_seconds']:.3g} s per step, device peak {row['device_peak'] / 2**30:.3g} GiB")
        lines.append(f"     {row['session']}")
    return "\n".join(lines)
