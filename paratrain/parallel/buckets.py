"""Gradient buckets: flat buffers that gradients live in, each reduced as one message.

Layout, as torch's DDP lays them out (torch/nn/parallel/distributed.py `_build_params_for_reducer`
and reducer.cpp `compute_bucket_assignment_by_size` / `rebuild_buckets`), so that every element is
summed in the same ring chunk, in the same order, as under torch's DDP:

- `assign(params, caps)` walks the parameters in the order given, one open bucket per kind
  (dtype, device, and an optional key such as a ZeRO param group), and closes a bucket once it
  holds at least its cap; bucket i of a kind uses caps[min(i, last)]. Buckets are listed in the
  order they closed, then the ones left open.
- The first layout takes the parameters in registration order, sorts the buckets by their first
  parameter and reverses the list, so the last-registered parameters, whose gradients backward
  usually produces first, are in the bucket launched first. When the buckets will be rebuilt, the
  cap of this first layout is unlimited: one bucket per kind.
- `rebuilt(order)`: after the first synchronised backward, the buckets are laid out again in the
  order the gradients actually arrived (caps as given: 1 MiB then `bucket_cap_mb`), which is what
  lets the first bucket launch early when registration order and backward order differ.

Each parameter's `.grad` is a view into its bucket (Megatron-core's "grad buffer" idea), so after
the reduction the averaged gradients are already where the optimizer reads them and no second
copy of the gradients exists. Buckets are launched strictly in index order even when they fill
out of order, so that every rank issues the same sequence of collectives.

The reduction is a component (`Reduction`): `AllReduce` here, hierarchical.py's three phases,
ZeRO's reduction to the owners (zero/stage12.py). Timeline of one backward (each bucket's
reduction overlaps the rest of backward):

    backward:  [grads of bucket 0][grads of bucket 1][grads of bucket 2]
    comm:                         [reduce 0         ][reduce 1         ][reduce 2]
    finish_grad_sync():                                                          wait all
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.comm import sum_over

FIRST_BUCKET_BYTES = 1024 * 1024  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_MB = 25
UNLIMITED = [sys.maxsize]


def default_caps() -> list[int]:
    """torch's default bucket caps in bytes: a small first bucket, so its reduction starts early."""
    return [FIRST_BUCKET_BYTES, DEFAULT_BUCKET_MB * 2**20]


@dataclass
class Bucket:
    """A flat buffer holding the gradients of `params`, back to back."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of numels, padded) in the parameters' dtype and device
    offsets: list[int]
    last: bool = False  # the last bucket launched in a backward (torch's GradBucket.is_last())
    pending: int = 0  # parameters whose gradient has not arrived in this backward

    def view(self, slot: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter `slot`'s piece of the gradient buffer (or of another buffer of its layout)."""
        p, flat = self.params[slot], self.buffer if buffer is None else buffer
        return flat[self.offsets[slot]:self.offsets[slot] + p.numel()].view_as(p)


class ReducedSums:
    """The finite-gradient check (session/step.py) folded into the reduction: where a rank holds each
    reduction whole (DDP's all-reduce; ZeRO's all-reduce path and stage 1), a sum of every
    reduced buffer, taken as its reduction completes, tells it whether any element on any rank is
    NaN or infinite, with no second read of the gradients at the step and no collective (after a
    reduce-scatter only a slice's owner could tell, and a flag all-reduced over the ranks told the
    rest). Sums of finite values past the float range would be a false alarm, at gradients of
    1e38. ZeRO uses it on gloo's all-reduce path (zero/collectives.py, reduced_sums_for).

    `share=(rank, world, group)`: every rank holds the same reduced buffers, so each sums only
    slice `rank` of `world` and take() sums the ranks' sums over `group` (a group, WORLD rather
    than None: comm.sum_over takes None for "nothing to reduce"): a read of Ψ/N instead of Ψ
    for one all-reduce of a scalar (DDP and ZeRO above `LIMIT` elements; ddp.py watch_reductions)."""

    LIMIT = 1 << 20

    def __init__(self, share: tuple[int, int, Any] | None = None) -> None:
        self.total: torch.Tensor | None = None
        self.share = share

    def add(self, flat: torch.Tensor) -> None:
        """`flat` is a whole reduced buffer (after its work's wait)."""
        if self.share is not None:
            rank, world, _ = self.share
            flat = flat.tensor_split(world)[rank]
        total = flat.detach().sum(dtype=torch.float32)
        self.total = total if self.total is None else self.total.add_(total)

    def take(self) -> torch.Tensor | None:
        """The sum of every reduced element (a 0-dim fp32 tensor: finite exactly when each element
        on each rank was), or None when none was taken; starts the next count. Shared: a
        collective, so every rank calls it at the same point (once per optimizer step, after the
        same reductions). The caller tests it on the host (session/step.py: `math.isfinite(x.item())`,
        one op where `torch.isfinite` of a scalar is four, ~20 us a step on the tiny model)."""
        total, self.total = self.total, None
        if total is None or self.share is None:
            return total
        return sum_over(total, self.share[2])

    def reset(self) -> None:
        """Forget what was summed (no collective)."""
        self.total = None


class Reduction:
    """How full buckets are reduced. `start(bucket)` is called in bucket order as each fills;
    `finish()` waits for every started one, after which each bucket holds the average (the
    gradients entered their buckets already multiplied by 1/N, so a SUM is the mean, unless
    `prescale` is False: then they enter as they are and the reduction divides, as a torch DDP
    communication hook does)."""

    pad_to: int = 1  # bucket buffers are padded to a multiple of this (equal chunks per rank)
    rebuild: bool = True  # the buckets may be laid out again after the first backward
    # what a user whose parameter got no gradient can do (grad_sync.py names the parameters)
    unused_advice: str = "pass find_unused_parameters=True to DistributedDataParallel (or pt.DDP)"
    prescale: bool = True  # gradients enter their bucket multiplied by 1/N
    sums: ReducedSums | None = None  # set: each reduced buffer is summed as it completes

    def key(self, p: nn.Parameter) -> Any:
        """Parameters with different keys never share a bucket."""
        return None

    def before_fill(self, bucket: Bucket) -> None:
        """A gradient is about to move into `bucket` (ZeRO-2 reallocates a freed buffer here)."""

    def start(self, bucket: Bucket) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError


@dataclass
class AllReduce(Reduction):
    """DDP's reduction: one asynchronous all-reduce per bucket. With `sums` set (the session's
    finite check, DDP.watch_reductions) each bucket is summed as soon as its all-reduce is done,
    while the later ones are still in flight: one read of the gradients the check needs anyway,
    partly hidden (bench/session.py's MLP 18.9 M loops, A/B in one job of 40 rounds: the check
    cost 6.7 ms per step read after the wait, 4.5 ms read here)."""

    group: dist.ProcessGroup | None = None
    works: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    sums: ReducedSums | None = None

    def start(self, bucket: Bucket) -> None:
        self.works.append((dist.all_reduce(bucket.buffer, group=self.group, async_op=True), bucket.buffer))

    def finish(self) -> None:
        for work, buffer in self.works:  # each wait honours the group's timeout
            work.wait()
            if self.sums is not None:
                self.sums.add(buffer)
        self.works.clear()


def assign(params: list[nn.Parameter], caps_bytes: list[int],
           key: Callable[[nn.Parameter], Any] | None = None) -> list[list[nn.Parameter]]:
    """Group `params` (in the order given) into buckets of one kind, closed at their cap."""
    closed: list[list[nn.Parameter]] = []
    open_: dict[tuple, tuple[list[nn.Parameter], list[int]]] = {}  # kind → (bucket, [bytes])
    count: dict[tuple, int] = {}  # buckets closed so far, per kind
    for p in params:
        kind = (p.dtype, p.device, key(p) if key else None)
        members, size = open_.setdefault(kind, ([], [0]))
        members.append(p)
        size[0] += p.numel() * p.element_size()
        if size[0] >= caps_bytes[min(count.get(kind, 0), len(caps_bytes) - 1)]:
            closed.append(members)
            count[kind] = count.get(kind, 0) + 1
            del open_[kind]
    return closed + [members for members, _ in open_.values()]


def padded_numel(numel: int, multiple: int) -> int:
    """`numel` rounded up to a multiple of `multiple` (a buffer that cuts into equal slices)."""
    return -(-numel // multiple) * multiple


def buffer_numel(members: list[nn.Parameter], pad_to: int) -> int:
    """Elements of the flat buffer that holds `members` back to back, zero-padded to `pad_to`."""
    return padded_numel(sum(p.numel() for p in members), pad_to)


def first_layout(params: list[nn.Parameter], caps_bytes: list[int],
                 key: Callable[[nn.Parameter], Any] | None = None) -> list[list[nn.Parameter]]:
    """The layout before any backward: registration order, buckets reversed (module doc)."""
    index = {p: i for i, p in enumerate(params)}
    buckets = sorted(assign(params, caps_bytes, key), key=lambda b: index[b[0]])
    return buckets[::-1]


@dataclass
class GradBuckets:
    """The buckets of one model, their per-backward state, and the reduction they go through."""

    buckets: list[Bucket]
    reduction: Reduction
    scale: float  # a synchronised backward's gradients are multiplied by this on their way in:
    # 1/N, or 1 when the reduction divides (GradSync sets it per backward under join())
    slot_of: dict[nn.Parameter, tuple[Bucket, int]] = field(default_factory=dict)
    next_to_launch: int = 0
    arrived: list[nn.Parameter] = field(default_factory=list)  # in this backward, in order

    @classmethod
    def build(cls, layout: list[list[nn.Parameter]], reduction: Reduction, scale: float) -> "GradBuckets":
        """Buckets holding `layout`'s parameter lists, each buffer zero-padded to a multiple of
        `reduction.pad_to` elements."""
        buckets = []
        for index, members in enumerate(layout):
            offsets = [sum(p.numel() for p in members[:i]) for i in range(len(members))]
            buffer = torch.zeros(buffer_numel(members, reduction.pad_to), dtype=members[0].dtype, device=members[0].device)
            buckets.append(Bucket(index, members, buffer, offsets, last=index == len(layout) - 1))
        grad_buckets = cls(buckets, reduction, scale)
        for bucket in buckets:
            for slot, p in enumerate(bucket.params):
                grad_buckets.slot_of[p] = (bucket, slot)
                # keep an existing gradient (accumulated before wrapping or rebuilding) in the bucket
                if p.grad is not None:
                    bucket.view(slot).copy_(p.grad)
                    p.grad = bucket.view(slot)
        return grad_buckets

    def adopt_grad(self, p: nn.Parameter, *, average: bool = False, zero_if_missing: bool = False) -> None:
        """Make `p.grad` the bucket view: move a freshly allocated gradient in (after
        `zero_grad(set_to_none=True)` autograd allocates a new tensor), or zero the slot.
        `average` multiplies by `scale` (1/N) on the way, so the reduction's SUM is the mean (one
        pass over the gradient instead of a copy and a division). Multiplied, not divided: torch's reducer
        multiplies by 1/N (reducer.cpp `mark_variable_ready_dense`), and at N = 3 or 5 the two
        differ in the last bit."""
        bucket, slot = self.slot_of[p]
        self.reduction.before_fill(bucket)
        view = bucket.view(slot)
        factor = self.scale if average else 1.0
        if p.grad is None:
            if zero_if_missing:
                view.zero_()
        elif p.grad.data_ptr() == view.data_ptr():
            if factor != 1.0:
                view.mul_(factor)
        else:
            torch.mul(p.grad, factor, out=view)
            p.grad = view

    def reset(self) -> None:
        """Forget the previous backward: every parameter is pending again."""
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
        self.next_to_launch = 0
        self.arrived.clear()

    def mark_ready(self, p: nn.Parameter) -> None:
        """`p`'s gradient is final for this backward; launch every bucket that is now complete."""
        bucket, _ = self.slot_of[p]
        self.arrived.append(p)
        bucket.pending -= 1
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending == 0:
            self.reduction.start(self.buckets[self.next_to_launch])
            self.next_to_launch += 1

    def finish_grad_sync(self) -> None:
        """Wait for every launched reduction."""
        self.reduction.finish()

    def missing(self) -> list[nn.Parameter]:
        """Parameters whose gradient has not arrived in this backward."""
        arrived = set(self.arrived)
        return [p for b in self.buckets for p in b.params if p not in arrived]
