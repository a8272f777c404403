"""`shard(model, optimizer, stage=…)`: ZeRO stage 1, 2 or 3 without a Session."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.optim import rebuild_optimizer
from paratrain.parallel.fsdp import FullyShardedDataParallel
from paratrain.parallel.wrap_policy import WrapPolicy
from paratrain.parallel.zero import (
    _check_elementwise,
    param_groups_of,
    shard_data_parallel,
)


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int, process_group=None,
          bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True,
          wrap_policy: WrapPolicy | None = None, prefetch: bool = True,
          param_dtype: torch.dtype | None = None, offload: bool = False):
    """Shard `model` (already on this rank's device) and `optimizer` (made from its parameters)
    over the data-parallel group. Returns (model, optimizer): train with those two, as usual.

    stage 1: optimizer state sharded; stage 2: gradients too; stage 3: parameters too, gathered
    unit by unit (`wrap_policy`, default `WrapPolicy(min_params=1_000_000)`) just before use. For stages 1 and 2 the model's parameters stay
    whole on every rank; for stage 3 the returned optimizer is a new one of the same class and
    hyperparameters holding the shards, and the old one must not be used. Stage 3 also takes
    `param_dtype` (gather, compute and reduce in bf16/fp16 while the shards and the optimizer
    state stay fp32) and `offload` (shards, gradients and optimizer state in CPU memory).
    """
    if stage in (1, 2):
        if param_dtype is not None or offload:
            raise ConfigError(f"param_dtype and offload are implemented for stage 3; got stage {stage}")
        return shard_data_parallel(model, optimizer, stage=stage, process_group=process_group,
                                   bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers)
    if stage == 3:
        _check_elementwise(optimizer)
        wrapped = FullyShardedDataParallel(model, group_of=param_groups_of(model, optimizer),
                                           process_group=process_group, wrap_policy=wrap_policy,
                                           prefetch=prefetch, param_dtype=param_dtype, offload=offload)
        return wrapped, rebuild_optimizer(optimizer, [
            [s for s, g in zip(wrapped.shards, wrapped.shard_groups) if g == index]
            for index in range(len(optimizer.param_groups))])
    raise ConfigError(f"ZeRO has stages 1, 2 and 3; got stage={stage!r}")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict with the user's keys, whatever the strategy that wraps it."""
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    return getattr(model, "module", model).state_dict()
