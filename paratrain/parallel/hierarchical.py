"""Hierarchical data parallel ("DDP2"): gradients reduced inside each node, then across nodes.

Mathematically this is DDP: every rank ends a backward with the mean gradient over the whole
world, so a step equals one process on the concatenated global batch. What changes is the path
the bytes take. A flat ring all-reduce over N = M·L ranks (M nodes of L processes) pushes
2(N-1)/N × S bytes (S = gradient bytes) through every link of the ring, and the ring crosses a
node boundary M times. The hierarchical scheme sends only one L-th of the gradient per rank
across nodes (Jia et al. 2018, "Highly scalable deep learning training system with
mixed-precision", §4.3; NCCL's tree/ring-of-rings does the same inside one collective):

    Phase 1, reduce-scatter inside the node: local rank l ends with the node's sum of chunk l
             (fast intra-node links; (L-1)/L × S bytes per rank).
    Phase 2, all-reduce across nodes, between the ranks that hold the same chunk (one per node):
             chunk l becomes the world's sum (2(M-1)/M × S/L bytes per rank cross nodes).
    Phase 3, all-gather inside the node: every rank gets every finished chunk ((L-1)/L × S).

The gradients are pre-divided by N as they enter their bucket (buckets.py), so the sum is the mean.

Reuse: `HierarchicalDataParallel` *is* our `DistributedDataParallel` (hooks, buckets as gradient
views, no_sync, unused parameters, buffer broadcast); only the per-bucket reduction differs, so
it passes DDP a `HierarchicalReduction` (buckets.Reduction's `start` / `finish` pair). The three
phases of one bucket depend on each other, but several buckets are in flight at once, each a phase behind the one launched after it:

    launch of bucket:   0        1                2                3        backward ends
    intra (phase 1):  [rs 0]   [rs 1]           [rs 2]           [rs 3]
    inter (phase 2):           [ar 0]           [ar 1]           [ar 2]   [ar 3]
    intra (phase 3):                            [ag 0]           [ag 1]   [ag 2] [ag 3]

Every rank issues the same collectives in the same order on each group (a launch moves each
earlier bucket on by one phase, decided by the launch count only, never by which work happens to
have finished), which is what a process group needs to match its messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.components.materialize import MetaInit, whole
from paratrain.distributed.comm import ByteCounter, all_gather_single, reduce_scatter_single, ring_bytes
from paratrain.distributed.grid import NodeGroups, ProcessGrid
from paratrain.errors import ConfigError
from paratrain.parallel.base import owned
from paratrain.parallel.buckets import Bucket, Reduction
from paratrain.parallel.ddp import DDP, DistributedDataParallel

INTRA_REDUCE_SCATTER, INTER_ALL_REDUCE, INTRA_ALL_GATHER, DONE = range(4)  # a bucket's phases


@dataclass
class HierarchicalBytes:
    """Bytes this rank sent, by where they went (bandwidth-optimal ring accounting, distributed/comm.py)."""

    intra_node: ByteCounter = field(default_factory=ByteCounter)  # phases 1 and 3
    inter_node: ByteCounter = field(default_factory=ByteCounter)  # phase 2: across the node boundary


@dataclass
class _InFlight:
    """One bucket's progress through the three phases in this backward."""

    phase: int  # INTRA_REDUCE_SCATTER … DONE: the phase whose collective is in flight
    buffer: torch.Tensor  # (L·c,) the bucket's buffer (padded to a multiple of L): the reduced
    # gradients are gathered back into it
    shard: torch.Tensor  # (c,) this rank's chunk: node sum after phase 1, world sum after phase 2
    work: Any  # the in-flight collective's handle


@dataclass
class HierarchicalReduction(Reduction):
    """A bucket's reduction as reduce-scatter / all-reduce / all-gather (module docstring)."""

    groups: NodeGroups
    counters: HierarchicalBytes = field(default_factory=HierarchicalBytes)
    in_flight: dict[int, _InFlight] = field(default_factory=dict)  # by bucket index

    @property
    def pad_to(self) -> int:  # each buffer splits into one equal chunk per local rank
        return len(self.groups.intra_ranks)

    def start(self, bucket: Bucket) -> None:
        # Called in bucket-index order on every rank (GradBuckets.mark_ready); see the timeline.
        for earlier in list(self.in_flight.values()):
            if earlier.phase < INTRA_ALL_GATHER:
                self._advance(earlier)
        self.in_flight[bucket.index] = self._reduce_scatter(bucket)

    def finish(self) -> None:
        """Drive every launched bucket through its remaining phases, in bucket order; then each
        bucket (which the parameters' `.grad` views) holds the world's mean."""
        for index in sorted(self.in_flight):
            flight = self.in_flight[index]
            while flight.phase != DONE:
                self._advance(flight)
        self.in_flight.clear()

    def _reduce_scatter(self, bucket: Bucket) -> _InFlight:
        # the buffer was padded to a multiple of the node's size at build time (pad_to), so it
        # splits into equal chunks and is reduced and gathered in place
        intra = self.groups.intra_node
        shard = bucket.buffer.new_empty(bucket.buffer.numel() // dist.get_world_size(intra))
        work = reduce_scatter_single(shard, bucket.buffer, group=intra, async_op=True)
        self._count(self.counters.intra_node, bucket.buffer, dist.get_world_size(intra))
        return _InFlight(INTRA_REDUCE_SCATTER, bucket.buffer, shard, work)

    def _advance(self, flight: _InFlight) -> None:
        """Wait for the phase in flight and launch the next one."""
        flight.work.wait()
        flight.phase += 1
        if flight.phase == INTER_ALL_REDUCE:
            inter = self.groups.inter_node
            flight.work = dist.all_reduce(flight.shard, group=inter, async_op=True)
            self._count(self.counters.inter_node, flight.shard, dist.get_world_size(inter), phases=2)
        elif flight.phase == INTRA_ALL_GATHER:
            intra = self.groups.intra_node
            flight.work = all_gather_single(flight.buffer, flight.shard, group=intra, async_op=True)
            self._count(self.counters.intra_node, flight.buffer, dist.get_world_size(intra))
        else:
            flight.work = None

    @staticmethod
    def _count(counter: ByteCounter, tensor: torch.Tensor, ranks: int, phases: int = 1) -> None:
        counter.add(ring_bytes(tensor.numel(), tensor.element_size(), ranks, phases))


class HierarchicalDataParallel(DistributedDataParallel):
    """`DistributedDataParallel` whose gradients take the hierarchical path.

    module: the model, already on this rank's device.
    groups: this rank's node groups, from `session.grid.node_groups()` or
        `paratrain.node_groups(topology)` (collective: every rank makes them at the same point).
    process_group: the data-parallel ranks when they are not the world (under `pt.Mesh`:
        `grid.data_node_groups()` cuts them by node); the node groups must span it.
    Every other keyword is `DistributedDataParallel`'s (bucket_cap_mb, find_unused_parameters,
    broadcast_buffers, device_ids, …).
    """

    def __init__(self, module: nn.Module, *, groups: NodeGroups, **ddp_kwargs: Any):
        if ddp_kwargs.get("device_mesh") is not None:
            raise ConfigError("HierarchicalDataParallel reduces through its node groups; drop device_mesh")
        spans = len(groups.intra_ranks) * len(groups.inter_ranks)
        if spans != dist.get_world_size(ddp_kwargs.get("process_group")):
            raise ConfigError(f"HierarchicalDataParallel's node groups span {spans} ranks, its process group "
                              f"{dist.get_world_size(ddp_kwargs.get('process_group'))}: make the node groups "
                              "from the same ranks (ProcessGrid.data_node_groups())")
        self._reduction = HierarchicalReduction(groups)
        super().__init__(module, reduction=self._reduction, **ddp_kwargs)

    @property
    def bytes_sent(self) -> HierarchicalBytes:
        """Bytes this rank has sent inside its node and across nodes, summed over backwards."""
        return self._reduction.counters


@dataclass(frozen=True)
class Hierarchical(DDP):
    """Data parallel, one process per device, gradients reduced inside nodes then across them.
    The settings are DDP's: bucket_cap_mb, find_unused_parameters, broadcast_buffers."""

    name = "hierarchical"

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None):
        groups = grid.node_groups() if grid.dp == grid.topology.world_size else grid.data_node_groups()
        wrapped = HierarchicalDataParallel(whole(model, init).to(grid.topology.device), groups=groups,
                                           **self.ddp_kwargs(grid))
        return wrapped, owned(optimizer, model)
