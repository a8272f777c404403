"""Naive model parallelism: consecutive groups of a model's layers on several devices, one process.

A model too large for one device runs across several: part k of the layers lives on device k and
the activation moves from one device to the next with `.to()`; autograd carries the gradients
back across the same copies. Alone, this keeps one device busy at a time (each waits for the one
before it). Cutting the batch into micro-batches fixes that: at tick t, part k works on
micro-batch t - k, so on CUDA — where kernels are queued asynchronously, one queue per device —
all parts compute at once on different micro-batches (GPipe's idea in one process, Huang et al.
2019; the pipelined `ModelParallelResNet50` of PyTorch's "Single-Machine Model Parallel Best
Practices" tutorial). On CPU the ticks run one after another: the same numbers, no speed-up.

The arithmetic equals one device's: micro-batches are only a different order of the same rows,
except in layers that mix rows (BatchNorm sees each micro-batch's statistics, as in GPipe).

    model = LayersOnDevices(nn.Sequential(...), ["cuda:0", "cuda:1"], microbatches=4)
    session = pt.Session(strategy=ModelParallel(devices=("cuda:0", "cuda:1"), microbatches=4))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from paratrain.components.materialize import MetaInit, whole
from paratrain.distributed.grid import ProcessGrid
from paratrain.errors import ConfigError
from paratrain.parallel.base import LossFn, ParallelModule, Strategy, owned
from paratrain.parallel.pipeline.partition import BALANCES, layer_costs, split_model


class LayersOnDevices(ParallelModule):
    """`model` (an nn.Sequential, or a list of parts) cut into len(devices) parts, part k on
    devices[k]. The user's model stays at `.module`, so state-dict keys are "module." + its keys.

    microbatches: cut each batch into this many equal micro-batches that flow through the parts
        one tick apart (1: the whole batch at once).
    balance: how to cut an nn.Sequential: "layers" or "params" (see pipeline/partition.py).
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], devices: Sequence[str | torch.device],
                 *, microbatches: int = 1, balance: str = "layers"):
        super().__init__()
        if microbatches < 1 or not devices:
            raise ConfigError(f"LayersOnDevices needs at least one device and microbatches >= 1; "
                              f"got devices={list(devices)}, microbatches={microbatches}")
        if balance not in ("layers", "params"):
            raise ConfigError(f"balance must be 'layers' or 'params' here; got {balance!r}")
        self.devices = [torch.device(d) for d in devices]
        self.microbatches = microbatches
        self.module = model if isinstance(model, nn.Module) else nn.ModuleList(model)
        costs = layer_costs(model, balance) if isinstance(model, nn.Sequential) else None
        # a plain list, not a ModuleList: the parameters are registered once, under .module
        self.parts = [part.to(d) for part, d in zip(split_model(model, len(self.devices), costs=costs),
                                                    self.devices)]

    @property
    def output_device(self) -> torch.device:
        """Where the output lands: the last part's device."""
        return self.devices[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.microbatches == 1:
            for part, device in zip(self.parts, self.devices):
                x = part(x.to(device))
            return x
        if x.shape[0] % self.microbatches:
            raise ConfigError(f"{self.microbatches} micro-batches do not divide the batch of "
                              f"{x.shape[0]}: use a batch size that is a multiple of {self.microbatches}")
        return torch.cat(self._ticks(list(x.chunk(self.microbatches))))

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float) -> torch.Tensor:
        """The loss is computed where the output lands, the last device."""
        if torch.is_tensor(targets):
            targets = targets.to(self.output_device)
        return super().forward_backward(inputs, targets, loss_fn, scale)

    def _ticks(self, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Tick t: part k runs micro-batch t - k. Later parts are queued first within a tick, so
        the device that has waited longest gets its work first."""
        k, m = len(self.parts), len(chunks)
        for t in range(m + k - 1):
            for j in reversed(range(k)):
                i = t - j
                if 0 <= i < m:
                    chunks[i] = self.parts[j](chunks[i].to(self.devices[j]))
        return chunks


@dataclass(frozen=True)
class ModelParallel(Strategy):
    """One process, the model's layers spread over several devices (`LayersOnDevices`)."""

    name = "model-parallel"
    devices: tuple[str, ...] | None = None  # e.g. ("cuda:0", "cuda:1"); None: every CUDA device
    microbatches: int = 1  # micro-batches per batch, so the devices work at the same time
    balance: str = "layers"  # cut an nn.Sequential by "layers" or "params"

    def __post_init__(self):
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(str(d) for d in self.devices))  # hashable
        if self.balance not in BALANCES[:2]:
            raise ConfigError(f"balance must be 'layers' or 'params'; got {self.balance!r}")

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None):
        if grid.topology.world_size > 1:
            raise ConfigError(f"strategy 'model-parallel' runs in one process, but this job has "
                              f"{grid.topology.world_size}; start one process, or use "
                              "pt.Pipeline(stages=...) to spread stages over processes")
        wrapped = LayersOnDevices(whole(model, init), self._devices(), microbatches=self.microbatches,
                                  balance=self.balance)
        return wrapped, owned(optimizer, model)

    def _devices(self) -> tuple[str, ...]:
        if self.devices is not None:
            return self.devices
        if torch.cuda.device_count() == 0:
            raise ConfigError("ModelParallel() with no devices uses every CUDA device, and this "
                              "machine has none: pass devices=('cpu', 'cpu') to try it on CPU")
        return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))
