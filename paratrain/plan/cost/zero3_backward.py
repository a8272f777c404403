"""What a ZeRO-3 backward holds at once, walked flat by flat in the order gradients arrive.

stage3.py reduces one flat's gradient at a time, and each flat's buffer is made when its first
gradient arrives (FlatShard.grad_arrived), after the previous reduction was waited for, which
frees that buffer and adds its slice into the shard's gradient. So at the arrival of a flat k's
first gradient, beyond the state at rest (the shards' gradients excepted), a rank holds:

- the root's full parameters, unit k's and, with prefetch, the next unit's (in backward order);
- the shards' gradients of the flats reduced before: "done";
- autograd's new gradient of one of k's parameters: `arrived`, the largest of them;
- before the wait: flat k-1's full buffer, still reducing; after it: flat k's buffer, with
  flat k-1's slice now in "done". A flat of one parameter, unpadded, adopts autograd's
  gradient as its buffer (FlatShard._can_adopt); any other copies it in, so the two coexist.

The walk takes the flats in the reverse of the model's registration order, the order gradients
arrive in a feed-forward model (as memory.py assumes for DDP's buckets): a flat's first gradient
comes at its last-registered parameter, and it is reduced at its first-registered one. A root
flat that spans the model (a final norm with the position embedding) holds its buffer over the
flats in between. The activations are not in it: memory.py counts them with
the first flat's buffer at the backward's start, where they peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.parallel.buckets import padded_numel
from paratrain.parallel.zero import ZeRO
from paratrain.plan.cost.layouts import zero3_flats


@dataclass(frozen=True)
class Flat:
    """One flat shard as the walk sees it (bytes)."""

    unit: str  # its unit's name; "" for the root
    position: int  # its first parameter's index in the model's registration order: reduced there
    opens: int  # its last parameter's index: its buffer is made there
    full: int  # its full gradient buffer (the padded flat, in param_dtype)
    shard: int  # its shard's gradient on the device (0 when offloaded)
    arrived: int  # autograd's gradient of its largest parameter
    adopts: bool  # one parameter, unpadded: autograd's gradient becomes the buffer
    stepped: tuple[int, torch.dtype]  # its shard's elements and dtype, which the optimizer steps

    @property
    def with_copy(self) -> int:
        """The flat's buffer and, while a gradient is copied into it, autograd's tensor."""
        return self.full + (0 if self.adopts else self.arrived)


def zero3_walk_flats(model: nn.Module, strategy: ZeRO, group_of: dict[nn.Parameter, int], world: int) -> list[Flat]:
    """Every flat shard stage3.py makes of `model` on `world` ranks (layouts.zero3_flats), units in
    model order, then the root's."""
    place = {p: i for i, p in enumerate(model.parameters())}
    flats = []
    for name, members_list in zero3_flats(model, strategy, group_of).items():
        for members in members_list:
            padded = padded_numel(sum(p.numel() for p in members), world)
            shard, size = (padded // world, members[0].dtype), (strategy.param_dtype or members[0].dtype).itemsize
            flats.append(Flat(name, position=min(place[p] for p in members), opens=max(place[p] for p in members),
                              full=padded * size, shard=0 if strategy.offload else shard[0] * shard[1].itemsize,
                              arrived=max(p.numel() for p in members) * size,
                              adopts=len(members) == 1 and padded == members[0].numel(), stepped=shard))
    return flats


def backward_peak(flats: list[Flat], unit_full: dict[str, int], prefetch: bool) -> int:
    """The most that the gathered units, gradient buffers and shards' gradients hold at once in
    one backward without accumulation (module docstring), in bytes.

    unit_full: each unit's full parameters gathered, "" (the root) included."""
    walk = sorted(flats, key=lambda f: f.position, reverse=True)
    units = list(dict.fromkeys(f.unit for f in walk if f.unit))  # in backward order: as the walk meets them
    root = unit_full.get("", 0)
    most = done = 0
    previous: Flat | None = None
    for flat in walk:
        held = root + _units_up(units, flat, walk, unit_full, prefetch)
        held += sum(f.full for f in walk if f.opens > flat.position > f.position)  # buffers open across it
        before_wait = flat.arrived + (previous.full if previous else 0) + done
        if previous is not None:
            done += previous.shard
        most = max(most, held + max(before_wait, flat.with_copy + done))
        previous = flat
    return most


def _units_up(units: list[str], flat: Flat, walk: list[Flat], unit_full: dict[str, int], prefetch: bool) -> int:
    """The units gathered while `flat`'s gradient arrives: its own (a root flat: the next unit to
    run) and, with prefetch, the one after it."""
    if flat.unit:
        at = units.index(flat.unit)
    else:  # a root parameter: the next unit whose flats come after it in the walk
        later = [f.unit for f in walk if f.unit and f.position < flat.position]
        if not later:
            return 0
        at = units.index(later[0])
    return sum(unit_full[u] for u in units[at:at + (2 if prefetch else 1)])
