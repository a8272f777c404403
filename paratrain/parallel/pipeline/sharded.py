"""The replicas of a pipeline stage under ZeRO stage 1 or 2 (`pt.Mesh(pp=pt.Pipeline(...),
dp="zero1" | "zero2")`): Megatron's distributed optimizer over the data-parallel ranks of a stage.

Each chunk (virtual stage) gets what a ZeRO-1/2 model gets (zero/stage12.py), over the ranks that
hold the same stage: a bucketed gradient sync (grad_sync.py) whose reduction leaves replica r the
r-th slice of each bucket's average (all-reduce under stage 1, reduced to the owners under stage
2, the full gradients freed), and the flat parameters and owned slices of those buckets
(zero/bucket_shards.py). The stage starts a chunk's sync during its last weight-gradient action,
as under DDP (stage.py), so no slice is reduced before every micro-batch's weight gradients are in.
The optimizer (zero/stage12.py's ShardedOptimizer, built on this object) steps this replica's
slices of every chunk and all-gathers each chunk's parameters over the replicas.

A parameter that the last micro-batch's backward does not reach is refused, as ZeRO refuses one
any backward leaves out: a replica steps whole slices, so it would apply weight decay and
momentum where one process skips the parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.base import FlatLayout
from paratrain.parallel.grad_sync import GradSync
from paratrain.parallel.zero.bucket_shards import BucketShards
from paratrain.parallel.zero.collectives import OwnerCollectives
from paratrain.parallel.zero.owner_reduction import owner_reduction


class ShardedReplicas:
    """ZeRO `stage` (1 or 2) over `group`, the replicas of this pipeline stage, one set of
    buckets per chunk (`chunk_params`). `group_of`: each parameter's optimizer param group."""

    def __init__(self, chunk_params: list[list[nn.Parameter]], names: dict[nn.Parameter, str], group: Any, *,
                 stage: int, group_of: dict[nn.Parameter, int], caps: list[int],
                 collectives: OwnerCollectives | None = None):
        self.collectives = collectives or OwnerCollectives.for_group(group)
        where = dict(group=group, rank=dist.get_rank(group), world=dist.get_world_size(group), group_of=group_of)
        self.params = [p for params in chunk_params for p in params if p.requires_grad]
        self.syncs: list[GradSync] = []
        self.owned: list[BucketShards] = []
        for params in chunk_params:
            reduction = owner_reduction(stage, self.collectives.reduce_scatter, **where)
            sync = GradSync([p for p in params if p.requires_grad], names, group, reduction=reduction, caps=caps,
                            find_unused=False, finish_in_backward=False)
            self.syncs.append(sync)
            self.owned.append(BucketShards(sync.buckets.buckets, reduction, self.collectives, group))
        self._bucket_groups = [o.bucket_group(i) for o in self.owned for i in range(len(o.shards))]

    # -- what zero/stage12.py's ShardedOptimizer asks of its model ------------------------------

    @property
    def shards(self) -> list[nn.Parameter]:
        """This replica's slices, chunk by chunk, bucket by bucket."""
        return [s for owned in self.owned for s in owned.shards]

    def bucket_group(self, index: int) -> int:
        """The optimizer param group of shard `index`."""
        return self._bucket_groups[index]

    def attach_shard_grads(self) -> None:
        for owned in self.owned:
            owned.attach_grads()

    def gather_params(self) -> None:
        for owned in self.owned:
            owned.gather()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for owned in self.owned:
            owned.zero_grad()

    # -- what the stage's protocol reads ----------------------------------------------------------

    def grads(self) -> list[torch.Tensor]:
        """This replica's slices of the averaged gradients of every chunk."""
        return [g for owned in self.owned for g in owned.grads()]

    def flat_layouts(self, names: dict[nn.Parameter, str]) -> dict[torch.Tensor, FlatLayout]:
        """Each shard → the parameters it holds, under `names` (their names in the whole model)."""
        return {shard: layout for owned in self.owned for shard, layout in owned.flat_layouts(names).items()}
