"""Where metric rows go besides metrics.csv: TensorBoard, Weights & Biases, MLflow. Each is
imported only when asked for, writes on rank 0 only, and is closed with the session.

    tensorboard   event files in log_dir (used when installed, unless left out)
    wandb         wandb.init(project=..., dir=log_dir); offline when WANDB_MODE=offline
    mlflow        a run in MLFLOW_TRACKING_URI, or by default a file store in log_dir/mlruns
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from paratrain.errors import ConfigError

BACKENDS = ("tensorboard", "wandb", "mlflow")


class Sink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    def __init__(self, log_dir: Path, required: bool):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # torch.utils.tensorboard imports the tensorboard package
            if required:
                raise ConfigError("tensorboard=True needs the tensorboard package: pip install tensorboard "
                                  "(metrics.csv is written without it)") from None
            self.writer = None
            return
        self.writer = SummaryWriter(str(log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class WandB:
    def __init__(self, log_dir: Path, project: str):
        wandb = _import("wandb")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, dir=str(log_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, log_dir: Path, project: str):
        mlflow = _import("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # a local file store needs no server; MLflow keeps it working behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((log_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        self.mlflow, self.run = mlflow, mlflow.start_run()

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.mlflow.log_metrics(metrics, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def open_sinks(log_dir: Path, backends: tuple[str, ...], project: str, tensorboard: bool | None) -> list[Sink]:
    """The sinks `backends` names (tensorboard: `tensorboard` True requires it, None uses it when
    installed, False never)."""
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ConfigError(f"unknown logging backend(s) {unknown}; choose among {BACKENDS}")
    sinks: list[Sink] = []
    if "tensorboard" in backends and tensorboard is not False:
        sinks.append(TensorBoard(log_dir, required=bool(tensorboard)))
    if "wandb" in backends:
        sinks.append(WandB(log_dir, project))
    if "mlflow" in backends:
        sinks.append(MLflow(log_dir, project))
    return sinks


def _import(name: str) -> Any:
    try:
        return __import__(name)
    except ImportError:
        raise ConfigError(f"logging to {name} needs the {name} package: pip install {name}"
                          f"{'-skinny' if name == 'mlflow' else ''}") from None
