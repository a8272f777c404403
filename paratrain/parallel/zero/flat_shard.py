"""One flat, sharded piece of a model for ZeRO stage 3: the parameters of one unit (and one
optimizer param group), flattened, zero-padded to a multiple of N, each rank keeping 1/N.

Lifecycle (paired names, as in FSDP2's `FSDPParamGroup`):

    start_unshard()   allocate the full buffer, launch the all-gather of every rank's shard
    finish_unshard()  wait for it (the modules' parameter attributes are views of it)
    reshard()         free the full buffer (its storage, so tensors autograd saved stay valid
                      and are refilled by the next unshard before backward reads them)
    grad_arrived(i)   leaf i has its gradient; at the first, one zeroed full-size gradient
                      buffer that backward fills in place ([Note: one leaf per use]), or, for
                      a flat of one parameter, that gradient itself (units.py, [Note: the
                      root's big parameters])
    start_grad_sync() once every use's gradient is in it: launch its reduction to the owners
                      (partial=True: before the rest of its uses, which start a new buffer:
                      [Note: a unit used twice])
    finish_grad_sync() wait; add this rank's slice to `shard.grad`; drop the full gradient

[Note: one leaf per use]
Each (parameter, owning module attribute) pair is a leaf tensor that requires grad, a view of
`full`, set on the module once. When the unit's first gradient arrives (it is copied in), every
leaf's `.grad` is set to its span of one zeroed flat buffer, `grad`; autograd then adds each
further use's gradient into it in place (AccumulateGrad adds into an existing `.grad`) and frees
it at once. A tied weight has one leaf per owner, so its uses do not wait for each other in
autograd's input buffer: the head of a GPT adds its share of the embedding's gradient at the
start of backward, the embedding its own at the end, both into the same span. So no full-size
gradient is held twice and none is copied whole (one view per parameter split from one leaf
made backward a cat of them all, and held a tied weight's first gradient until its last use).
The buffer is made at the first gradient, not before the unit's backward (or its recompute under
activation checkpointing) starts. Values are the uses' gradients summed in the order autograd
runs them; a post-accumulate hook on each leaf counts them in, and the last starts the reduction.

Leaves are views of `full.data`, whose version counter is not `full`'s: regathering into the
buffer between forward and backward does not look like an in-place change of a saved tensor.

[Note: a unit used twice]
A GPT's root unit holds the embedding, tied to the head: the head's share of its gradient
arrives at the start of backward and the embedding's at the end, so a full gradient buffer kept
until the last use would live through every block's backward, where the blocks' own buffers,
gathered units and recomputed activations peak (with units.py's [Note: the root's big
parameters], which removes the copy of the head's share). So when another unit's backward starts,
a flat whose gradient is part-way (some uses in, not all) is reduced at once (`partial=True`:
its count of uses goes on), and its later uses fill a new buffer, reduced when the last is in;
this rank's slice is the sum of the two reductions' (`add_into`), the same average up to the
order of its additions. Once per flat per backward (`flushed`): a root whose parameters are used
between many units (LayerNorms between Linear units) is reduced at most twice, not once per
gap. The reduction is waited for there, before the next unit gathers: one reduce-scatter of the
flat exposed per step, for one buffer fewer through the rest of backward.

[Note: no gradient]
A flat is stepped whole, so a parameter that got no gradient would be stepped with a zero one:
weight decay and momentum would move it, and Adam would count the step, where single-process
training leaves a parameter whose `.grad` is None alone. So, as under ZeRO stages 1 and 2, a
parameter must get a gradient on every rank in each step: from any of its uses (a tied weight
whose other owner is not called is fine), in any backward since the last synchronised one. The
end of a synchronised backward names the ones that did not (`refuse_unseen`), after this rank's
reductions, so its collectives stay paired with the other ranks'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.comm import all_gather_single
from paratrain.parallel.base import FlatLayout, user_key
from paratrain.parallel.buckets import ReducedSums, padded_numel
from paratrain.parallel.grad_sync import no_gradient_error
from paratrain.parallel.zero.collectives import add_into, gather_from_owners, reduce_to_owners


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives: its names in the model and its span in the flat buffer."""

    names: tuple[str, ...]  # every dotted name the parameter has (tied weights have several)
    owners: tuple[tuple[nn.Module, str], ...]  # (module, attribute) for each name
    shape: torch.Size
    offset: int


class FlatShard:
    """The shard this rank owns of a list of parameters, and their gathered full buffer."""

    def __init__(self, slots: list[ParamSlot], values: list[torch.Tensor], *, group, rank: int,
                 world: int, param_dtype: torch.dtype | None = None, offload: bool = False,
                 all_gather: bool = False):
        """`param_dtype`: gather, compute and reduce in it (bf16/fp16), keeping the shard and the
        optimizer state in the parameters' own dtype (fp32 master weights). `offload`: keep the
        shard, its gradient and so the optimizer state in CPU memory; only the gathered buffer
        lives on the device. `all_gather`: gather by one all-gather, not a broadcast per owner
        (collectives.OwnerCollectives)."""
        self.slots, self.group, self.rank, self.world = slots, group, rank, world
        self.all_gather = all_gather
        # hybrid sharding: the groups of ranks holding this same shard, whose reduced slices are
        # all-reduced after the reduction over `group` (stage3.py sets them)
        self.replicate_group, self.replicate = None, 1
        self.numel = sum(s.shape.numel() for s in slots)
        self.padded = padded_numel(self.numel, world)
        device = values[0].device
        home = torch.device("cpu") if offload else device
        pin = offload and device.type == "cuda"  # page-locked: faster host-device copies
        # this rank's slice only: no full-size copy, so a meta-built model's setup holds its
        # shards and one unit's values at most
        shard = torch.zeros(self.padded // world, dtype=values[0].dtype, device=home, pin_memory=pin)
        self.shard = nn.Parameter(self._fill_mine(shard, values))  # (padded / N,)
        self.full = torch.empty(self.padded, dtype=param_dtype or values[0].dtype, device=device)
        # (slot, leaf) for every name the slot has: [Note: one leaf per use]
        self.leaves = [(slot, _span(self.full.data, slot).requires_grad_()) for slot in slots for _ in slot.owners]
        _free(self.full)
        self.grad: torch.Tensor | None = None  # the full gradient backward is filling
        self._arrived = 0  # leaves whose gradient this backward has added to `grad`
        self._slot_of = [i for i, slot in enumerate(slots) for _ in slot.owners]  # each leaf's slot
        self.seen: set[int] = set()  # slots with a gradient since the last reduction ([Note: no gradient])
        self.flushed = False  # a partial gradient was reduced this backward ([Note: a unit used twice])
        self.gathered = False
        self.gather_check = None  # in debug: collectives.refuse_other_gathers, before each gather
        self._gather_work: list[dist.Work] | None = None
        self._reduce: tuple[dist.Work, torch.Tensor, torch.Tensor] | None = None  # (work, slice, buffer)

    @property
    def full_bytes(self) -> int:
        return self.padded * self.full.element_size()

    def start_unshard(self) -> None:
        if self.gathered or self._gather_work is not None:
            return
        if self.gather_check is not None:  # [Note: the same unit on every rank] in collectives.py
            self.gather_check()
        _alloc(self.full)
        self._gather_work = gather_from_owners(self.full.data, self.shard.detach(), self.group,
                                               rank=self.rank, world=self.world, all_gather=self.all_gather)

    def finish_unshard(self) -> None:
        if self._gather_work is not None:
            for work in self._gather_work:
                work.wait()
            self._gather_work = None
            self.gathered = True

    def install(self) -> None:
        """Set every owning module's attribute to its leaf, for good."""
        uses = iter(self.leaves)
        for slot in self.slots:
            for module, attr in slot.owners:
                setattr(module, attr, next(uses)[1])

    def reshard(self) -> None:
        self.finish_unshard()  # a prefetch that was never used: let it land before freeing
        if self.gathered:
            _free(self.full)
            self.gathered = False

    def prepare_grad(self) -> None:
        """Point every leaf's `.grad` at its span of one zeroed full-size buffer (kept while
        gradients accumulate over backwards without a reduction)."""
        if self.grad is None:
            self.grad = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device)
            for slot, leaf in self.leaves:
                leaf.grad = _span(self.grad, slot)

    def grad_arrived(self, index: int) -> bool:
        """Leaf `index` accumulated its gradient (its post-accumulate hook); True when it was the
        last of this backward's."""
        slot, leaf = self.leaves[index]
        arrived = leaf.grad
        if self.grad is None and self._can_adopt(arrived):  # autograd's tensor is the buffer: no copy
            self.grad = arrived.detach().view(-1)
            for each_slot, each in self.leaves:
                each.grad = _span(self.grad, each_slot)
        self.prepare_grad()
        span = _span(self.grad, slot)
        if arrived.data_ptr() != span.data_ptr():  # no buffer yet when it came, or a double backward
            span.copy_(arrived)  # (which accumulates out of place); either way it holds the sum
            leaf.grad = span
        self._arrived += 1
        self.seen.add(self._slot_of[index])
        return self._arrived == len(self.leaves)

    def take_unseen(self) -> list[str]:
        """The names of the parameters that got no gradient in any backward since the last
        synchronised one (none of their uses did); starts the next count ([Note: no gradient])."""
        unseen = [slot.names[0] for i, slot in enumerate(self.slots) if i not in self.seen]
        self.seen = set()
        return unseen

    def _can_adopt(self, arrived: torch.Tensor) -> bool:
        """Whether a first gradient can be this flat's gradient buffer as it is: the flat is one
        unpadded parameter and the tensor is the whole of its own storage ([Note: the root's big
        parameters] in units.py)."""
        return (len(self.slots) == 1 and self.padded == self.numel and arrived.dtype == self.full.dtype
                and arrived.device == self.full.device and arrived.is_contiguous() and arrived.storage_offset() == 0
                and arrived.untyped_storage().nbytes() == self.numel * arrived.element_size())

    @property
    def grad_pending(self) -> bool:
        """A gradient arrived that no reduction has taken yet (`grad` is made at the first)."""
        return self.grad is not None

    @property
    def grad_partial(self) -> bool:
        """Some of this backward's uses are in the buffer, not all ([Note: a unit used twice])."""
        return self.grad is not None and 0 < self._arrived < len(self.leaves)

    def end_backward(self) -> None:
        """Count the next backward's gradients afresh."""
        self._arrived, self.flushed = 0, False

    def drop_grad(self) -> None:
        for _, leaf in self.leaves:
            leaf.grad = None
        self.grad, self._arrived = None, 0

    def start_grad_sync(self, scatter: bool, *, partial: bool = False) -> None:
        """Reduce the gradient buffer to the owners; `partial`: more uses will arrive this
        backward, into a new buffer, and are still counted ([Note: a unit used twice])."""
        grad, arrived = self.grad, self._arrived
        self.drop_grad()
        if partial:
            self._arrived, self.flushed = arrived, True
        grad.div_(self.world * self.replicate)  # summing pre-divided values: the mean, without fp16 overflow
        work, mine = reduce_to_owners(grad, self.group, rank=self.rank, world=self.world, scatter=scatter)
        self._reduce = work, mine, grad

    def finish_grad_sync(self, sums: ReducedSums | None = None) -> None:
        """Wait for the reduction; `sums` (the finite check's, made only where the reduction is
        an all-reduce) sees the whole reduced buffer."""
        if self._reduce is None:
            return
        work, mine, reduced = self._reduce
        work.wait()
        self._reduce = None
        if self.replicate_group is not None:  # the other replicas' sums of this same slice
            dist.all_reduce(mine, group=self.replicate_group)
        if sums is not None:
            sums.add(reduced)
        self.shard.grad = add_into(self.shard.grad, mine, like=self.shard)

    def drop_pending(self) -> None:
        """Forget a reduction and gradients that a failed backward left behind."""
        self._reduce = None
        self.drop_grad()
        self.seen = set()

    @torch.no_grad()
    def gather_values(self) -> list[torch.Tensor]:
        """Every parameter's full value (a collective), in `slots` order."""
        full = torch.empty(self.padded, dtype=self.shard.dtype, device=self.full.device)
        all_gather_single(full, self.shard.detach().to(full.device, copy=True), group=self.group)
        return [_span(full, s).clone() for s in self.slots]

    @torch.no_grad()
    def load_values(self, values: list[torch.Tensor]) -> None:
        """Take this rank's slice of full parameter values given in `slots` order."""
        self.shard.copy_(self._fill_mine(torch.zeros_like(self.shard), values))

    def _fill_mine(self, shard: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
        """`shard`, given the pieces of the full `values` (in `slots` order) that this rank's
        slice of the flat buffer covers (FlatLayout.pieces, as checkpoints cut it)."""
        layout = FlatLayout(tuple((s.names[0], s.offset, s.shape) for s in self.slots),
                            self.padded // self.world, self.rank, self.world)
        by_name = {s.names[0]: v for s, v in zip(self.slots, values)}
        for name, offset, local, length in layout.pieces(self.rank):
            shard[local:local + length].copy_(by_name[name].detach().reshape(-1)[offset:offset + length])
        return shard


def refuse_unseen(flats: list[FlatShard]) -> None:
    """At the end of a synchronised backward: a clear error naming the parameters that got no
    gradient since the last one ([Note: no gradient])."""
    names = [user_key(name) for flat in flats for name in flat.take_unseen()]
    if names:
        raise no_gradient_error(names, "ZeRO stage 3 steps whole flat shards: it would apply momentum and "
                                "weight decay where single-process training skips the parameter; every rank "
                                "must use it in each step, else use DDP with find_unused_parameters=True")


def _span(flat: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    return flat[slot.offset:slot.offset + slot.shape.numel()].view(slot.shape)


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc(t: torch.Tensor) -> None:
    if t.untyped_storage().size() == 0:
        t.untyped_storage().resize_(t.numel() * t.element_size())
