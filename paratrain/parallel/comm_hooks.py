"""torch's DDP communication hooks as a bucket reduction: `DistributedDataParallel.register_comm_hook`.

A hook is `hook(state, bucket) -> torch.futures.Future` (torch/nn/parallel/distributed.py
`register_comm_hook`; torch.distributed.algorithms.ddp_comm_hooks: `allreduce_hook`,
`fp16_compress_hook`, `bf16_compress_hook`, PowerSGD's `powerSGD_hook` with `PowerSGDState`). Our
buckets reach it through `GradBucket`, which offers what torch's `dist.GradBucket` offers:

    index()          the bucket's position in launch order (PowerSGD keys its state by it)
    buffer()         the flat gradients, back to back in the bucket's parameter order
    gradients()      one view of buffer() per parameter, in its shape
    parameters()     the parameters, in the same order
    is_last()        whether it is the last bucket launched in this backward
    set_buffer(t)    what buffer() returns from now on (torch's compression wrappers)

As in torch's reducer, gradients enter their bucket as they are (`prescale = False`: the hook
divides), each full bucket's hook runs as soon as it fills, and when backward ends the futures are
waited in bucket order and each value is copied into its bucket, which the parameters' `.grad`
view. The layout is torch's (buckets.py), so a hook sees the same buckets under ours and torch's
DDP and the parameters come out bitwise equal (tests/parallel/test_ddp_comm_hooks.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.buckets import Bucket, Reduction


class GradBucket:
    """One of our buckets as a communication hook sees it (module docstring)."""

    def __init__(self, bucket: Bucket):
        self._bucket = bucket
        self._buffer = bucket.buffer

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._bucket.view(slot) for slot in range(len(self._bucket.params))]

    def parameters(self) -> list[nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._bucket.last


@dataclass
class CommHookReduction(Reduction):
    """Each bucket reduced by `hook(state, GradBucket)`; its future's value is the reduced bucket."""

    state: Any
    hook: Callable[[Any, GradBucket], torch.futures.Future]
    prescale = False  # the hook divides (torch: "Grad bucket's tensors will not be predivided")
    pending: list[tuple[Bucket, torch.futures.Future]] = field(default_factory=list)

    def start(self, bucket: Bucket) -> None:
        future = self.hook(self.state, GradBucket(bucket))
        if not callable(getattr(future, "wait", None)):  # `then` gives torch._C.Future, not the subclass
            raise UsageError(f"the communication hook {_name(self.hook)} returned {type(future).__name__}; "
                             "it must return a torch.futures.Future whose value is the reduced bucket "
                             "(e.g. dist.all_reduce(t, async_op=True).get_future().then(...))")
        self.pending.append((bucket, future))

    def finish(self) -> None:
        try:
            for bucket, future in self.pending:  # in launch order, as torch's reducer waits
                self._land(bucket, future.wait())
        finally:
            self.pending.clear()

    def _land(self, bucket: Bucket, value: Any) -> None:
        if isinstance(value, (list, tuple)) and len(value) == 1:  # a bare all-reduce's future
            value = value[0]
        if not torch.is_tensor(value) or value.numel() != bucket.buffer.numel():
            got = f"a tensor of {value.numel()} elements" if torch.is_tensor(value) else type(value).__name__
            raise UsageError(f"the communication hook {_name(self.hook)}'s future holds {got}; it must "
                             f"hold one tensor of the bucket's {bucket.buffer.numel()} elements")
        if value.data_ptr() != bucket.buffer.data_ptr() or value.dtype != bucket.buffer.dtype:
            bucket.buffer.copy_(value.reshape(-1))


def check_comm_hook(hook: Any) -> None:
    """torch's checks (`DistributedDataParallel._check_comm_hook`), with its exception types; a
    string annotation (`from __future__ import annotations`) is not read. Not its refusal of
    `bf16_compress_hook` without CUDA and NCCL: gloo reduces bfloat16 too."""
    if not callable(hook):
        raise TypeError(f"a communication hook must be callable as hook(state, bucket); got "
                        f"{type(hook).__name__}")
    params = inspect.signature(hook).parameters
    bucket = params["bucket"].annotation if "bucket" in params else inspect.Parameter.empty
    if bucket not in (inspect.Parameter.empty, dist.GradBucket) and not isinstance(bucket, str):
        raise ConfigError(f"communication hook {_name(hook)}: its bucket argument is annotated "
                          f"{bucket!r}; annotate it dist.GradBucket (or not at all)")
    returns = inspect.signature(hook).return_annotation
    if returns not in (inspect.Signature.empty, torch.futures.Future[torch.Tensor]) and not isinstance(returns, str):
        raise ConfigError(f"communication hook {_name(hook)}: its return annotation is {returns!r}; "
                          "annotate it torch.futures.Future[torch.Tensor] (or not at all)")


def _name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__name__
