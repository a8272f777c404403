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

Stage 2 reduces each bucket with `comm.reduce_to_owners`: a reduce-scatter on nccl, an
all-reduce keeping this rank's slice on gloo (measured faster there; the numbers are in comm.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm import gather_from_owners, prefers_reduce_scatter, reduce_to_owners
from paratrain.errors import ConfigError
from paratrain.optim import check_optimizer_owns, clip_grad_norm_over, rebuild_optimizer
from paratrain.parallel.buckets import Bucket, GradBuckets
from paratrain.parallel.ddp import DistributedDataParallel
from paratrain.state_layout import FlatLayout


@dataclass
class ShardedGradBuckets(GradBuckets):
    """Stage 2: each bucket is reduced to its owners, then its full gradients are freed."""

    rank: int = 0
    reduce_scatter: bool = False  # else all-reduce and keep the slice (comm.reduce_to_owners)
    shard_grads: list[torch.Tensor | None] = field(default_factory=list)  # this rank's slices
    _pending: list[tuple[Bucket, torch.Tensor]] = field(default_factory=list)  # launched, unsettled

    def adopt_grad(self, p: nn.Parameter, **kwargs) -> None:
        bucket = self.slot_of[p][0]
        if bucket.buffer.untyped_storage().size() == 0:  # freed by the previous backward
            bucket.buffer.untyped_storage().resize_(bucket.buffer.numel() * bucket.buffer.element_size())
            bucket.buffer[bucket.offsets[-1] + bucket.params[-1].numel():].zero_()  # the padding
        super().adopt_grad(p, **kwargs)

    def start_grad_sync(self, bucket: Bucket) -> None:
        # one reduction in flight at a time: settling the previous one frees its full bucket, so
        # full gradients never pile up during backward (at most the bucket being filled, plus one)
        self.finish_grad_sync()
        bucket.work, mine = reduce_to_owners(bucket.buffer, self.group, rank=self.rank,
                                             world=self.world_size, scatter=self.reduce_scatter)
        self._pending.append((bucket, mine))

    def finish_grad_sync(self) -> None:
        for bucket, mine in self._pending:
            bucket.work.wait()
            bucket.work = None
            self.shard_grads[bucket.index] = accumulate(self.shard_grads[bucket.index], mine)
            for p in bucket.params:
                p.grad = None
            bucket.buffer.untyped_storage().resize_(0)  # the full gradients live only in backward
        self._pending.clear()

    def free(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.untyped_storage().resize_(0)
        self.shard_grads = [None] * len(self.buckets)


class ZeroDataParallel(DistributedDataParallel):
    """DDP whose buckets are padded and whose parameters are flat, so each rank can own 1/N of
    every bucket. Build it with `paratrain.shard(model, optimizer, stage=1|2)`."""

    def __init__(self, module: nn.Module, *, stage: int, group_of: dict[nn.Parameter, int],
                 process_group=None, bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True):
        if stage not in (1, 2):
            raise ConfigError(f"ZeroDataParallel implements stages 1 and 2; got {stage}")
        self._stage, self._group_of = stage, group_of
        super().__init__(module, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
                         broadcast_buffers=broadcast_buffers)
        self.rank = dist.get_rank(self.process_group)
        self.world = dist.get_world_size(self.process_group)
        self.param_buffers = [self._flatten(b) for b in self._buckets.buckets]
        # what the inner optimizer steps: this rank's slice of every bucket, a view of it
        self.shards = [nn.Parameter(buf.view(self.world, -1)[self.rank]) for buf in self.param_buffers]
        if stage == 2:
            self._buckets.free()

    def _build_buckets(self, params, caps) -> GradBuckets:
        n = dist.get_world_size(self.process_group)
        kind = self._group_of.__getitem__
        if self._stage == 1:
            return GradBuckets.build(params, caps, self.process_group, pad_to=n, kind_of=kind)
        buckets = ShardedGradBuckets.build(params, caps, self.process_group, pad_to=n, kind_of=kind)
        buckets.rank = dist.get_rank(self.process_group)
        buckets.reduce_scatter = prefers_reduce_scatter(self.process_group)
        return buckets

    def _flatten(self, bucket: Bucket) -> torch.Tensor:
        flat = torch.zeros_like(bucket.buffer)
        for slot, p in enumerate(bucket.params):
            view = bucket.view(slot, flat)
            view.copy_(p.detach())
            p.data = view  # the module's parameters now live in the flat buffer
        return flat

    def bucket_group(self, index: int) -> int:
        """The optimizer param group of bucket `index`."""
        return self._group_of[self._buckets.buckets[index].params[0]]

    def attach_shard_grads(self) -> None:
        """Give each shard its gradient: stage 1 a view of the all-reduced bucket, stage 2 the
        slice reduced to this rank."""
        for i, (bucket, shard) in enumerate(zip(self._buckets.buckets, self.shards)):
            if self._stage == 1:
                shard.grad = bucket.buffer.view(self.world, -1)[self.rank]
            else:
                shard.grad = self._buckets.shard_grads[i]

    def gather_params(self) -> None:
        """Every rank's updated slices into every rank's flat parameters (comm.gather_from_owners;
        each shard is already its slice of the buffer)."""
        works = [work for buf, shard in zip(self.param_buffers, self.shards)
                 for work in gather_from_owners(buf, shard.detach(), self.process_group,
                                                rank=self.rank, world=self.world)]
        for work in works:
            work.wait()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (averaged) gradient, computed from the shards."""
        self.attach_shard_grads()
        return clip_grad_norm_over([s.grad for s in self.shards if s.grad is not None], max_norm,
                                   self.process_group)

    def optimizer_layouts(self) -> dict[nn.Parameter, FlatLayout]:
        """Each shard the optimizer steps and the parameters its bucket holds (checkpoints)."""
        names = {p: n for n, p in self.module.named_parameters()}
        return {shard: FlatLayout(tuple((names[p], off, p.shape) for p, off in zip(b.params, b.offsets)),
                                  b.buffer.numel() // self.world, self.rank, self.world)
                for b, shard in zip(self._buckets.buckets, self.shards)}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict (parameters are whole on every rank in stages 1 and 2)."""
        return self.module.state_dict()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            p.grad = None
        for shard in self.shards:
            shard.grad = None
        if self._stage == 2:
            self._buckets.shard_grads = [None] * len(self.shards)


class ShardedOptimizer(torch.optim.Optimizer):
    """The user's optimizer, rebuilt to hold state for this rank's shards only (stage 1 and 2).

    Same class, same hyperparameters per param group; its `param_groups` are the inner
    optimizer's, so learning-rate schedulers work unchanged. `step()` steps the shards and
    all-gathers the parameters; `state_dict()` is this rank's shard of the state.
    Element-wise optimizers (SGD, Adam, AdamW, RMSprop, …) give exactly the unsharded result;
    optimizers that look across a tensor (LBFGS, Adafactor) cannot be sharded this way.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model: ZeroDataParallel):
        _check_elementwise(optimizer)
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


def _check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    whole_tensor = tuple(getattr(torch.optim, name) for name in ("LBFGS", "Adafactor", "Muon")
                         if hasattr(torch.optim, name))
    if isinstance(optimizer, whole_tensor):
        raise ConfigError(f"{type(optimizer).__name__} looks across whole tensors, so it cannot step "
                          "a flat shard exactly; use an element-wise optimizer (SGD, Adam, AdamW, …) "
                          "with ZeRO, or strategy 'ddp'")


def param_groups_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[nn.Parameter, int]:
    """Which param group of `optimizer` holds each trainable parameter of `model`; a clear error
    when the optimizer was made for another model or leaves parameters out."""
    check_optimizer_owns(optimizer, [p for p in model.parameters() if p.requires_grad])
    group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p not in group_of]
    if missing:
        raise ConfigError(f"the optimizer does not hold {len(missing)} trainable parameter(s) "
                          f"({', '.join(missing[:5])}); pass them all, or set requires_grad=False")
    return group_of


def shard_data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, *, stage: int,
                        process_group=None, bucket_cap_mb: float = 25.0,
                        broadcast_buffers: bool = True) -> tuple[ZeroDataParallel, ShardedOptimizer]:
    """Stage 1 or 2 for `model` (on its device) and the optimizer made from its parameters."""
    group_of = param_groups_of(model, optimizer)
    wrapped = ZeroDataParallel(model, stage=stage, group_of=group_of, process_group=process_group,
                               bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers)
    return wrapped, ShardedOptimizer(optimizer, wrapped)


def accumulate(held: torch.Tensor | None, new: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """`held + new`, in place in `held`; a copy of `new` (on `like`'s device and dtype) when
    nothing is held yet, so the full buffer `new` may view can be freed."""
    like = held if held is not None else like if like is not None else new
    new = new.to(like.device, like.dtype, copy=held is None)
    return new if held is None else held.add_(new)
