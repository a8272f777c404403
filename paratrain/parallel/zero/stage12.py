"""ZeRO stages 1 and 2: optimizer state, then gradients, sharded across data-parallel ranks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), §5.1–5.2. Bytes per rank for Ψ fp32 parameters trained with Adam on N ranks:

    DDP      4Ψ params + 4Ψ grads + 8Ψ   Adam state
    stage 1  4Ψ params + 4Ψ grads + 8Ψ/N Adam state
    stage 2  4Ψ params + 4Ψ/N grads + 8Ψ/N Adam state

Layout: the DDP buckets (buckets.py: reverse parameter order, capped, one optimizer param group
per bucket) are zero-padded to a multiple of N, and the parameters become views into one flat
buffer per bucket with the same layout as the gradient bucket (bucket_shards.py). Rank r owns slice r of every
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

from dataclasses import replace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from paratrain.components.optim import clip_grad_norm_over, rebuild_optimizer, skips_on_device
from paratrain.components.precision import cast_floating
from paratrain.distributed.comm import broadcast_coalesced
from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.base import CheckpointLayout, FlatLayout, names_by_first, user_key
from paratrain.parallel.ddp import DistributedDataParallel
from paratrain.parallel.zero.bucket_shards import BucketShards
from paratrain.parallel.zero.collectives import OwnerCollectives, reduced_sums_for
from paratrain.parallel.zero.optim import param_groups_of
from paratrain.parallel.zero.owner_reduction import OwnerReduction, owner_reduction


class ZeroDataParallel(DistributedDataParallel):
    """DDP whose buckets are padded and whose parameters are flat, so each rank can own 1/N of
    every bucket. Build it with `paratrain.shard(model, optimizer, stage=1|2)`.

    [Note: master shards] By default the optimizer steps views of this rank's slices, in place.
    With `param_dtype` (bf16/fp16) the model's parameters, gradients and both collectives are in
    that dtype, and the optimizer steps fp32 copies of the slices (master weights, made from the
    parameters before they were cast, so nothing is lost to rounding at setup). With `offload`
    the copies, their gradients and so the optimizer state live in CPU memory (ZeRO-Offload,
    Ren et al. 2021): the reduced gradient slice goes to the CPU, the CPU steps, and the updated
    slice comes back into the parameters before they are gathered. Bytes per rank for Ψ
    parameters with Adam, in bf16: stage 1, 2Ψ params + 2Ψ grads + 16Ψ/N (master, its fp32
    gradient, Adam's two moments); stage 2, 2Ψ + 2Ψ/N (the reduced slice) + 16Ψ/N."""

    def __init__(self, module: nn.Module, *, reduction: OwnerReduction, collectives: OwnerCollectives,
                 process_group=None, bucket_cap_mb: float | None = None, broadcast_buffers: bool = True,
                 param_dtype: torch.dtype | None = None, offload: bool = False):
        # hybrid sharding (reduction.replicate): `process_group` shards, the replicas hold the same
        # slices, and all of them are the data-parallel ranks (as stage3.py's replicate_group)
        self.replicate_group = reduction.replicate
        if self.replicate_group is not None:  # every group starts from global rank 0's values
            broadcast_coalesced([*module.parameters(), *module.buffers()], self.replicate_group)
        originals = None
        if param_dtype is not None:  # rank 0's fp32 values everywhere, kept for the masters, then cast
            trainable = [p for p in module.parameters() if p.requires_grad]
            broadcast_coalesced(trainable, process_group)
            originals = {p: p.detach() for p in trainable}
            for p in trainable:
                p.data = p.data.to(param_dtype)
        super().__init__(module, process_group=process_group, bucket_cap_mb=bucket_cap_mb,
                         broadcast_buffers=broadcast_buffers, reduction=reduction)
        self._reduction, self.collectives = reduction, collectives
        self.param_dtype, self.offload = param_dtype, offload
        if self.replicate_group is not None:
            copies, copy = dist.get_world_size(self.replicate_group), dist.get_rank(self.replicate_group)
            self.replicas, self.replica_index = self.replicas * copies, copy * self.replicas + self.replica_index
        self.owned = BucketShards(self._buckets.buckets, reduction, collectives, process_group,
                                  param_dtype=param_dtype, offload=offload, originals=originals)

    @property
    def shards(self) -> list[nn.Parameter]:
        """What the inner optimizer steps: this rank's slice of every bucket, a view of it, or a
        master copy ([Note: master shards])."""
        return self.owned.shards

    @property
    def param_buffers(self) -> list[torch.Tensor]:
        return self.owned.param_buffers

    @property
    def masters(self) -> bool:
        return self.owned.masters

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.param_dtype is not None:  # inputs in the parameters' dtype
            inputs, kwargs = cast_floating((inputs, kwargs), self.param_dtype)
        return super().forward(*inputs, **kwargs)

    def join_hook(self, **kwargs: Any):
        raise ConfigError("join() cannot mirror ZeRO's optimizer step, which all-gathers the "
                          "parameters; give every rank the same number of batches (a loader set up "
                          "by paratrain.Session does)")

    def bucket_group(self, index: int) -> int:
        """The optimizer param group of bucket `index`."""
        return self.owned.bucket_group(index)

    def attach_shard_grads(self) -> None:
        self.owned.attach_grads()

    def gather_params(self) -> None:
        self.owned.gather()

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        """This rank's slices of the averaged gradients; the other slices are on the other
        data-parallel ranks."""
        return self.owned.grads(), self.process_group or dist.group.WORLD

    def sync_module_buffers(self, src: int = 0) -> None:
        super().sync_module_buffers(src)
        if self.replicate_group is not None:  # and the first group's across the replicas
            broadcast_coalesced(self.modules_buffers, self.replicate_group)

    def watch_reductions(self) -> None:
        if self.replicate_group is not None:  # a sum over one group's reductions: the session reads the slices
            return
        scatter = getattr(self._reduction, "reduce_scatter", False)  # stage 2's reduce-scatters
        self._reduction.sums = reduced_sums_for(sum(p.numel() for p in self._params), scatter, self.process_group)

    def reduced_finite(self) -> torch.Tensor | None:
        return self._reduction.sums.take() if self._reduction.sums is not None else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (averaged) gradient, computed from the shards."""
        grads, group = self.local_grads()
        return clip_grad_norm_over(grads, max_norm, group)

    def checkpoint_layout(self) -> CheckpointLayout:
        """Whole parameters; the optimizer steps flat shards, one per bucket. Master shards hold
        the parameters' true values, so they are what is saved and loaded (as ZeRO-3's shards),
        and a load copies them back into the parameters."""
        layout = CheckpointLayout.whole(self.module, self._flat_layouts())
        if not self.masters:
            return layout
        trainable = {id(p) for p in self._params}
        frozen = {n: p for n, p in layout.params.items() if id(p) not in trainable}
        return replace(layout, params=frozen, params_in_flat=True, after_load=self.gather_params)

    def _flat_layouts(self) -> dict[torch.Tensor, FlatLayout]:
        return self.owned.flat_layouts({p: user_key(n) for n, p in self.module.named_parameters()})

    def state_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """The parameters' true values: master shards are gathered (in their own dtype), a
        bucket at a time; then buffers and frozen parameters."""
        state = {user_key(k): v for k, v in self.module.state_dict().items()}
        if not self.masters:
            yield state
            return
        names = names_by_first(CheckpointLayout.whole(self.module).aliases)  # tied weights: all their names
        gathered = set()
        for piece in self.owned.gathered({p: user_key(n) for n, p in self.module.named_parameters()}, names):
            gathered.update(piece)
            yield piece
        yield {k: v for k, v in state.items() if k not in gathered}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            p.grad = None
        self.owned.zero_grad()


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
        self.skips_on_device = skips_on_device(self.inner)  # it hands found_inf on (session/step.py, DeviceCheck)
        self.built = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "built", False):  # torch's __init__ adds the groups it was given
            raise UsageError("a ZeRO stage 1/2 optimizer cannot take a param group after pt.shard: its "
                             "parameters are not in the sharded gradient buckets, so it would never step "
                             "them. Add every parameter group to the optimizer before setup()/pt.shard")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ConfigError("a sharded optimizer does not take a closure; call step() after backward")
        self.model.attach_shard_grads()
        self.inner.found_inf = getattr(self, "found_inf", None)
        try:
            self.inner.step()
        finally:
            del self.inner.found_inf
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
                        param_dtype: torch.dtype | None = None, offload: bool = False, replicate_group=None,
                        ) -> tuple[ZeroDataParallel, ShardedOptimizer]:
    """Stage 1 or 2 for `model` (on its device) and the optimizer made from its parameters;
    `param_dtype` and `offload` as [Note: master shards] says. `replicate_group`: hybrid
    sharding, the ranks holding this rank's slices in the other groups of `process_group`'s
    size; each reduced slice (stage 1: each whole bucket) is averaged over them too."""
    group_of = param_groups_of(model, optimizer)
    collectives = collectives or OwnerCollectives.for_group(process_group)
    where = dict(group=process_group, rank=dist.get_rank(process_group),
                 world=dist.get_world_size(process_group), group_of=group_of, replicate=replicate_group)
    reduction = owner_reduction(stage, collectives.reduce_scatter, **where)
    wrapped = ZeroDataParallel(model, reduction=reduction, collectives=collectives, process_group=process_group,
                               bucket_cap_mb=bucket_cap_mb, broadcast_buffers=broadcast_buffers,
                               param_dtype=param_dtype, offload=offload)
    return wrapped, ShardedOptimizer(optimizer, wrapped)
