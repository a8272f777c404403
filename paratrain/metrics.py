"""Metric logging: the mean over ranks of scalar metrics, one CSV row per call, written on rank 0.

    session = pt.Session(strategy="ddp", log_dir="runs/exp1")
    ...
    session.log(loss=loss, lr=optimizer.param_groups[0]["lr"])   # every rank calls it

Each call is a collective: the metrics are mean-reduced over the ranks in one all-reduce
(`comm.mean_metrics`), then rank 0 appends a row `step, <metric>, ...` to `log_dir/metrics.csv`
and writes the same scalars to the other backends asked for (sinks.py: TensorBoard, used when
installed; Weights & Biases; MLflow).
A metric that appears in a later call (a validation loss logged once per epoch) adds a column:
the file is rewritten once with the wider header, and rows without a value leave it empty.
A resumed run appends to the same file.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from paratrain.comm import mean_metrics
from paratrain.errors import UsageError
from paratrain.sinks import open_sinks

CSV_NAME = "metrics.csv"


class MetricsLogger:
    """Mean-reduce scalar metrics over ranks and record them on the main rank.

    log_dir: directory of `metrics.csv` (and the backends' files); created on the main rank.
    is_main: whether this process writes (global rank 0); every rank still takes part in the mean.
    tensorboard: True requires TensorBoard, False never uses it, None uses it when installed.
    backends: the other places rows go: "tensorboard", "wandb", "mlflow" (sinks.py).
    project: the W&B project, or MLflow experiment.
    group: the process group to average over (default: the whole job).
    """

    def __init__(self, log_dir: str | os.PathLike, *, is_main: bool, tensorboard: bool | None = None,
                 backends: tuple[str, ...] = ("tensorboard",), project: str = "paratrain", group=None):
        self.log_dir, self.is_main, self.group = Path(log_dir), is_main, group
        self.path = self.log_dir / CSV_NAME
        self.columns: list[str] | None = None  # the CSV header, read on first write
        self._sinks = open_sinks(self.log_dir, tuple(backends), project, tensorboard) if is_main else []

    def log(self, step: int, /, **metrics: Any) -> dict[str, float]:
        """Average `metrics` (floats or one-element tensors) over ranks and record them under
        `step`. A collective: every rank calls it with the same names. Returns the means."""
        if not metrics:
            raise UsageError("log() needs at least one metric, e.g. session.log(loss=loss)")
        if "step" in metrics:
            raise UsageError("'step' is the row's key; name the metric otherwise")
        means = mean_metrics(metrics, group=self.group) if _distributed() else _floats(metrics)
        if self.is_main:
            self._append({"step": step, **means})
            for sink in self._sinks:
                sink.write(step, means)
        return means

    def record(self, step: int, /, **values: float) -> None:
        """Write values every rank already agrees on (step_watch.py's events) as a row under
        `step`, on the main rank, without averaging: not a collective, any rank may call it."""
        if self.is_main:
            row = _floats(values)
            self._append({"step": step, **row})
            for sink in self._sinks:
                sink.write(step, row)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []

    def _append(self, row: dict[str, Any]) -> None:
        if self.columns is None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.columns = _header(self.path)
        new = [k for k in row if k not in self.columns]
        if new or not self.path.exists():
            self._rewrite(self.columns + new)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self, columns: list[str]) -> None:
        """The file with a wider header (rarely: once per new metric), replaced atomically."""
        rows = []
        if self.path.exists():
            with open(self.path, newline="") as f:
                rows = list(csv.DictReader(f))
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(partial, self.path)
        self.columns = columns


def _header(path: Path) -> list[str]:
    if not path.exists():
        return ["step"]
    with open(path, newline="") as f:
        return next(csv.reader(f), ["step"])


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics of a process that is not part of a job: its own values."""
    for name, value in metrics.items():
        if getattr(value, "numel", lambda: 1)() != 1:
            raise UsageError(f"log() takes scalars; {name!r} has shape {tuple(value.shape)}: "
                             "reduce it to one number first")
    return {k: float(v) for k, v in metrics.items()}


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()
