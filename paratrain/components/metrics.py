"""Metric logging: the mean over ranks of scalar metrics, one CSV row per call, written on rank 0.

    session = pt.Session(strategy="ddp", log_dir="runs/exp1")
    ...
    session.log(loss=loss, lr=optimizer.param_groups[0]["lr"])   # every rank calls it

Each call is a collective: the metrics are mean-reduced over the ranks in one all-reduce
(`mean_metrics`, below), then rank 0 appends a row `step, <metric>, ...` to `log_dir/metrics.csv`
and writes the same scalars to the other backends asked for (components/sinks.py: TensorBoard, used when
installed; Weights & Biases; MLflow).
A metric that appears in a later call (a validation loss logged once per epoch) adds a column:
the file is rewritten once with the wider header, and rows without a value leave it empty.
A resumed run appends to the same file.
"""

from __future__ import annotations

import csv
import hashlib
import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from paratrain.components.sinks import open_sinks
from paratrain.distributed.comm import all_reduce, group_device
from paratrain.errors import UsageError

CSV_NAME = "metrics.csv"


class MetricsLogger:
    """Mean-reduce scalar metrics over ranks and record them on the main rank.

    log_dir: directory of `metrics.csv` (and the backends' files); created on the main rank.
    is_main: whether this process writes (global rank 0); every rank still takes part in the mean.
    tensorboard: True requires TensorBoard, False never uses it, None uses it when installed.
    backends: the other places rows go: "tensorboard", "wandb", "mlflow" (components/sinks.py).
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
        """Write values every rank already agrees on (session/watch.py's events) as a row under
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
    return dist.is_available() and dist.is_initialized()


def mean_metrics(metrics: Mapping[str, Any] | float | torch.Tensor, group=None):
    """Mean over ranks of scalar metrics (floats or one-element tensors), in one all-reduce
    (after a one-number check that every rank passed the same names). A dict gives a dict of
    floats, a single value a float."""
    if not isinstance(metrics, Mapping):
        return _mean_scalars({"value": metrics}, group)["value"]
    return _mean_scalars(metrics, group)


def _mean_scalars(metrics: Mapping[str, Any], group) -> dict[str, float]:
    names = sorted(metrics)  # the same order on every rank, whatever order the dicts were built in
    for name in names:
        if isinstance(metrics[name], torch.Tensor) and metrics[name].numel() != 1:
            raise UsageError(f"mean_metrics takes scalars; {name!r} has shape "
                             f"{tuple(metrics[name].shape)}: reduce it to one number first")
    _check_same_names(names, group)
    values = torch.tensor([float(metrics[k]) for k in names], dtype=torch.float64, device=group_device(group))
    all_reduce(values, group=group, average=True)
    return dict(zip(names, values.tolist()))


def _check_same_names(names: list[str], group) -> None:
    """Every rank averages the same names: values are reduced by position, so other names would
    mix one metric with another (or, in another number, leave the ranks waiting). One all-reduce
    (MAX) of a fingerprint of the names and its negation: they agree when max == min."""
    fingerprint = int.from_bytes(hashlib.sha1("\0".join(names).encode()).digest()[:6], "big")  # exact in float64
    both = torch.tensor([fingerprint, -fingerprint], dtype=torch.float64, device=group_device(group))
    all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    if both[0].item() != -both[1].item():
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, names, group=group)
        listed = "; ".join(f"rank {rank}: {', '.join(them) or 'none'}" for rank, them in enumerate(everyone))
        raise UsageError(f"every rank must log (or average) the same metric names, but they differ ({listed}): "
                         "values are averaged name by name over the ranks; log the same names on every rank, "
                         "or print a metric of one rank's own with print()")
