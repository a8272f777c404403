"""Averaging gradients over a group while backward runs, bucket by bucket: the engine of our DDP
(ddp.py), also used by the replicas of a pipeline stage (pipeline/stage.py). It does what the
reducer of torch's DDP does (torch/csrc/distributed/c10d/reducer.cpp):

    prepare(sync, unused)   before a backward: whether it synchronises, and which parameters are
                            known to get no gradient (DDP finds them from the forward's outputs;
                            None: not known before backward ends)
    hook, per parameter     fires once per backward, after autograd has summed every contribution
                            into p.grad (tied weights included), so p.grad is final: it moves into
                            its bucket, multiplied by 1/N (unless the reduction divides: a comm
                            hook), and a full bucket's reduction starts while backward goes on
    callback, end of backward  queued on the autograd engine by the first hook: waits for every
                            reduction, so `.grad` holds the average when `backward()` returns

A backward that does not synchronise only accumulates, in the buckets, locally. After the first
synchronised backward the buckets are laid out again in the order the gradients arrived (rank 0's
order, broadcast once; see buckets.py), unless unused parameters are allowed or the reduction
forbids it (ZeRO's parameters live in its buckets' layout).

Under DDP's join() (ddp_join.py), a rank that has run out of batches calls `shadow_backward()`
for each synchronised backward of the others: the same collectives, on zeros.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from paratrain.distributed import comm
from paratrain.errors import UsageError
from paratrain.parallel.buckets import UNLIMITED, GradBuckets, Reduction, assign, first_layout


def rebuilds(reduction: Reduction, find_unused: bool) -> bool:
    """Whether the buckets are laid out again in arrival order after the first synchronised
    backward (as torch: a varying graph keeps its layout; ZeRO's parameters live in it)."""
    return reduction.rebuild and not find_unused


def first_grad_layout(params: list[nn.Parameter], caps: list[int], reduction: Reduction,
                      find_unused: bool) -> list[list[nn.Parameter]]:
    """The buckets before any backward: one per kind when they will be rebuilt, else capped."""
    return first_layout(params, UNLIMITED if rebuilds(reduction, find_unused) else caps, reduction.key)


class GradSync:
    """Bucketed, overlapped averaging of `params`' gradients over `group` (module docstring).

    names: each parameter's name, for error messages.
    caps: bucket caps in bytes (bucket i uses caps[min(i, last)]).
    find_unused: parameters may get no gradient in a synchronised backward; then a small
        all-reduce of a used-bitmap settles which hold one anywhere (`_settle_unused`).
    finish_in_backward: wait for the reductions when backward ends (DDP); False: when the caller
        calls `finish()` (a pipeline stage first sends its input's gradient on, then waits).
    """

    def __init__(self, params: list[nn.Parameter], names: dict[nn.Parameter, str], group, *,
                 reduction: Reduction, caps: list[int], find_unused: bool, finish_in_backward: bool = True):
        self.params, self.names, self.group = params, names, group
        self.reduction, self.caps, self.find_unused = reduction, caps, find_unused
        self.finish_in_backward = finish_in_backward
        self.world = dist.get_world_size(group)
        self._rebuild = rebuilds(reduction, find_unused)
        self.buckets = GradBuckets.build(first_grad_layout(params, caps, reduction, find_unused), reduction,
                                         self._scale())
        self._order: list[nn.Parameter] | None = None  # arrival order of the first synchronised backward
        self._sync = False
        self._in_backward = False
        self._unused: list[nn.Parameter] | None = []
        self._ranks_training: Callable[[], int] | None = None
        self._used: torch.Tensor | None = None  # the last all-reduced used-bitmap (find_unused)
        self._marked: set[nn.Parameter] = set()  # parameters counted in the backward in progress
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def prepare(self, sync: bool, unused: list[nn.Parameter] | None = (),
                ranks_training: Callable[[], int] | None = None) -> None:
        """Before a backward: whether it synchronises, and the parameters known not to take part
        (None: find out when backward ends; they count as zero where another rank has one).
        ranks_training: under join(divide_by_initial_world_size=False), how many ranks still train,
        asked once when backward starts; the gradients are averaged over those (torch's reducer
        waits for join's notification there too). None: over the whole group."""
        self.rebuild_if_pending()
        self._sync, self._in_backward = sync, False
        self._unused = None if unused is None else list(unused)
        self._ranks_training = ranks_training

    def set_reduction(self, reduction: Reduction) -> None:
        """Reduce the buckets with `reduction` from the next backward on (DDP.register_comm_hook);
        the layout and any accumulated gradients stay."""
        if self._in_backward:
            raise UsageError("the bucket reduction cannot change during a backward; register the "
                             "communication hook before calling backward")
        self.reduction = reduction
        self.buckets = GradBuckets.build([b.params for b in self.buckets.buckets], reduction, self._scale())

    def _scale(self, ranks: int | None = None) -> float:
        return 1.0 / (ranks or self.world) if self.reduction.prescale else 1.0

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        # fires on the autograd thread, in the middle of backward
        if not self._sync:
            self.buckets.adopt_grad(p)
            return
        if not self._in_backward:
            self._start_backward()
        if p in self._marked:
            raise UsageError(self._arrived_twice(p))
        self._marked.add(p)
        self.buckets.adopt_grad(p, average=True)
        self.buckets.mark_ready(p)

    def _arrived_twice(self, p: nn.Parameter) -> str:
        name = self.names.get(p, "a parameter")
        if any(p is q for q in self._unused or ()):
            return (f"{name} got a gradient in a backward for which find_unused_parameters=True had counted "
                    "it as unused and already sent its zero: the loss reaches it other than through the "
                    "forward's output (an auxiliary loss kept on the module, a block under a reentrant "
                    "torch.utils.checkpoint). Return every tensor the loss uses from forward, use "
                    "torch.utils.checkpoint(..., use_reentrant=False), or set find_unused_parameters=False")
        return (f"{name} got its gradient twice in one backward (a reentrant torch.utils.checkpoint, or "
                "autograd run twice over it), after its bucket may already have been reduced: use "
                "torch.utils.checkpoint(..., use_reentrant=False), or one backward per forward")

    def _start_backward(self) -> None:
        self._in_backward = True
        self._marked = set(self._unused or ())
        self.buckets.reset()
        self.buckets.scale = self._scale(self._ranks_training() if self._ranks_training else None)
        if self.finish_in_backward:
            Variable._execution_engine.queue_callback(self._finish_backward)  # runs once backward ends
        for p in self._unused or ():  # contribute what they hold (zero if nothing) to the average
            self.buckets.adopt_grad(p, average=True, zero_if_missing=True)
            self.buckets.mark_ready(p)

    def finish(self) -> None:
        """End a synchronised backward whose end the caller decides (finish_in_backward=False)."""
        if not self._sync:
            return
        if not self._in_backward:  # no parameter took part in it
            self._start_backward()
        self._finish_backward()
        self._sync = False

    def _finish_backward(self) -> None:
        self._in_backward = False
        missing = self.buckets.missing()
        if missing and self._unused is None:  # not known before backward: they count as zero
            for p in missing:
                self.buckets.adopt_grad(p, average=True, zero_if_missing=True)
                self.buckets.mark_ready(p)
            missing = []
        self.buckets.finish_grad_sync()
        if missing:
            self._refuse_missing(missing)
        if self._rebuild:
            self._order, self._rebuild = list(self.buckets.arrived), False
        if self.find_unused:  # on every rank: which parameters are unused differs
            self._settle_unused()

    def _refuse_missing(self, missing: list[nn.Parameter]) -> None:
        advice = ("they were reached from the model's outputs but not from the loss: use every "
                  "output in the loss" if self.find_unused else self.reduction.unused_advice)
        raise no_gradient_error([self.names.get(p, "?") for p in missing], advice)

    def _settle_unused(self) -> None:
        """A parameter that this rank did not use but another did (in any micro-batch since the
        last sync: then it holds a gradient) gets the average as its gradient; one that no rank
        used keeps None, as in torch, so optimizers skip it exactly as single-process training
        would. Collective: one small all-reduce of a used-bitmap."""
        used = torch.tensor([p.grad is not None for p in self.params], dtype=torch.int32,
                            device=self.params[0].device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.group)
        self._used = used
        for p, anywhere in zip(self.params, used.tolist()):
            if anywhere and p.grad is None:
                bucket, slot = self.buckets.slot_of[p]
                p.grad = bucket.view(slot)

    def shadow_backward(self) -> None:
        """A joined rank's side of the others' synchronised backward (DDP.join; torch:
        `_match_all_reduce_for_bwd_pass`, `_match_unused_params_allreduce`,
        `_push_all_rebuilt_params`): every bucket's reduction in launch order on a zero stand-in,
        the used-bitmap, and, if the layout has not been rebuilt yet, all parameters in
        registration order as this rank's arrival order, so that it takes part in the rebuild
        that the others start at their next forward.

        The bitmap is the last one all-reduced, as torch's joined rank sends its device-side map
        (`_get_local_used_map`), which still holds the last reduced one: a parameter used anywhere
        in its last synchronised backward, or in any shadowed since, counts as used, and where no
        training rank uses it its gradient becomes zeros rather than None. Kept, for torch's bits."""
        for bucket in self.buckets.buckets:
            self.reduction.start(replace(bucket, buffer=torch.zeros_like(bucket.buffer)))
        self.reduction.finish()
        if self.find_unused:
            if self._used is None:
                self._used = torch.zeros(len(self.params), dtype=torch.int32, device=self.params[0].device)
            dist.all_reduce(self._used, op=dist.ReduceOp.MAX, group=self.group)
        if self._rebuild:
            self._order, self._rebuild = list(self.params), False

    def rebuild_if_pending(self) -> None:
        """After the first synchronised backward: lay the buckets out in rank 0's arrival order
        (collective: every rank calls it at the same point of the next iteration)."""
        if self._order is not None:
            self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        """Lay the buckets out in rank 0's arrival order (torch: `Reducer::rebuild_buckets`, which
        also takes rank 0's order: ranks must launch the same buckets)."""
        index = {p: i for i, p in enumerate(self.params)}
        order = torch.tensor([index[p] for p in self._order], dtype=torch.int64,
                             device=self.params[0].device)
        if self.world > 1:
            comm.broadcast(order, 0, self.group)
        self._order = None
        layout = assign([self.params[i] for i in order.tolist()], self.caps, self.reduction.key)
        if all(p.grad is None for p in self.params):  # nothing to carry over (zero_grad(set_to_none)):
            self.buckets = None  # free the old layout first, so memory peaks at one layout, not two
        self.buckets = GradBuckets.build(layout, self.reduction, self._scale())


def no_gradient_error(names: list[str], advice: str) -> UsageError:
    """The error for parameters that got no gradient where the wrapper needs one."""
    return UsageError(f"{len(names)} parameter(s) got no gradient in this backward: {', '.join(names[:10])}; "
                      f"{advice}, or remove them from the model (or set requires_grad=False)")
