"""One process, one device: the reference every other strategy is proved against, and the same
code path as N ranks (the session's loop, checkpoints and logging do not change)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from paratrain.components.materialize import MetaInit, whole
from paratrain.distributed.grid import ProcessGrid
from paratrain.errors import ConfigError
from paratrain.parallel.base import ParallelModule, Strategy, owned


class SingleDevice(ParallelModule):
    """`module` on this process's device, with the protocol's defaults (parallel/base.py)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


@dataclass(frozen=True)
class Single(Strategy):
    """One process, one device."""

    name = "single"

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None):
        if grid.topology.world_size > 1:
            raise ConfigError(f"strategy 'single' runs one process, but this job has "
                              f"{grid.topology.world_size}; use strategy='ddp' or start one process")
        return SingleDevice(whole(model, init).to(grid.topology.device)), owned(optimizer, model)
