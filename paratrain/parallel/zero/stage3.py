"""ZeRO stage 3 (fully sharded data parallel): parameters, gradients and optimizer state sharded.

Rajbhandari et al. 2020 §5.3 (16Ψ/N bytes per rank with fp32 Adam), and Zhao et al., "PyTorch
FSDP: Experiences on Scaling Fully Sharded Data Parallel" (VLDB 2023) for units and prefetching.

A `WrapPolicy` cuts the model into units; the root unit holds what is left. A parameter used by
several units (tied weights) belongs to the innermost unit that contains all its users. Each
unit keeps one `FlatShard` per optimizer param group (flat_shard.py). Per step, for unit k of K
in forward order:

    forward   pre-hook:  wait for k's all-gather, start k+1's (prefetch); k's modules hold
                         views of the gathered buffer.   post-hook: free k (the root stays).
    backward  hook on k's outputs: reduce a unit's gradient that is part-way (the root's, from
                         a tied head; [Note: a unit used twice]), gather k again, start k-1's (prefetch).
              post-accumulate hooks on k's leaves: at the first, wait for k+1's reduction and
              point k's leaves' gradients at one zeroed flat buffer (flat_shard.py, [Note: one
              leaf per use]; a flat of one big root parameter takes autograd's gradient as
              its buffer: [Note: the root's big parameters] in units.py); at the last, start
              reducing the buffer to the owners, free k.
    end of backward (a callback queued on the autograd engine): wait for the reductions; each
              shard's `.grad` now holds this rank's slice of the averaged gradient.

So at most the root, the running unit and the prefetched one are gathered at once.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten

from paratrain.components.materialize import Materializer, MetaInit, has_meta
from paratrain.components.optim import clip_grad_norm_over
from paratrain.components.precision import cast_floating
from paratrain.distributed.comm import broadcast_coalesced, group_device
from paratrain.errors import UsageError
from paratrain.parallel.base import CheckpointLayout, FlatLayout, ParallelModule, uncompiled, user_key
from paratrain.parallel.zero.collectives import OwnerCollectives, reduced_sums_for
from paratrain.parallel.zero.flat_shard import FlatShard, refuse_unseen
from paratrain.parallel.zero.units import TrainingState, Unit, build_units
from paratrain.parallel.zero.wrap_policy import DEFAULT_WRAP_POLICY, WrapPolicy


class FullyShardedDataParallel(ParallelModule):
    """ZeRO stage 3 over `process_group`. Build it with `paratrain.shard(model, optimizer, stage=3)`,
    which also rebuilds the optimizer for the shards (the parameters it returns)."""

    def __init__(self, module: nn.Module, *, group_of: dict[nn.Parameter, int] | None = None,
                 process_group=None, wrap_policy: WrapPolicy | None = None, prefetch: bool = True,
                 param_dtype: torch.dtype | None = None, offload: bool = False,
                 collectives: OwnerCollectives | None = None, init: MetaInit | None = None,
                 device: torch.device | None = None, broadcast_buffers: bool = True, replicate_group=None):
        """`replicate_group`: hybrid sharding (torch FSDP2's HSDP): the ranks holding the same
        shard as this one in the other groups of `process_group`'s size; each gradient slice,
        reduced over `process_group`, is then all-reduced over them, and the replicas train as
        one data-parallel world of both sizes' product."""
        super().__init__()
        if not dist.is_initialized():
            raise UsageError("ZeRO stage 3 needs the default process group: call "
                             "paratrain.Topology.from_env().init() (or use paratrain.Session) first")
        if uncompiled(module) is not module:  # [Note: ZeRO-3 under torch.compile]
            warnings.warn("ZeRO-3 trains a torch.compile'd model correctly but uncompiled (its gather hooks cannot "
                          "be traced; compiling after setup too): zero2 or ddp keep the compiled graph", stacklevel=3)
        _forward_runs_eagerly()  # [Note: ZeRO-3 under torch.compile]
        self.module, self.process_group, self.prefetch = module, process_group, prefetch
        self.rank, self.world = dist.get_rank(process_group), dist.get_world_size(process_group)
        self.replicate_group = replicate_group
        copies, copy = ((dist.get_world_size(replicate_group), dist.get_rank(replicate_group))
                        if replicate_group is not None else (1, 0))
        self.replicas, self.replica_index = self.world * copies, copy * self.world + self.rank
        self.collectives = collectives or OwnerCollectives.for_group(process_group)
        # a meta-built model: made unit by unit in _build_units, by a rule equal on every rank
        self._materializer = Materializer(module, init) if has_meta(module) else None
        self._device = device or group_device(process_group)
        if self._materializer is None:
            self._broadcast(list(module.parameters()) + list(module.buffers()))
        self._key_order = list(module.state_dict().keys())
        group_of = group_of or {p: 0 for p in module.parameters()}
        self.param_dtype = param_dtype
        wrap_policy = wrap_policy or DEFAULT_WRAP_POLICY
        # the units, then the optimizer param group of each shard (units.py)
        self.units, self.shard_groups = build_units(
            module, wrap_policy.select(module), group_of, self._materialize, group=process_group, rank=self.rank,
            world=self.world, param_dtype=param_dtype, offload=offload, all_gather=self.collectives.all_gather)
        self.flats = [f for u in self.units for f in u.flats]  # every unit's, in unit order
        for flat in self.flats:
            flat.replicate_group, flat.replicate = replicate_group, copies
        self.shards = nn.ParameterList([f.shard for f in self.flats])
        self.state, self.peak_gathered_bytes = TrainingState.IDLE, 0
        self._sync_this_backward = True  # decided by the forward that built the graph
        self._reducing: list[FlatShard] = []  # the gradient reduction in flight
        self._forward_order: list[Unit] = []
        self._sums = None  # the finite check's ReducedSums, once watched (watch_reductions)
        # buffers follow torch DDP's rule: rank 0's are broadcast before a forward that follows a
        # synchronised one (BatchNorm statistics would otherwise drift apart across ranks)
        self.broadcast_buffers, self.require_forward_param_sync = broadcast_buffers, True
        self.modules_buffers = list(module.buffers())
        for unit in self.units:
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            for flat in unit.flats:  # each fires once per backward, when that use's gradient is in
                for index, (_, leaf) in enumerate(flat.leaves):
                    leaf.register_post_accumulate_grad_hook(functools.partial(self._post_accumulate, flat, index))

    def _materialize(self, name: str, module: nn.Module, params: list[nn.Parameter]) -> None:
        """A meta-built unit's values: its parameters and the buffers under it; at the root, the rest."""
        if self._materializer is not None:
            self._materializer.materialize(params + list(module.buffers()) if name else None, self._device)

    # -- forward ------------------------------------------------------------------------------------

    # [Note: ZeRO-3 under torch.compile] Its hooks gather into and free storages that are resized
    # in place, which dynamo cannot trace (it failed inside inductor on "dynamic shapes"): a
    # compiled ZeRO-3 model runs its forward eagerly, so it trains correctly, only uncompiled.
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._forget_unfinished_backward()
        if self.require_forward_param_sync:
            self.sync_buffers()
        if torch.is_grad_enabled():  # the forward after a no_sync() one skips it, as DDP's
            self.require_forward_param_sync = self.require_backward_grad_sync
        self.state = TrainingState.FORWARD
        self._sync_this_backward = self.require_backward_grad_sync
        if self.param_dtype is not None:  # inputs in the dtype the gathered parameters have
            args, kwargs = cast_floating((args, kwargs), self.param_dtype)
        return self.module(*args, **kwargs)

    def _pre_forward(self, unit: Unit, module, args) -> None:
        if unit.name == "" and self.state is TrainingState.IDLE:
            raise UsageError("call the sharded model (the object shard() returned), not the module inside it")
        if unit not in self._forward_order:
            self._forward_order.append(unit)
        self._unshard(unit)
        if self.prefetch:
            self._prefetch(unit, step=+1)

    def _post_forward(self, unit: Unit, module, args, output) -> Any:
        if unit.name:
            unit.reshard()
        else:  # the root: the forward is over
            self.state = TrainingState.IDLE
            if not torch.is_grad_enabled():  # inference: free everything, unused prefetches too
                for each in self.units:
                    each.reshard()
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(functools.partial(self._pre_backward, unit))
        return output

    # -- backward -----------------------------------------------------------------------------------

    def _pre_backward(self, unit: Unit, grad: torch.Tensor) -> None:
        # fires when the gradient of one of the unit's outputs is ready: its backward is next
        if unit.backward_started:
            return
        unit.backward_started = True
        if self.state is not TrainingState.BACKWARD:
            self.state = TrainingState.BACKWARD
            Variable._execution_engine.queue_callback(self._finish_backward)
            if self._sums is not None and all(s.grad is None for s in self.shards):
                self._sums.reset()  # a new step: the finite check starts afresh
        if self._sync_this_backward and unit.name:
            self._flush_partial(unit)
        self._unshard(unit)
        if self.prefetch:
            self._prefetch(unit, step=-1)

    def _post_accumulate(self, flat: FlatShard, index: int, leaf: torch.Tensor) -> None:
        sync = self._sync_this_backward
        if sync and flat.grad is None:  # its buffer is made now: never two full gradients at once
            self._settle_reduction()
        if not flat.grad_arrived(index):
            return
        if sync:  # that was the last of the flat's uses: its gradient is complete
            self._settle_reduction()  # one reduction in flight
            self._reducing = [flat]
            flat.start_grad_sync(self.collectives.reduce_scatter)
        flat.reshard()

    def _flush_partial(self, unit: Unit) -> None:
        """Before `unit`'s backward: reduce, and wait for, any other unit's gradient that is
        part-way, once per backward ([Note: a unit used twice] in flat_shard.py)."""
        for flat in (flat for other in self.units if other is not unit for flat in other.flats):
            if flat.grad_partial and not flat.flushed:
                self._settle_reduction()
                flat.start_grad_sync(self.collectives.reduce_scatter, partial=True)
                self._reducing = [flat]
                self._settle_reduction()

    def _settle_reduction(self) -> None:
        for earlier in self._reducing:  # waiting frees its full gradient
            earlier.finish_grad_sync(self._sums)
        self._reducing = []

    def _finish_backward(self) -> None:
        sync = self._sync_this_backward
        for unit in self.units:
            for flat in unit.flats:
                if sync and flat.grad_pending:  # a use had no gradient this time (refused below if all did)
                    flat.start_grad_sync(self.collectives.reduce_scatter)
                flat.finish_grad_sync(self._sums)
                flat.reshard()
                flat.end_backward()
            unit.backward_started = False
        self._reducing, self.state = [], TrainingState.IDLE
        if sync:  # [Note: no gradient] in flat_shard.py
            refuse_unseen(self.flats)

    def _forget_unfinished_backward(self) -> None:
        """A backward that raised never ran its end-of-backward callback: start clean."""
        if self.state is TrainingState.IDLE and not any(u.backward_started for u in self.units):
            return
        for unit in self.units:
            unit.backward_started = False
            for flat in unit.flats:
                flat.drop_pending()
                flat.reshard()
        self._reducing = []
        self.state = TrainingState.IDLE

    # -- gathering ----------------------------------------------------------------------------------

    def _unshard(self, unit: Unit) -> None:
        for flat in unit.flats:
            flat.start_unshard()
        self._note_gathered()
        for flat in unit.flats:
            flat.finish_unshard()

    def _prefetch(self, unit: Unit, step: int) -> None:
        order = self._forward_order
        i = order.index(unit) + step
        if 0 <= i < len(order) and order[i].name:
            for flat in order[i].flats:
                flat.start_unshard()
            self._note_gathered()

    def _note_gathered(self) -> None:
        now = sum(f.full_bytes for f in self.flats if f.full.untyped_storage().size())
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)

    # -- accumulation and state ---------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients: the shards', and full ones accumulated under no_sync()."""
        for shard in self.shards:
            shard.grad = None
        for flat in self.flats:
            flat.drop_pending()  # and forget which parameters had a gradient ([Note: no gradient])

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        """This rank's slices of the averaged gradients; the others are on the other ranks."""
        return [s.grad for s in self.shards if s.grad is not None], self.process_group or dist.group.WORLD

    def watch_reductions(self) -> None:
        if self.replicate_group is not None:  # a sum over one group's reductions: the session reads the shards
            return
        self._sums = reduced_sums_for(sum(f.padded for f in self.flats), self.collectives.reduce_scatter,
                                      self.process_group)

    def reduced_finite(self) -> torch.Tensor | None:
        return self._sums.take() if self._sums is not None else None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole (averaged) gradient, computed from the shards."""
        grads, group = self.local_grads()
        return clip_grad_norm_over(grads, max_norm, group)

    def sync_buffers(self) -> None:
        if self.broadcast_buffers and self.modules_buffers and self.replicas > 1:
            self._broadcast(self.modules_buffers)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values on every data-parallel rank: over this group, then across the replicas."""
        broadcast_coalesced(tensors, self.process_group)
        if self.replicate_group is not None:
            broadcast_coalesced(tensors, self.replicate_group)

    def state_pieces(self) -> Iterator[dict[str, torch.Tensor]]:
        """Unit by unit (every rank gathers the unit, then drops it), then the buffers and frozen
        parameters, which every rank holds whole."""
        gathered = set()
        for unit in self.units:
            piece = {}
            for flat in unit.flats:
                for slot, value in zip(flat.slots, flat.gather_values()):
                    piece.update({user_key(name): value for name in slot.names})
                    gathered.update(slot.names)
            yield piece
        rest = self.module.state_dict()
        yield {user_key(k): rest[k] for k in self._key_order if k not in gathered}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (from `full_state_dict` or the plain model): each rank
        keeps its slice."""
        missing = [user_key(k) for k in self._key_order if user_key(k) not in state]
        if missing:
            raise UsageError(f"the state dict lacks {len(missing)} key(s) of this model, e.g. {missing[:3]}")
        for unit in self.units:
            for flat in unit.flats:
                flat.load_values([state[user_key(s.names[0])] for s in flat.slots])
        buffers = self.module.state_dict()
        self.module.load_state_dict({k: state[user_key(k)] for k in buffers}, strict=False)

    def checkpoint_layout(self) -> CheckpointLayout:
        """The parameters live in the flat shards (each shard and the parameters its buffer
        holds); frozen parameters, which are not sharded, and buffers are whole."""
        flat = {f.shard: FlatLayout(tuple((user_key(s.names[0]), s.offset, s.shape) for s in f.slots),
                                    f.padded // self.world, self.rank, self.world)
                for f in self.flats}
        whole = CheckpointLayout.whole(self.module)  # frozen parameters and buffers
        shapes = {n: s for layout in flat.values() for n, _, s in layout.slots}
        tied = {user_key(n): user_key(s.names[0]) for f in self.flats for s in f.slots for n in s.names[1:]}
        return CheckpointLayout(whole.params, flat, True, whole.buffers, {**shapes, **whole.shapes},
                                {**tied, **whole.aliases}, whole.persistent)


@functools.cache
def _forward_runs_eagerly() -> None:
    """[Note: ZeRO-3 under torch.compile], once, for the class. Not a decorator: that imports
    torch._dynamo (two seconds) with `import paratrain`, in every process, the launcher too."""
    FullyShardedDataParallel.forward = torch.compiler.disable(FullyShardedDataParallel.forward)
