"""Gradient buckets: flat buffers that gradients live in, each all-reduced as one message.

Parameters are assigned to buckets in reverse registration order (the order backward usually
produces their gradients), capped in bytes: the first bucket small (1 MiB) so the first
all-reduce starts early, the others `bucket_cap_mb` (25 MiB by default), as torch's reducer
does (torch/csrc/distributed/c10d/reducer.cpp, `compute_bucket_assignment_by_size`).

Each parameter's `.grad` is a view into its bucket (Megatron-core's "grad buffer" idea), so
after the all-reduce the averaged gradients are already where the optimizer reads them and no
second copy of the gradients exists.

Buckets are launched strictly in index order even when they fill out of order, so that every
rank issues the same sequence of collectives.

Timeline of one backward (each bucket's all-reduce overlaps the rest of backward):

    backward:  [grads of bucket 0][grads of bucket 1][grads of bucket 2]
    comm:                         [all-reduce 0     ][all-reduce 1     ][all-reduce 2]
    finish_grad_sync():                                                              wait all
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

FIRST_BUCKET_BYTES = 1024 * 1024
DEFAULT_BUCKET_MB = 25


@dataclass
class Bucket:
    """A flat buffer holding the gradients of `params`, back to back."""

    index: int
    params: list[nn.Parameter]
    buffer: torch.Tensor  # (sum of numels,) in the parameters' dtype and device
    offsets: list[int]
    pending: int = 0  # parameters whose gradient has not arrived in this backward
    work: dist.Work | None = None  # the in-flight all-reduce

    def view(self, slot: int, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter `slot`'s piece of the gradient buffer (or of another buffer of its layout)."""
        p, flat = self.params[slot], self.buffer if buffer is None else buffer
        return flat[self.offsets[slot]:self.offsets[slot] + p.numel()].view_as(p)


def assign_buckets(params: list[nn.Parameter], caps_bytes: list[int],
                   kind_of: Callable[[nn.Parameter], Any] | None = None) -> list[list[nn.Parameter]]:
    """Group `params` (already in the desired order) into buckets of one dtype and device (and one
    `kind_of(p)`, e.g. an optimizer param group) whose size stays under the cap; bucket i uses
    caps_bytes[min(i, len-1)]."""
    buckets: list[list[nn.Parameter]] = []
    open_by_kind: dict[tuple, list[nn.Parameter]] = {}
    size_by_kind: dict[tuple, int] = {}
    for p in params:
        kind = (p.dtype, p.device, kind_of(p) if kind_of else None)
        if kind not in open_by_kind:
            open_by_kind[kind], size_by_kind[kind] = [], 0
            buckets.append(open_by_kind[kind])
        open_by_kind[kind].append(p)
        size_by_kind[kind] += p.numel() * p.element_size()
        if size_by_kind[kind] >= caps_bytes[min(len(buckets) - 1, len(caps_bytes) - 1)]:
            del open_by_kind[kind]  # the next parameter of this kind opens a new bucket
    return buckets


@dataclass
class GradBuckets:
    """The buckets of one model and their per-backward state."""

    buckets: list[Bucket]
    group: dist.ProcessGroup | None
    world_size: int
    slot_of: dict[nn.Parameter, tuple[Bucket, int]] = field(default_factory=dict)
    next_to_launch: int = 0
    ready: set[nn.Parameter] = field(default_factory=set)  # arrived in this backward

    @classmethod
    def build(cls, params: list[nn.Parameter], caps_bytes: list[int], group, *, pad_to: int = 1,
              kind_of: Callable[[nn.Parameter], Any] | None = None) -> "GradBuckets":
        """Buckets for `params`; each buffer is zero-padded to a multiple of `pad_to` elements
        (sharded strategies cut every bucket into `pad_to` equal shards)."""
        buckets = []
        for index, members in enumerate(assign_buckets(params, caps_bytes, kind_of)):
            offsets, total = [], 0
            for p in members:
                offsets.append(total)
                total += p.numel()
            total = -(-total // pad_to) * pad_to
            buffer = torch.zeros(total, dtype=members[0].dtype, device=members[0].device)
            buckets.append(Bucket(index, members, buffer, offsets))
        grad_buckets = cls(buckets, group, dist.get_world_size(group))
        for bucket in buckets:
            for slot, p in enumerate(bucket.params):
                grad_buckets.slot_of[p] = (bucket, slot)
                # keep an existing gradient (e.g. accumulated before wrapping) inside the bucket
                if p.grad is not None:
                    bucket.view(slot).copy_(p.grad)
                    p.grad = bucket.view(slot)
        return grad_buckets

    def adopt_grad(self, p: nn.Parameter, *, average: bool = False, zero_if_missing: bool = False) -> None:
        """Make `p.grad` the bucket view: move a freshly allocated gradient in (after
        `zero_grad(set_to_none=True)` autograd allocates a new tensor), or zero the slot.
        `average` divides by the world size on the way, so the all-reduce's SUM is the mean
        (one pass over the gradient instead of a copy and a division; torch's reducer also
        scales while copying, reducer.cpp `mark_variable_ready_dense`)."""
        bucket, slot = self.slot_of[p]
        view = bucket.view(slot)
        divisor = self.world_size if average else 1
        if p.grad is None:
            if zero_if_missing:
                view.zero_()
        elif p.grad.data_ptr() == view.data_ptr():
            if divisor != 1:
                view.div_(divisor)
        else:
            torch.div(p.grad, divisor, out=view)
            p.grad = view

    def reset(self) -> None:
        """Forget the previous backward: every parameter is pending again."""
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.params), None
        self.next_to_launch = 0
        self.ready.clear()

    def mark_ready(self, p: nn.Parameter) -> None:
        """`p`'s gradient is final for this backward; launch every bucket that is now complete."""
        bucket, _ = self.slot_of[p]
        self.ready.add(p)
        bucket.pending -= 1
        while self.next_to_launch < len(self.buckets) and self.buckets[self.next_to_launch].pending == 0:
            self.start_grad_sync(self.buckets[self.next_to_launch])
            self.next_to_launch += 1

    def start_grad_sync(self, bucket: Bucket) -> None:
        # every gradient in the bucket was divided by the world size as it arrived (adopt_grad):
        # the SUM is the mean, and summing pre-divided values cannot overflow in fp16
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def finish_grad_sync(self) -> None:
        """Wait for every launched all-reduce (each wait honours the group's timeout)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None

    def missing(self) -> list[nn.Parameter]:
        """Parameters whose gradient has not arrived in this backward."""
        return [p for b in self.buckets for p in b.params if p not in self.ready]
