"""`paratrain plan --gpus N`: the per-rank memory of each strategy (memory.py), as JSON rows and
as a text table. Each strategy takes its default settings; one that cannot run the model on N
ranks (a pipeline of a model it cannot cut, "single" on several ranks) is a row with its reason."""

from __future__ import annotations

from paratrain.components.precision import PRECISIONS
from paratrain.errors import ParatrainError
from paratrain.parallel.base import Strategy
from paratrain.parallel.ddp import DDP
from paratrain.parallel.hierarchical import Hierarchical
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.single import Single
from paratrain.parallel.tensor.mesh import Mesh
from paratrain.parallel.zero import ZeRO
from paratrain.plan.cost.memory import RankMemory, predict
from paratrain.plan.cost.tensor_parallel import inner_strategy
from paratrain.plan.model.source import ModelSource

FIGURES = ("params", "grads", "optimizer", "comm_buffers", "gathered", "activations", "weight_copies", "workspace",
           "host", "fresh_grads", "comm_at_start")


def strategies(gpus: int, batch: int | None = None, offload: bool = True,
               per_node: int | None = None, attention: bool = False) -> list[Strategy]:
    """What the table compares on `gpus` ranks: each data-parallel strategy (ZeRO's stages also
    with `offload`, unless told not to: on a CPU cluster there is no other memory to offload to),
    a pipeline over every rank and, from 4 ranks, pipelines of 2 stages times gpus/2 replicas (a
    pipeline's micro-batches are the most, up to 4 per stage, that divide its replica's share of
    `batch`), and tensor parallelism over 2, 4 and 8 ranks of a node (`per_node`, default all)
    with ddp, zero1 and zero3 over the rest; for a model with attention (`attention`: it calls
    F.scaled_dot_product_attention), context parallelism over 2 ranks with ddp and zero3."""
    chosen: list[Strategy] = [Single()] if gpus == 1 else []
    chosen += [DDP(), Hierarchical(), *(ZeRO(stage=k) for k in (1, 2, 3))]
    chosen += [ZeRO(stage=k, offload=True) for k in (1, 2, 3)] if offload else []
    stages = [] if gpus == 1 else [gpus, 2] if gpus >= 4 and gpus % 2 == 0 else [gpus]
    chosen += [Pipeline(stages=s, microbatches=_microbatches(s, (batch or 4 * s) * s // gpus)) for s in stages]
    widths = [t for t in (2, 4, 8) if gpus % t == 0 and t <= (per_node or gpus)]
    chosen += [Mesh(tp=t, dp=dp) for t in widths for dp in ("ddp", "zero1", "zero3")]
    return chosen + ([Mesh(cp=2, dp=dp) for dp in ("ddp", "zero3")] if attention and gpus % 2 == 0 else [])


def _microbatches(stages: int, replica_batch: int) -> int:
    return max((m for m in range(1, 4 * stages + 1) if replica_batch % m == 0), default=1)


def memory_rows(source: ModelSource, *, gpus: int, gpus_per_node: int | None, optimizer: str,
                activation_bytes: int, chosen: list[Strategy] | None = None, foreach: bool = False,
                accumulate: int = 1, step=None) -> list[dict]:
    """One row per strategy (`chosen`, default `strategies(gpus)`): the figures of its fullest
    rank (largest device_peak), or `error`; `accumulate` micro-batches per optimizer step; `step`
    the probe's count, which splits a pipeline's activations by stage (memory.predict)."""
    rows = []
    for strategy in chosen if chosen is not None else strategies(gpus):
        row: dict = {"strategy": strategy.name, "label": label(strategy)}
        try:
            ranks = predict(source.shared, strategy, world=gpus, optimizer=optimizer,
                            local_world=min(gpus_per_node or gpus, gpus), activation_bytes=activation_bytes,
                            foreach=foreach, accumulate=accumulate, step=step)
        except ParatrainError as e:  # a strategy that does not fit this model or world
            rows.append({**row, "error": str(e)})
            continue
        rank = max(range(len(ranks)), key=lambda r: ranks[r].device_peak)
        rows.append({**row, "rank": rank, **_figures(ranks[rank])})
    return rows


def label(strategy: Strategy) -> str:
    """The strategy's name in a table: a pipeline with its stages and micro-batches, ZeRO with
    its offload and its param_dtype ("zero3+bf16")."""
    if isinstance(strategy, Pipeline):
        return f"pipeline {strategy.stages}x{strategy.microbatches}"
    if isinstance(strategy, Mesh):
        dims = "".join(f"{d}{n} x " for d, n in (("tp", strategy.tp), ("cp", strategy.cp)) if n > 1)
        sharded = strategy.pp is not None and strategy.data_parallel().name != "ddp"  # the replicas' ZeRO
        return f"{dims}{label(inner_strategy(strategy))}" + (f" x {label(strategy.data_parallel())}" if sharded else "")
    if not isinstance(strategy, ZeRO):
        return strategy.name
    dtype = next((f"+{name}" for name, d in PRECISIONS.items() if d is not None and d == strategy.param_dtype), "")
    return strategy.name + ("+offload" if strategy.offload else "") + dtype


def _figures(memory: RankMemory) -> dict:
    return {**{name: getattr(memory, name) for name in FIGURES}, "at_rest": memory.at_rest,
            "device_peak": memory.device_peak}


def describe_memory(rows: list[dict], *, gpus: int, optimizer: str, size) -> str:
    """The text table; `size` formats bytes. A column of weight copies where a row has some."""
    copies = any(row.get("weight_copies") for row in rows)
    figures = ["params", "grads", "optimizer", "comm_buffers", "gathered", "activations",
               *(["weight_copies"] if copies else []), "workspace", "device_peak"]
    head = ["strategy", "params", "grads", "optimizer", "comm", "gathered", "activations",
            *(["w. copies"] if copies else []), "opt. step", "device peak"]
    lines = [f"memory per rank on {gpus} device(s), {optimizer} (the fullest rank; exact: params, grads, "
             "optimizer; upper bounds: comm, gathered; approximate: activations, the optimizer step's "
             "temporaries" + (", autocast's low-precision copies of the weights (w. copies)" if copies else "") +
             "; the peak holds the larger of comm + gathered + activations"
             + (" + w. copies" if copies else "") + " and opt. step, and zero2's and "
             "zero3's gradients, made again in each backward, in place of activations as they are freed):",
             "  " + "".join(f"{h:>13}" if i else f"{h:<14}" for i, h in enumerate(head))]
    for row in rows:
        if "error" in row:
            lines.append(f"  {row['label']:<14}not planned: {row['error'].split(';')[0]}")
            continue
        cells = [row[k] for k in figures]
        host = f"  (+{size(row['host'])} in CPU memory)" if row["host"] else ""
        lines.append(f"  {row['label']:<14}" + "".join(f"{size(c):>13}" for c in cells) + host)
    return "\n".join(lines)
