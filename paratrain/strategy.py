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
- `local_grads(model)`: the gradients this rank holds after backward and the group holding the
  rest (the fp16 grad scaler's inf check and the token normalisation work on these);
- `data_parallel(topology)`: (replicas, this replica's index) — how the data is sharded;
- `check_loader(loader)`: refuse, at setup, a sharded loader whose batches the strategy cannot
  take (the pipeline's micro-batches must divide every batch, the epoch's last included).

String shortcuts name the default instance of each (`"ddp"` is `DDP()`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import ConfigError
from paratrain.optim import check_optimizer_owns
from paratrain.parallel.ddp import DistributedDataParallel
from paratrain.parallel.shard import shard
from paratrain.parallel.wrap_policy import DEFAULT_WRAP_POLICY, WrapPolicy
from paratrain.topology import Topology


class Strategy:
    """Base class; subclasses are frozen dataclasses."""

    name = "base"

    def wrap(self, model: nn.Module, topology: Topology) -> nn.Module:
        raise NotImplementedError

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
              topology: Topology) -> tuple[nn.Module, torch.optim.Optimizer | None]:
        """The wrapped model and the optimizer that steps it."""
        model = self.wrap(model, topology)
        if optimizer is not None:
            optimizer = self.wrap_optimizer(optimizer, model, topology)
        return model, optimizer

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                       topology: Topology) -> torch.optim.Optimizer:
        check_optimizer_owns(optimizer, self.unwrap(model).parameters())
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

    def local_grads(self, model: nn.Module) -> tuple[list[torch.Tensor], Any]:
        """After backward (and its gradient communication): the gradients this rank holds, and
        the process group whose ranks hold the other parts, over which a flag such as "found an
        inf" must be reduced. None: every rank holds them all (replicated strategies, whose
        all-reduce already gave every rank the same gradients), nothing to reduce."""
        return [p.grad for p in model.parameters() if p.grad is not None], None

    def data_parallel(self, topology: Topology) -> tuple[int, int]:
        return topology.world_size, topology.rank

    def check_loader(self, loader: Any) -> None:
        pass

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
        return self._wrapper(model, topology, device_ids=device_ids, bucket_cap_mb=self.bucket_cap_mb,
                             find_unused_parameters=self.find_unused_parameters,
                             broadcast_buffers=self.broadcast_buffers)

    def _wrapper(self, model: nn.Module, topology: Topology, **ddp_kwargs) -> nn.Module:
        """The wrapper class; hierarchical data parallel swaps in its own."""
        return DistributedDataParallel(model, **ddp_kwargs)

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()


@dataclass(frozen=True)
class ZeRO(Strategy):
    """Sharded data parallel (ZeRO): stage 1 shards optimizer state, 2 also gradients, 3 also
    parameters. The optimizer given to setup() is sharded (stage 1, 2) or rebuilt for the
    shards (stage 3); use the one setup() returns."""

    stage: int = 1  # 1, 2 or 3
    bucket_cap_mb: float = 25.0  # stages 1 and 2: gradient bucket size cap
    wrap_policy: WrapPolicy = DEFAULT_WRAP_POLICY  # stage 3: what becomes a unit
    prefetch: bool = True  # stage 3: gather the next unit while this one computes
    param_dtype: torch.dtype | None = None  # stage 3: gather/compute/reduce in bf16 or fp16
    offload: bool = False  # stage 3: shards and optimizer state in CPU memory

    @property
    def name(self) -> str:
        return f"zero{self.stage}"

    def setup(self, model, optimizer, topology):
        if optimizer is None:
            raise ConfigError(f"{self.name} shards the optimizer: pass it to setup(model, optimizer, …)")
        return shard(model.to(topology.device), optimizer, stage=self.stage,
                     bucket_cap_mb=self.bucket_cap_mb, wrap_policy=self.wrap_policy, prefetch=self.prefetch,
                     param_dtype=self.param_dtype, offload=self.offload)

    def no_sync(self, model: nn.Module) -> ContextManager:
        return model.no_sync()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return model.clip_grad_norm_(max_norm)

    def local_grads(self, model: nn.Module) -> tuple[list[torch.Tensor], Any]:
        """This rank's slices of the averaged gradients; the other slices are on the other
        data-parallel ranks."""
        if hasattr(model, "attach_shard_grads"):  # stages 1 and 2: point each shard at its slice
            model.attach_shard_grads()
        grads = [s.grad for s in model.shards if s.grad is not None]
        return grads, model.process_group or dist.group.WORLD


def strategies() -> dict[str, Callable[[], Strategy]]:
    """Each strategy name and the factory of its default object."""
    # imported here, not at the top: these modules import `Strategy` from this one
    from paratrain.parallel.dp import DP
    from paratrain.parallel.hierarchical import Hierarchical
    from paratrain.parallel.model_parallel import ModelParallel
    from paratrain.parallel.pipeline import Pipeline

    return {"single": Single, "dp": DP, "ddp": DDP, "hierarchical": Hierarchical,
            "zero1": functools.partial(ZeRO, stage=1), "zero2": functools.partial(ZeRO, stage=2),
            "zero3": functools.partial(ZeRO, stage=3), "model-parallel": ModelParallel,
            "pipeline": Pipeline}


def resolve(strategy: str | Strategy) -> Strategy:
    """A strategy object from a name or an object."""
    if isinstance(strategy, Strategy):
        return strategy
    known = strategies()
    if strategy not in known:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {sorted(known)} "
                          "or pass a strategy object such as paratrain.DDP(...)")
    return known[strategy]()
