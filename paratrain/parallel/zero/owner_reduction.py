"""The bucket reductions that make our DDP ZeRO stages 1 and 2 (stage12.py): each bucket is one
optimizer param group, padded to N equal slices, and rank r keeps slice r of its reduced gradient.

    OwnerReduction    stage 1: all-reduce each bucket; rank r reads slice r
    ScatterToOwners   stage 2: reduce each bucket to its owners (collectives.reduce_to_owners),
                      keep this rank's slice, free the full gradients

Each counts the synchronised backwards it finished (`backwards`), so master shards know when the
reduced slices last changed (stage12.py, [Note: master shards]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.parallel.buckets import Bucket, ReducedSums, Reduction
from paratrain.parallel.zero.collectives import add_into, reduce_to_owners


def across_replicas(reduced: list[torch.Tensor], replicate: Any) -> None:
    """Hybrid sharding: each of `reduced` (a mean over its shard group) averaged over the
    replicas too, so it is the mean over every data-parallel rank."""
    if replicate is None:
        return
    works = [dist.all_reduce(t, group=replicate, async_op=True) for t in reduced]
    copies = dist.get_world_size(replicate)
    for work, t in zip(works, reduced):
        work.wait()
        t.mul_(1.0 / copies)


def owner_reduction(stage: int, reduce_scatter: bool, **where: Any) -> "OwnerReduction":
    """Stage 1's or stage 2's reduction; `where`: OwnerReduction's group, rank, world, group_of
    and replicate."""
    return OwnerReduction(**where) if stage == 1 else ScatterToOwners(**where, reduce_scatter=reduce_scatter)


@dataclass
class OwnerReduction(Reduction):
    """Stage 1: each bucket (one optimizer param group) is all-reduced; rank r steps slice r."""

    group: Any
    rank: int
    world: int
    group_of: dict[nn.Parameter, int]  # each parameter's optimizer param group
    works: list[dist.Work] = field(default_factory=list)
    sums: ReducedSums | None = None  # the finite check's sums of whole reductions (collectives.py)
    reducing: list[Bucket] = field(default_factory=list)  # the buckets the works reduce
    backwards: int = 0  # synchronised backwards finished: when the reduced slices last changed
    # hybrid sharding: the ranks holding the same slices in the other groups of `world` ranks
    # (stage12.py); each reduced slice is then averaged over them as well
    replicate: Any = None
    rebuild = False  # the parameters live in the buckets' layout
    unused_advice = ("ZeRO stages 1 and 2 cannot leave a parameter out (the optimizer steps whole "
                     "slices of a bucket: it would apply momentum and weight decay where one process "
                     "skips the parameter); use DDP with find_unused_parameters=True")

    @property
    def pad_to(self) -> int:  # every bucket cuts into N equal slices
        return self.world

    def key(self, p: nn.Parameter) -> int:
        return self.group_of[p]

    def start(self, bucket: Bucket) -> None:
        self.works.append(dist.all_reduce(bucket.buffer, group=self.group, async_op=True))
        self.reducing.append(bucket)

    def finish(self) -> None:
        for work, bucket in zip(self.works, self.reducing):
            work.wait()
            if self.sums is not None:
                self.sums.add(bucket.buffer)
        across_replicas([b.buffer for b in self.reducing], self.replicate)  # the whole bucket: every .grad is the mean
        self.works.clear()
        self.reducing.clear()
        self.backwards += 1

    def shard_grad(self, bucket: Bucket) -> torch.Tensor | None:
        """This rank's slice of the bucket's averaged gradient."""
        return bucket.buffer.view(self.world, -1)[self.rank]

    def free(self, buckets: list[Bucket]) -> None:
        """The layout is final (stage 2 frees the full gradients until backward fills them)."""

    def zero_grad(self) -> None:
        """Forget the reduced slices (stage 1 reads them in the buckets) and what the finite
        check summed of them."""
        if self.sums is not None:
            self.sums.reset()


@dataclass
class ScatterToOwners(OwnerReduction):
    """Stage 2: each bucket is reduced to its owners, then its full gradients are freed; one
    reduction in flight, so full gradients never pile up during backward (at most the bucket
    being filled, plus one)."""

    reduce_scatter: bool = False  # else all-reduce and keep the slice (collectives.reduce_to_owners)
    shard_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # bucket index → this rank's slice
    _pending: list[tuple[Bucket, Any, torch.Tensor]] = field(default_factory=list)

    def before_fill(self, bucket: Bucket) -> None:
        buffer = bucket.buffer
        if buffer.untyped_storage().size() == 0:  # freed by the previous backward
            buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
            buffer[bucket.offsets[-1] + bucket.params[-1].numel():].zero_()  # the padding

    def start(self, bucket: Bucket) -> None:
        self.finish()
        work, mine = reduce_to_owners(bucket.buffer, self.group, rank=self.rank, world=self.world,
                                      scatter=self.reduce_scatter)
        self._pending.append((bucket, work, mine))

    def finish(self) -> None:
        for bucket, work, mine in self._pending:
            work.wait()
            if self.sums is not None:  # made only where each reduction is whole
                self.sums.add(bucket.buffer)
            across_replicas([mine], self.replicate)
            self.shard_grads[bucket.index] = add_into(self.shard_grads.get(bucket.index), mine)
            for p in bucket.params:
                p.grad = None
            bucket.buffer.untyped_storage().resize_(0)  # the full gradients live only in backward
        self._pending.clear()
        self.backwards += 1

    def shard_grad(self, bucket: Bucket) -> torch.Tensor | None:
        return self.shard_grads.get(bucket.index)

    def free(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            bucket.buffer.untyped_storage().resize_(0)
        self.shard_grads.clear()

    def zero_grad(self) -> None:
        super().zero_grad()
        self.shard_grads.clear()
