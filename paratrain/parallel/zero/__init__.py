"""Sharded data parallel (ZeRO, Rajbhandari et al. SC 2020): stage 1 shards optimizer state,
stage 2 also gradients, stage 3 also parameters.

    stage12.py      stages 1 and 2: our DDP with padded buckets and flat parameters; the stage is
                    the bucket reduction (all-reduce / reduce to the owners)
    bucket_shards.py  stages 1 and 2: the flat parameters of a set of buckets and this rank's
                    slices, which the optimizer steps (the model's, or a pipeline chunk's)
    stage3.py       stage 3: units gathered just before use and freed after (FSDP)
    flat_shard.py   one unit's flat, sharded parameters and their gather / reduce lifecycle
    units.py        how stage 3 takes a model apart into units
    wrap_policy.py  which submodules become units
    collectives.py  the collectives only ZeRO uses (reduce to owners, gather from owners)
    components/optim.py        what ZeRO asks of the user's optimizer

`shard(model, optimizer, stage=…)` applies a stage without a Session; `ZeRO(stage=…)` is the
strategy a Session takes (`"zero1"`, `"zero2"`, `"zero3"`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.components.materialize import MetaInit, has_meta, whole
from paratrain.components.optim import rebuild_optimizer
from paratrain.distributed.comm import group_device
from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import Topology
from paratrain.errors import ConfigError
from paratrain.parallel.base import Strategy
from paratrain.parallel.zero.collectives import OwnerCollectives
from paratrain.parallel.zero.optim import check_steps_on_cpu, param_groups_of
from paratrain.parallel.zero.stage3 import FullyShardedDataParallel
from paratrain.parallel.zero.stage12 import ShardedOptimizer, ZeroDataParallel, shard_data_parallel
from paratrain.parallel.zero.wrap_policy import DEFAULT_WRAP_POLICY, WrapPolicy

__all__ = ["ZeRO", "shard", "WrapPolicy", "OwnerCollectives", "ZeroDataParallel", "ShardedOptimizer",
           "FullyShardedDataParallel"]


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int, process_group=None,
          bucket_cap_mb: float | None = None, broadcast_buffers: bool = True,
          wrap_policy: WrapPolicy | None = None, prefetch: bool = True,
          param_dtype: torch.dtype | None = None, offload: bool = False,
          collectives: OwnerCollectives | None = None, init: MetaInit | None = None,
          device: torch.device | None = None, replicate_group=None):
    """Shard `model` (already on this rank's device) and `optimizer` (made from its parameters)
    over the data-parallel group. Returns (model, optimizer): train with those two, as usual.

    stage 1: optimizer state sharded; stage 2: gradients too; stage 3: parameters too, gathered
    unit by unit (`wrap_policy`, default `WrapPolicy(min_params=1_000_000)`) just before use.
    For stages 1 and 2 the model's parameters stay whole on every rank; for stage 3 the returned
    optimizer is a new one of the same class and hyperparameters holding the shards, and the old
    one must not be used. Every stage takes `param_dtype` (compute, reduce and gather in
    bf16/fp16 while the optimizer steps fp32 master shards) and `offload` (the master shards,
    their gradients and the optimizer state in CPU memory; the optimizer steps there).
    `collectives`: which collectives move slices to and from their owners (default: what is
    fastest on the group's backend).

    A model built on the meta device gets its values by `init`'s rule (components/materialize.py) on
    `device` (default: the group's): whole for stages 1 and 2, and for stage 3 unit by unit,
    each rank keeping only its shards. `replicate_group`: hybrid sharding, the groups holding the
    same shards as `process_group`'s ranks (stage3.py, stage12.py).
    """
    device = device or group_device(process_group)
    if offload:
        check_steps_on_cpu(optimizer)
    if stage in (1, 2):
        if has_meta(model):
            model = whole(model, init).to(device)
        return shard_data_parallel(model, optimizer, stage=stage, process_group=process_group,
                                   bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers,
                                   collectives=collectives, param_dtype=param_dtype, offload=offload,
                                   replicate_group=replicate_group)
    if stage == 3:
        wrapped = FullyShardedDataParallel(model, group_of=param_groups_of(model, optimizer),
                                           process_group=process_group, wrap_policy=wrap_policy,
                                           prefetch=prefetch, param_dtype=param_dtype, offload=offload,
                                           collectives=collectives, init=init, device=device,
                                           broadcast_buffers=broadcast_buffers, replicate_group=replicate_group)
        return wrapped, rebuild_optimizer(optimizer, [
            [s for s, g in zip(wrapped.shards, wrapped.shard_groups) if g == index]
            for index in range(len(optimizer.param_groups))])
    raise ConfigError(f"ZeRO has stages 1, 2 and 3; got stage={stage!r}")


@dataclass(frozen=True)
class ZeRO(Strategy):
    """Sharded data parallel (ZeRO): stage 1 shards optimizer state, 2 also gradients, 3 also
    parameters. The optimizer given to setup() is sharded (stage 1, 2) or rebuilt for the
    shards (stage 3); use the one setup() returns."""

    stage: int = 1  # 1, 2 or 3
    bucket_cap_mb: float | None = None  # stages 1 and 2: bucket size cap (None: 1 MiB first, then 25)
    wrap_policy: WrapPolicy = DEFAULT_WRAP_POLICY  # stage 3: what becomes a unit
    prefetch: bool = True  # stage 3: gather the next unit while this one computes
    param_dtype: torch.dtype | None = None  # compute/reduce/gather in bf16 or fp16, fp32 masters
    offload: bool = False  # master shards and optimizer state in CPU memory, stepped there
    collectives: OwnerCollectives | None = None  # None: the fastest on the backend
    replicate: int = 1  # hybrid sharding: shard within world / replicate ranks, all-reduce across

    @property
    def name(self) -> str:
        return f"zero{self.stage}"

    def __post_init__(self):
        if not isinstance(self.replicate, int) or self.replicate < 1:
            raise ConfigError(f"ZeRO(replicate=...) is the number of groups that each hold the whole sharded "
                              f"model, a positive integer; got {self.replicate!r}")

    def grid(self, topology: Topology) -> ProcessGrid:
        return ProcessGrid(topology, replicate=self.replicate)

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None):
        if optimizer is None:
            raise ConfigError(f"{self.name} shards the optimizer: pass it to setup(model, optimizer, …)")
        device = grid.topology.device
        # hybrid sharding (grid.replicate > 1): shard over the "shard" ranks, all-reduce across "replicate"
        group, replicate = (grid.group("shard")[0], grid.group("replicate")[0]) if grid.replicate > 1 \
            else (grid.data_group(), None)
        return shard(model if has_meta(model) else model.to(device), optimizer, stage=self.stage,
                     bucket_cap_mb=self.bucket_cap_mb, wrap_policy=self.wrap_policy, prefetch=self.prefetch,
                     param_dtype=self.param_dtype, offload=self.offload, collectives=self.collectives,
                     init=init, device=device, process_group=group, replicate_group=replicate)
