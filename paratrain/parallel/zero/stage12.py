"""ZeRO stages 1 and 2: optimizer state, then gradients, sharded across data-parallel ranks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), §5.1–5.2. Bytes per rank for Ψ fp32 parameters trained with Adam on N ranks:

    DDP      4Ψ params + 4Ψ grads + 8Ψ   Adam state
    stage 1  4Ψ params + 4Ψ grads + 8Ψ/N Adam state
    stage 2  4Ψ params + 4Ψ/N grads + 8Ψ/N Adam state

Layout: the DDP buckets (buckets.py: reverse parameter order, capped, one optimizer param group
per bucket) are zero-padded to a multiple of N, and the parameters become views into one flat
buffer per bucket with the same layout as the gradient bucket. Rank r owns slice r of every
bucket, as Megatron-core's distributed optimizer does: its optimizer steps a parameter "shard"
that is a view of that slice, so an updated shard is already in place for the all-gather.

    backward:  grads → buckets → stage 1: all-reduce        stage 2: reduce to the owners,
                                                                      free the full bucket
    step:      inner optimizer steps this rank's slices, then all-gather every bucket's params

The stage is the bucket reduction our DDP is given (buckets.Reduction): stage 1 all-reduces each
bucket and rank r reads slice r; stage 2 reduces each bucket to its owners with
`collectives.reduce_to_owners` (a reduce-scatter on nccl, an all-reduce keeping this rank's slice
on gloo, measured faster there) and frees it. The buckets are never re-laid out after the first
backward, as DDP's are: the parameters live in their layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import ConfigError
from paratrain.optim import clip_grad_norm_over, rebuild_optimizer
from paratrain.parallel.base import CheckpointLayout, FlatLayout
from paratrain.parallel.buckets import Bucket, Reduction
from paratrain.parallel.ddp import DistributedDataParallel
from paratrain.parallel.zero.collectives import (OwnerCollectives, add_into, gather_from_owners,
                                                 reduce_to_owners)
from paratrain.parallel.zero.optim import param_groups_of


@dataclass
class OwnerReduction(Reduction):
    """Stage 1: each bucket (one optimizer param group) is all-reduced; rank r steps slice r."""

    group: Any
    rank: int
    world: int
    group_of: dict[nn.Parameter, int]  # each parameter's optimizer param group
    works: list[dist.Work] = field(default_factory=list)
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

    def finish(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()

    def shard_grad(self, bucket: Bucket) -> torch.Tensor | None:
        """This rank's slice of the bucket's averaged gradient."""
        return bucket.buffer.view(self.world, -1)[self.rank]

    def free(self, buckets: list[Bucket]) -> None:
        """The layout is final (stage 2 frees the full gradients until backward fills them)."""

    def zero_grad(self) -> None:
        """Forget the reduced slices (stage 1 reads them in the buckets: nothing to forget)."""


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
            self.shard_grads[bucket.index] = add_into(self.shard_grads.get(bucket.index), mine)
            for p in bucket.params:
                p.grad = None
            bucket.buffer.untyped_storage().resize_(0)  # the full gradients live only in backward
        self._pending.clear()

    def shard_grad(self, bucket: Bucket) -> torch.Tensor | None:
        return self.shard_grads.get(bucket.index)

    def free(self, buckets: list[Bucket]) -> None:
        for bucket in buckets:
            bucket.buffer.untyped_storage().resize_(0)
        self.shard_grads.clear()

    def zero_grad(self) -> None:
        self.shard_grads.clear()


class ZeroDataParallel(DistributedDataParallel):
    """DDP whose buckets are padded and whose parameters are flat, so each rank can own 1/N of
    every bucket. Build it with `paratrain.shard(model, optimizer, stage=1|2)`."""

    def __init__(self, module: nn.Module, *, reduction: OwnerReduction, collectives: OwnerCollectives,
                 process_group=None, bucket_cap_mb: float | None = None, broadcast_buffers: bool = True):
        super().__init__(module, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
                         broadcast_buffers=broadcast_buffers, reduction=reduction)
        self._reduction, self.collectives = reduction, collectives
        self.param_buffers = [self._flatten(b) for b in self._buckets.buckets]
        # what the inner optimizer steps: this rank's slice of every bucket, a view of it
        self.shards = [nn.Parameter(buf.view(self.replicas, -1)[self.replica_index]) for buf in self.param_buffers]
        reduction.free(self._buckets.buckets)

    def join_hook(self, **kwargs: Any):
        raise ConfigError("join() cannot mirror ZeRO's optimizer step, which all-gathers the "
                          "parameters; give every rank the same number of batches (a loader set up "
                          "by paratrain.Session does)")

    def _flatten(self, bucket: Bucket) -> torch.Tensor:
        flat = torch.zeros_like(bucket.buffer)
        for slot, p in enumerate(bucket.params):
            view = bucket.view(slot, flat)
            view.copy_(p.detach())
            p.data = view  # the module's parameters now live in the flat buffer
        return flat

    def bucket_group(self, index: int) -> int:
        """The optimizer param group of bucket `index`."""
        return self._reduction.key(self._buckets.buckets[index].params[0])

    def attach_shard_grads(self) -> None:
        """Give each shard its slice of the averaged gradient (None where there is none)."""
        for bucket, shard in zip(self._buckets.buckets, self.shards):
            shard.grad = self._reduction.shard_grad(bucket)

    def gather_params(self) -> None:
        """Every rank's updated slices into every rank's flat parameters (each shard is already
        its slice of the buffer; collectives.gather_from_owners)."""
        works = [work for buf, shard in zip(self.param_buffers, self.shards)
                 for work in gather_from_owners(buf, shard.detach(), self.process_group, rank=self.replica_index,
                                                world=self.replicas, all_gather=self.collectives.all_gather)]
        for work in works:
            work.wait()

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        """This rank's slices of the averaged gradients; the other slices are on the other
        data-parallel ranks."""
        self.attach_shard_grads()
        return [s.grad for s in self.shards if s.grad is not None], self.process_group or dist.group.WORLD

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (averaged) gradient, computed from the shards."""
        grads, group = self.local_grads()
        return clip_grad_norm_over(grads, max_norm, group)

    def checkpoint_layout(self) -> CheckpointLayout:
        """Whole parameters; the optimizer steps flat shards, one per bucket."""
        names = {p: n for n, p in self.module.named_parameters()}
        flat = {shard: FlatLayout(tuple((names[p], off, p.shape) for p, off in zip(b.params, b.offsets)),
                                  b.buffer.numel() // self.replicas, self.replica_index, self.replicas)
                for b, shard in zip(self._buckets.buckets, self.shards)}
        return CheckpointLayout.whole(self.module, flat)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            p.grad = None
        for shard in self.shards:
            shard.grad = None
        self._reduction.zero_grad()


class ShardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, rebuilt to hold state for this rank's shards only (stage 1 and 2).

    Same class, same hyperparameters per param group; its `param_groups` and `state` are the
    inner optimizer's, so learning-rate schedulers and checkpoints see them unchanged. `step()`
    steps the shards and all-gathers the parameters; `state_dict()` is this rank's shard of the
    state. Element-wise optimizers (SGD, Adam, AdamW, RMSprop, …) give exactly the unsharded
    result; optimizers that look across a tensor (LBFGS, Adafactor) cannot be sharded this way.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: ZeroDataParallel):
        self.model = model
        self.inner = rebuild_optimizer(optimizer, [
            [s for i, s in enumerate(model.shards) if model.bucket_group(i) == index]
            for index in range(len(optimizer.param_groups))])
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.state = self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("a sharded optimizer does not take a closure; call step() after backward")
        self.model.attach_shard_grads()
        self.inner.step()
        self.model.gather_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)
        self.state = self.inner.state


def shard_data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int,
                        process_group=None, bucket_cap_mb: float | None = None,
                        broadcast_buffers: bool = True, collectives: OwnerCollectives | None = None,
                        ) -> tuple[ZeroDataParallel, ShardedOptimizer]:
    """Stage 1 or 2 for `model` (on its device) and the optimizer made from its parameters."""
    group_of = param_groups_of(model, optimizer)
    collectives = collectives or OwnerCollectives.for_group(process_group)
    where = dict(group=process_group, rank=dist.get_rank(process_group),
                 world=dist.get_world_size(process_group), group_of=group_of)
    reduction = OwnerReduction(**where) if stage == 1 else \
        ScatterToOwners(**where, reduce_scatter=collectives.reduce_scatter)
    wrapped = ZeroDataParallel(model, reduction=reduction, collectives=collectives, process_group=process_group,
                               bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers)
    return wrapped, ShardedOptimizer(optimizer, wrapped)
