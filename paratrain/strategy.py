"""Strategies: how a `Session` spreads one training step over the job's processes.

Every strategy is a frozen dataclass with the same small surface, so `Session` never branches on
which one it holds:

- `wrap(model, topology)`: the model the training loop calls (already on the device);
- `no_sync(model)`: a context in which backward accumulates gradients without communicating;
- `data_parallel(topology)`: (replicas, this replica's index) — how the data is sharded.

String shortcuts name the default instance of each (`"ddp"` is `DDP()`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.ddp import DistributedDataParallel
from paratrain.topology import Topology


class Strategy:
    """Base class; subclasses are frozen dataclasses."""

    name = "base"

    def wrap(self, model: nn.Module, topology: Topology) -> nn.Module:
        raise NotImplementedError

    def no_sync(self, model: nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def data_parallel(self, topology: Topology) -> tuple[int, int]:
        return topology.world_size, topology.rank

    def unwrap(self, model: nn.Module) -> nn.Module:
        return getattr(model, "module", model)


@dataclass(frozen=True)
class Single(Strategy):
    """One process, one device: the reference every other strategy is proved against."""

    name = "single"

    def wrap(self, model: nn.Module, topology: Topology) -> nn.Module:
        if topology.world_size > 1:
            raise ConfigError(f"strategy 'single' runs one process, but this job has "
                              f"{topology.world_size}; use strategy='ddp' or start one process")
        return model.to(topology.device)

    def data_parallel(self, topology: Topology) -> tuple[int, int]:
        return 1, 0


@dataclass(frozen=True)
class DDP(Strategy):
    """Data parallel, one process per device, gradients all-reduced in buckets during backward."""

    name = "ddp"
    bucket_cap_mb: float = 25.0  # size cap of each gradient bucket (the first is 1 MiB)
    find_unused_parameters: bool = False  # allow parameters that get no gradient in a step
    broadcast_buffers: bool = True  # broadcast rank 0's buffers (BatchNorm statistics) each forward

    def wrap(self, model: nn.Module, topology: Topology) -> nn.Module:
        model = model.to(topology.device)
        device_ids = [topology.device.index] if topology.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb,
                                       find_unused_parameters=self.find_unused_parameters,
                                       broadcast_buffers=self.broadcast_buffers)

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()


STRATEGIES: dict[str, type[Strategy]] = {"single": Single, "ddp": DDP}


def resolve(strategy: str | Strategy) -> Strategy:
    """A strategy object from a name or an object."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)} "
                          "or pass a strategy object such as paratrain.DDP(...)")
    return STRATEGIES[strategy]()
