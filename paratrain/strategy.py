"""Strategies: how a `Session` spreads one training step over the job's processes.

Every strategy is a frozen dataclass with the same small surface, so `Session` never branches on
which one it holds:

- `wrap(model, topology)`: the model the training loop calls (already on the device);
- `wrap_optimizer(optimizer, model, topology)`: the optimizer that steps it (sharded strategies
  rebuild or wrap it; the default checks it holds the model's parameters);
- `no_sync(model)`: a context in which backward accumulates gradients without communicating;
- `forward_backward(model, inputs, targets, loss_fn, scale)`: one micro-batch's forward, loss
  and backward of `loss * scale`; returns the loss (a pipeline runs its schedule here);
- `clip_grad_norm(model, max_norm)`: clip by the global norm (sharded strategies reduce it);
- `data_parallel(topology)`: (replicas, this replica's index) — how the data is sharded.

String shortcuts name the default instance of each (`"ddp"` is `DDP()`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.ddp import DistributedDataParallel
from paratrain.topology import Topology


class Strategy:
    """Base class; subclasses are frozen dataclasses."""

    name = "base"

    def wrap(self, model: nn.Module, topology: Topology) -> nn.Module:
        raise NotImplementedError

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       topology: Topology) -> torch.optim.Optimizer:
        check_optimizer_owns(optimizer, self.unwrap(model))
        return optimizer

    def no_sync(self, model: nn.Module) -> ContextManager:
        return contextlib.nullcontext()

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any,
                         loss_fn: Callable[[Any, Any], torch.Tensor], scale: float) -> torch.Tensor:
        loss = loss_fn(model(inputs), targets)
        (loss * scale).backward()
        return loss.detach()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

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


def check_optimizer_owns(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """The optimizer must step the parameters of the model given to setup()."""
    owned = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)
    if foreign:
        raise ConfigError(f"the optimizer holds {foreign} tensor(s) that are not parameters of the "
                          "model passed to setup(); create the optimizer from model.parameters() "
                          "of the same model")
