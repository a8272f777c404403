"""The collectives only ZeRO uses: reduce a flat buffer to the ranks that own its slices, gather
the slices back from their owners, and add a reduced slice into what a shard already holds.

Each picks, per backend, what measured faster on it (the figures are in the docstrings); the
choice is made here so that stage 1-2 and stage 3 make it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.distributed.comm import all_gather_single, global_rank, reduce_scatter_single
from paratrain.errors import UsageError
from paratrain.parallel.buckets import ReducedSums


@dataclass(frozen=True)
class OwnerCollectives:
    """Which collectives move slices to and from their owners. `for_group` picks what measured
    faster on the group's backend; tests force the other choice to run both paths on gloo."""

    reduce_scatter: bool  # reduce by reduce-scatter (else all-reduce and keep the slice)
    all_gather: bool  # gather by one all-gather (else one broadcast per owner)

    @classmethod
    def for_group(cls, group=None) -> "OwnerCollectives":
        gloo = dist.get_backend(group) == "gloo"
        return cls(reduce_scatter=not gloo, all_gather=not gloo)


def reduced_sums_for(elements: int, scatter: bool, group=None) -> ReducedSums | None:
    """A ReducedSums where each rank sees every reduction whole (`scatter`: reduce-scatters, which
    leave each rank its slice only; then None, and the step sums the shards' gradients). Up to
    `ReducedSums.LIMIT` trainable `elements` each rank sums every reduced buffer whole: one sum
    costs less than an all-reduce of the ranks' sums (about 0.3-0.6 ms per step on gloo with
    bench/session.py's tiny model; summing 1M floats, ~0.2 ms). Above it each rank of `group`
    sums its slice of each buffer as its reduction completes, and the ranks' sums are all-reduced
    at the step, where the step used to read the shards' gradients instead: the bench MLP's zero3
    at world 2 (A/B in one job, 40 rounds) cost 11.8 ms a step over the plain loop that way, and
    1.4 ms this way (zero2: 7.1 and 5.8 ms)."""
    if scatter:
        return None
    if elements <= ReducedSums.LIMIT:
        return ReducedSums()
    return ReducedSums((dist.get_rank(group), dist.get_world_size(group), group or dist.group.WORLD))


def reduce_to_owners(flat: torch.Tensor, group=None, *, rank: int, world: int,
                     scatter: bool) -> tuple[Any, torch.Tensor]:
    """Start a SUM over `group` of `flat` (N equal slices) after which this rank needs only slice
    `rank`; returns (work, slice), the slice valid after `work.wait()`.

    `scatter=True` reduce-scatters (half the bytes: nccl); `scatter=False` all-reduces and keeps
    the slice, which measured faster on gloo: on 2 CPU ranks a 25 MiB reduce-scatter took 26 ms
    and an all-reduce 23 ms (while a 1 MiB one was faster as a reduce-scatter)."""
    if scatter:
        out = flat.new_empty(flat.numel() // world)
        return reduce_scatter_single(out, flat, group=group, async_op=True), out
    return dist.all_reduce(flat, group=group, async_op=True), flat.view(world, -1)[rank]


def gather_from_owners(flat: torch.Tensor, mine: torch.Tensor, group=None, *, rank: int,
                       world: int, all_gather: bool) -> list[Any]:
    """Start filling `flat` (N equal slices) with every rank's `mine`, this rank's slice (any
    dtype or device; it may already be slice `rank` of `flat`); returns the works to wait on.

    `all_gather=False` (gloo): `mine` goes into its slice and each owner broadcasts its slice: on
    2 CPU ranks gloo's all-gather took 157 ms for 72 MiB, 31 ms for 16 MiB and 4.7 ms for 3 MiB,
    the same bytes as broadcasts 35, 5.8 and 1.5 ms (measured for bench/zero.py).
    `all_gather=True` (nccl): one all-gather of a copy of `mine` (its input must not alias its
    output)."""
    pieces = flat.view(world, -1)
    if all_gather:
        local = mine.to(flat.device, flat.dtype, copy=True)
        return [all_gather_single(flat, local, group=group, async_op=True)]
    if mine.data_ptr() != pieces[rank].data_ptr():
        pieces[rank].copy_(mine)
    return [dist.broadcast(piece, src=global_rank(group, owner), group=group, async_op=True)
            for owner, piece in enumerate(pieces)]


def add_into(held: torch.Tensor | None, new: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """`held + new`, in place in `held`; a copy of `new` (on `like`'s device and dtype) when
    nothing is held yet, so the full buffer `new` may view can be freed."""
    like = held if held is not None else like if like is not None else new
    new = new.to(like.device, like.dtype, copy=held is None)
    return new if held is None else held.add_(new)


# [Note: the same unit on every rank]
# ZeRO-3's gathers pair up across ranks by their order alone. Where ranks gather different units
# at the same point (a branch that depends on the data runs a wrapped module on some ranks only,
# or two of them in another order), one rank's gather of unit A fills the other's unit B: of
# different sizes, the collectives mismatch (a gloo error or a hang); of the same size, the
# forward runs on another unit's values and nothing fails. Under debug_collectives
# (TORCH_DISTRIBUTED_DEBUG=DETAIL), each gather first all-gathers the index of the flat every
# rank is about to gather, and every rank raises where they differ, naming what each gathers:
# one all-gather of an int64 more per gather, in a mode that fingerprints every collective
# anyway (torch's FSDP, at that level, compares the ranks' gathers in the first iteration only:
# _exec_order_utils.py). Off, it costs nothing, and the no-gradient check at the end of backward
# ([Note: no gradient] in flat_shard.py) still catches a unit that a rank never ran.


def refuse_other_gathers(index: int, labels: list[str], group=None, device=None) -> None:
    """Raise on every rank of `group` unless each is about to gather flat `index` (of `labels`,
    every flat's name, the same on every rank): [Note: the same unit on every rank]."""
    mine = torch.tensor([index], dtype=torch.int64, device=device)
    every = mine.new_empty(dist.get_world_size(group))
    all_gather_single(every, mine, group=group)
    if (every != index).any():
        what = "; ".join(f"rank {global_rank(group, r)} {labels[i]}" for r, i in enumerate(every.tolist()))
        raise UsageError(f"ZeRO stage 3: the ranks are gathering different units at the same point ({what}). "
                         "Every rank must run the same wrapped modules in the same order in each forward "
                         "and backward; a module that only some ranks run (a branch on the data) cannot be a "
                         "unit of its own: leave it out of the wrap policy, so that its parent unit holds it")
