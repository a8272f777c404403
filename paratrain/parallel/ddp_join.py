"""Uneven inputs for our DDP: `ddp.join()`, torch's Join / Joinable protocol
(torch.distributed.algorithms.join), done as torch's DDP does it (torch/nn/parallel/distributed.py
`_DDPJoinHook`, `_pre_forward`, `_check_global_requires_backward_grad_sync`,
`_match_all_reduce_for_bwd_pass`, `_find_common_rank`, `_sync_final_model`).

Inside `with ddp.join():` a rank that runs out of batches leaves its loop and enters Join's exit,
which runs `main_hook` once for each iteration the other ranks still train. Every collective of a
training rank's iteration meets its twin on the joined rank, in the same order:

    training rank (DDP.forward, then backward)       joined rank (Join.__exit__, main_hook)
    Join.notify_join_context: all-reduce of 1        Join: all-reduce of 0 (how many still train?)
    [throw_on_early_termination: all-reduce, 0]      [Join: all-reduce of 1, then raise]
    buffers: all-reduce MAX of its rank, then        all-reduce MAX of -1, then receive the
      broadcast from the highest training rank         buffers (rank 0 may have joined long ago)
    sync flag: all-reduce of 1 (0 under no_sync)     all-reduce of 0: does this backward sync?
    bucket rebuild, once, at the forward after       the same rebuild (GradSync.rebuild_if_pending)
      the first synchronised backward
    backward: each bucket's reduction, in order      GradSync.shadow_backward: each bucket's
    [find_unused: the used-bitmap all-reduce]          reduction on zeros, a bitmap of zeros

A rank that joins before the first synchronised backward takes all parameters, in registration
order, as its arrival order (torch: `_push_all_rebuilt_params`), so it takes part in the rebuild,
which then follows rank 0's order as always. When every rank has joined, `post_hook` broadcasts the
parameters and buffers of the last rank to join (the highest, if several) to all.

Gradients: a joined rank contributes zeros. With divide_by_initial_world_size=True every rank still
divides by N, so each sample weighs the same; with False, by the number of ranks still training,
the count that the notify all-reduce returns (as torch's reducer, waited when backward starts). A
communication hook divides by itself, as under torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from paratrain.distributed.comm import broadcast_coalesced
from paratrain.errors import CommError
from paratrain.parallel.grad_sync import GradSync

if TYPE_CHECKING:  # annotations only: ddp.py imports this file
    from paratrain.parallel.ddp import DistributedDataParallel


class DDPJoinHook(JoinHook):
    """A joined rank's side of the others' iterations (module docstring); `grad_sync` is `ddp`'s
    reducer."""

    def __init__(self, ddp: DistributedDataParallel, grad_sync: GradSync):
        super().__init__()
        self.ddp, self.grad_sync = ddp, grad_sync

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp.will_sync_module_buffers():
            ddp.sync_module_buffers(authoritative_rank(ddp, candidate=False))
        sync = _sync_flag(ddp, joined=True)
        ddp.require_forward_param_sync = sync  # as after a forward of that kind
        self.grad_sync.rebuild_if_pending()
        if sync:
            self.grad_sync.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        src = authoritative_rank(ddp, candidate=is_last_joiner)
        broadcast_coalesced(list(ddp.module.parameters()), ddp.process_group, src)
        if ddp.broadcast_buffers and ddp.modules_buffers:
            ddp.sync_module_buffers(src)


def training_rank_collectives(ddp: DistributedDataParallel, notified: dist.Work | None,
                              divide_by_initial_world_size: bool) -> Callable[[], int] | None:
    """A training rank's forward inside join(), after `Join.notify_join_context` (whose all-reduce
    is `notified`): the buffer broadcast from the highest training rank and the sync flag. Returns
    how to count the ranks still training when gradients are to be divided by that count."""
    if ddp.will_sync_module_buffers():
        ddp.sync_module_buffers(authoritative_rank(ddp, candidate=True))
    _sync_flag(ddp, joined=False)
    if notified is None or divide_by_initial_world_size:
        return None
    return lambda: int(_value(notified).item())


def authoritative_rank(ddp: DistributedDataParallel, *, candidate: bool) -> int:
    """The highest rank of the group for which `candidate` holds (torch `_find_common_rank`)."""
    rank = torch.tensor([ddp.replica_index if candidate else -1], device=ddp.join_device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=ddp.process_group)
    if rank.item() < 0:
        raise CommError("join(): no rank offered itself as the source of the model's state; the "
                        "ranks disagree about who has joined (a collective outside DDP inside "
                        "join() needs throw_on_early_termination=True)")
    return int(rank.item())


def _sync_flag(ddp: DistributedDataParallel, *, joined: bool) -> bool:
    """torch `_check_global_requires_backward_grad_sync`: a training rank sends 1 if its backward
    synchronises (0 under no_sync) and does not wait; a joined rank sends 0 and learns whether
    the others' backward synchronises."""
    send = not joined and ddp.require_backward_grad_sync
    tensor = (torch.ones if send else torch.zeros)(1, device=ddp.join_device)
    work = dist.all_reduce(tensor, group=ddp.process_group, async_op=True)
    if not joined:
        return send
    work.wait()
    return tensor.item() != 0


def _value(work: dist.Work) -> torch.Tensor:
    work.wait()
    return work.get_future().value()[0]
