"""`shard(model, optimizer, stage=…)`: ZeRO stage 1, 2 or 3 without a Session."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.zero import shard_data_parallel


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int, process_group=None,
          bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True):
    """Shard `model` (already on this rank's device) and `optimizer` (made from its parameters)
    over the data-parallel group. Returns (model, optimizer) to train with as usual.

    stage 1: optimizer state sharded; stage 2: gradients too; stage 3: parameters too.
    """
    if stage in (1, 2):
        return shard_data_parallel(model, optimizer, stage=stage, process_group=process_group,
                                   bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers)
    raise ConfigError(f"ZeRO has stages 1, 2 and 3; got stage={stage!r}")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict with the user's keys, whatever the strategy that wraps it."""
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    return getattr(model, "module", model).state_dict()
