"""What ZeRO stages 1 and 2 keep of a set of gradient buckets (buckets.py), padded to N equal
slices: the parameters made views of one flat buffer per bucket (the layout of its gradient
bucket), and this rank's slice of each, the shard its optimizer steps.

    attach_grads()   each shard's .grad: its slice of the bucket's reduced gradient
    gather()         every rank's updated slices into every rank's flat parameters

Our DDP made ZeRO (stage12.py) holds one set for the whole model; a pipeline stage under ZeRO
holds one per chunk (pipeline/stage.py), each over the replicas of that stage. Either way the
owner of slice r of every bucket is rank r of the data-parallel group, as in Megatron-core's
distributed optimizer.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from paratrain.distributed.comm import all_gather_single
from paratrain.parallel.base import FlatLayout
from paratrain.parallel.buckets import Bucket
from paratrain.parallel.zero.collectives import OwnerCollectives, gather_from_owners
from paratrain.parallel.zero.owner_reduction import OwnerReduction


class BucketShards:
    """The flat parameters of `buckets` and this rank's shard of each ([Note: master shards],
    stage12.py, says when a shard is a master copy rather than a view of the slice).

    originals: the trainable parameters' values before a cast to `param_dtype` (the masters'
    values), or None."""

    def __init__(self, buckets: list[Bucket], reduction: OwnerReduction, collectives: OwnerCollectives,
                 process_group: Any, *, param_dtype: torch.dtype | None = None, offload: bool = False,
                 originals: dict[nn.Parameter, torch.Tensor] | None = None):
        self.buckets, self._reduction, self.collectives = buckets, reduction, collectives
        self.process_group, self.replicas, self.replica_index = process_group, reduction.world, reduction.rank
        self.offload = offload
        self.param_buffers = [self._flatten(b) for b in buckets]
        self.masters = param_dtype is not None or offload
        self.shards = [nn.Parameter(self._master(b, buf, originals) if self.masters else self._slice(buf))
                       for b, buf in zip(buckets, self.param_buffers)]
        self._grads_from = -1  # the backward whose gradients the masters' .grad hold
        reduction.free(buckets)

    def _slice(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(self.replicas, -1)[self.replica_index]

    def _flatten(self, bucket: Bucket) -> torch.Tensor:
        flat = torch.zeros_like(bucket.buffer)
        for slot, p in enumerate(bucket.params):
            view = bucket.view(slot, flat)
            view.copy_(p.detach())
            p.data = view  # the module's parameters now live in the flat buffer
        return flat

    def _master(self, bucket: Bucket, flat: torch.Tensor, originals: dict | None) -> torch.Tensor:
        """This rank's slice of `bucket`'s parameters in their own dtype (their values before any
        cast), at home: the CPU under offload, page-locked when the model is on a GPU."""
        values = flat
        if originals:
            values = torch.zeros(flat.numel(), dtype=originals[bucket.params[0]].dtype, device=flat.device)
            for slot, p in enumerate(bucket.params):
                bucket.view(slot, values).copy_(originals[p])
        home = torch.device("cpu") if self.offload else flat.device
        master = self._slice(values).to(home, copy=True)
        return master.pin_memory() if self.offload and flat.device.type == "cuda" else master

    def bucket_group(self, index: int) -> int:
        """The optimizer param group of bucket `index`."""
        return self._reduction.key(self.buckets[index].params[0])

    def attach_grads(self) -> None:
        """Give each shard its slice of the averaged gradient (None where there is none): the
        slice itself, or, for master shards, an fp32 copy at home, made once per backward (so
        clipping scales the copy the step then reads)."""
        if self.masters and self._grads_from == self._reduction.backwards:
            return
        self._grads_from = self._reduction.backwards
        for bucket, shard in zip(self.buckets, self.shards):
            grad = self._reduction.shard_grad(bucket)
            shard.grad = grad.to(shard.device, shard.dtype, copy=True) if self.masters and grad is not None else grad

    def gather(self) -> None:
        """Every rank's updated slices into every rank's flat parameters (collectives.
        gather_from_owners); master shards are first copied (cast) into their slices."""
        if self.masters:
            for buf, shard in zip(self.param_buffers, self.shards):
                self._slice(buf).copy_(shard.detach())
        works = [work for buf in self.param_buffers
                 for work in gather_from_owners(buf, self._slice(buf), self.process_group, rank=self.replica_index,
                                                world=self.replicas, all_gather=self.collectives.all_gather)]
        for work in works:
            work.wait()

    def grads(self) -> list[torch.Tensor]:
        """This rank's slices of the averaged gradients."""
        self.attach_grads()
        return [s.grad for s in self.shards if s.grad is not None]

    def flat_layouts(self, names: dict[nn.Parameter, str]) -> dict[torch.Tensor, FlatLayout]:
        """Each shard → what it holds, the parameters under `names`."""
        return {shard: FlatLayout(tuple((names[p], off, p.shape) for p, off in zip(b.params, b.offsets)),
                                  b.buffer.numel() // self.replicas, self.replica_index, self.replicas)
                for b, shard in zip(self.buckets, self.shards)}

    def gathered(self, names: dict[nn.Parameter, str],
                 aliases: dict[str, list[str]]) -> Iterator[dict[str, torch.Tensor]]:
        """The shards' values whole (in their own dtype), a bucket at a time, each parameter under
        its name and its `aliases` (collective over the group)."""
        for (shard, layout), bucket in zip(self.flat_layouts(names).items(), self.buckets):
            full = torch.empty(shard.numel() * self.replicas, dtype=shard.dtype, device=bucket.buffer.device)
            all_gather_single(full, shard.detach().to(full.device, copy=True), group=self.process_group)
            piece = {}
            for first, offset, shape in layout.slots:
                value = full[offset:offset + shape.numel()].view(shape).clone()
                piece.update({name: value for name in aliases.get(first, [first])})
            yield piece

    def zero_grad(self) -> None:
        for shard in self.shards:
            shard.grad = None
        self._grads_from = -1
        self._reduction.zero_grad()
