"""What a Session logs by itself: every `every` optimizer steps, one row of metrics.csv (and of
the other backends) with what a user would otherwise compute by hand:

    loss                 the last micro-batch's loss, the mean over ranks
    lr                   the first param group's learning rate
    grad_norm            the global gradient norm before clipping (when max_grad_norm is set)
    loss_scale, skipped_steps   fp16's scale and the steps it skipped so far
    samples_per_second   the global batch rate since the last row (the first row's: since the first
                         micro-batch); counted by train_step, so a custom step's rows leave it out
    tokens_per_second    the same in tokens, when the inputs are token ids (integer tensors of
                         rank >= 2, or a dict's input_ids)
    mfu                  model FLOPs utilisation, when Logging(flops_per_sample=, peak_flops=) say
                         what a sample costs and what one device can do

`session.log(**metrics)` stays the way to add your own: they land in the same files.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from paratrain.components.metrics import MetricsLogger
from paratrain.errors import ConfigError
from paratrain.session.progress import batch_len

if TYPE_CHECKING:
    from paratrain.session.session import Session
    from paratrain.session.step import StepResult


@dataclass(frozen=True)
class Logging:
    """What a Session logs by itself into Session(log_dir=...), and where."""

    every: int = 10  # optimizer steps between automatic rows; 0: none (session.log only)
    backends: tuple[str, ...] = ("tensorboard",)  # besides metrics.csv: "tensorboard", "wandb", "mlflow"
    project: str = "paratrain"  # the W&B project, or the MLflow experiment
    flops_per_sample: float | None = None  # the model's FLOPs per sample, forward and backward (MFU)
    peak_flops: float | None = None  # one device's peak FLOP/s in the training dtype (MFU)

    def __post_init__(self):
        if self.every < 0:
            raise ConfigError(f"Logging(every=...) is a number of optimizer steps, 0 or more; got {self.every}")
        object.__setattr__(self, "backends", tuple(self.backends))


class StepMeter:
    """Counts what each micro-batch held; writes a row every `every` optimizer steps."""

    def __init__(self, logging: Logging):
        self.logging = logging
        self.samples = self.tokens = self.steps = 0
        self.since: float | None = None  # the first micro-batch starts the clock, not Session()

    def on_batch(self, inputs: Any) -> None:
        """One micro-batch of this rank's (train_step's; a step hook, session/hooks.py)."""
        if self.since is None:
            self.since = time.perf_counter()
        self.samples += batch_len(inputs)
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else inputs
        if torch.is_tensor(ids) and ids.dim() >= 2 and not ids.is_floating_point():
            self.tokens += ids.numel()

    def after_step(self, session: "Session", result: "StepResult") -> None:
        """An optimizer step ended: every `every` of them, one row (a collective)."""
        self.steps += 1
        if not self.logging.every or self.steps % self.logging.every:
            return
        session.log(**self.row(session, result))
        self.samples = self.tokens = 0
        if self.since is not None:
            self.since = time.perf_counter()

    def row(self, session: "Session", result: "StepResult") -> dict[str, float]:
        counted = self.since is not None  # the same on every rank: they step alike
        elapsed = max(time.perf_counter() - self.since, 1e-9) if counted else 0.0
        replicas = session.model.replicas if session.model is not None else 1
        row = {"lr": float(session.optimizer.param_groups[0]["lr"])}
        if counted:  # a custom step (session.backward) counts no samples: no rate rather than 0
            row["samples_per_second"] = self.samples * replicas / elapsed
        if session.last_loss is not None:
            row["loss"] = float(session.last_loss)
        if self.tokens and counted:
            row["tokens_per_second"] = self.tokens * replicas / elapsed
        if result.grad_norm is not None:
            row["grad_norm"] = float(result.grad_norm)
        if session.scaler is not None:
            row.update(loss_scale=session.scaler.scale_value, skipped_steps=session.scaler.skipped_steps)
        if self.logging.flops_per_sample and self.logging.peak_flops and counted:
            per_device = self.logging.flops_per_sample * row["samples_per_second"] / session.world_size
            row["mfu"] = per_device / self.logging.peak_flops
        return row


def open_metrics(log_dir: str | os.PathLike | None, logging: Logging | None,
                 is_main: bool) -> tuple[MetricsLogger | None, StepMeter | None]:
    """The metrics files (when there is a log_dir) and the automatic rows (Logging(every=10) by default)."""
    if log_dir is None:
        if logging is not None:
            raise ConfigError("Session(logging=...) writes into a log_dir: pass Session(log_dir=...) too")
        return None, None
    logging = logging or Logging()
    metrics = MetricsLogger(log_dir, is_main=is_main, backends=logging.backends, project=logging.project)
    return metrics, StepMeter(logging) if logging.every else None
