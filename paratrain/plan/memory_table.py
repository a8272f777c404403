"""`paratrain plan --gpus N`: the per-rank memory of each strategy (memory.py), as JSON rows and
as a text table. Each strategy takes its default settings; one that cannot run the model on N
ranks (a pipeline of a model it cannot cut, "single" on several ranks) is a row with its reason."""

from __future__ import annotations

from paratrain.errors import ParatrainError
from paratrain.parallel.base import Strategy
from paratrain.parallel.ddp import DDP
from paratrain.parallel.hierarchical import Hierarchical
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.single import Single
from paratrain.parallel.zero import ZeRO
from paratrain.plan.memory import RankMemory, predict
from paratrain.plan.model_source import ModelSource

FIGURES = ("params", "grads", "optimizer", "comm_buffers", "gathered", "activations", "host")


def strategies(gpus: int) -> list[Strategy]:
    """What the table compares on `gpus` ranks."""
    chosen: list[Strategy] = [Single()] if gpus == 1 else []
    chosen += [DDP(), Hierarchical(), ZeRO(stage=1), ZeRO(stage=2), ZeRO(stage=3)]
    return chosen + ([Pipeline(stages=gpus)] if gpus > 1 else [])


def memory_rows(source: ModelSource, *, gpus: int, gpus_per_node: int | None, optimizer: str,
                activation_bytes: int) -> list[dict]:
    """One row per strategy: the figures of its fullest rank (largest device_peak), or `error`."""
    rows = []
    for strategy in strategies(gpus):
        row: dict = {"strategy": strategy.name}
        try:
            ranks = predict(source.build(), strategy, world=gpus, optimizer=optimizer,
                            local_world=min(gpus_per_node or gpus, gpus), activation_bytes=activation_bytes)
        except ParatrainError as e:  # a strategy that does not fit this model or world
            rows.append({**row, "error": str(e)})
            continue
        rank = max(range(len(ranks)), key=lambda r: ranks[r].device_peak)
        rows.append({**row, "rank": rank, **_figures(ranks[rank])})
    return rows


def _figures(memory: RankMemory) -> dict:
    return {**{name: getattr(memory, name) for name in FIGURES}, "at_rest": memory.at_rest,
            "device_peak": memory.device_peak}


def describe_memory(rows: list[dict], *, gpus: int, optimizer: str, size) -> str:
    """The text table; `size` formats bytes."""
    head = ["strategy", "params", "grads", "optimizer", "comm", "gathered", "activations", "device peak"]
    lines = [f"memory per rank on {gpus} device(s), {optimizer} (the fullest rank; exact: params, grads, "
             "optimizer; upper bounds: comm, gathered; approximate: activations):",
             "  " + "".join(f"{h:>13}" if i else f"{h:<14}" for i, h in enumerate(head))]
    for row in rows:
        if "error" in row:
            lines.append(f"  {row['strategy']:<14}not planned: {row['error'].split(';')[0]}")
            continue
        cells = [row[k] for k in ("params", "grads", "optimizer", "comm_buffers", "gathered", "activations",
                                  "device_peak")]
        host = f"  (+{size(row['host'])} in CPU memory)" if row["host"] else ""
        lines.append(f"  {row['strategy']:<14}" + "".join(f"{size(c):>13}" for c in cells) + host)
    return "\n".join(lines)
