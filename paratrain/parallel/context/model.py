"""`ContextParallelModel`: each training step on this rank's cut of the sequence (sharding.py),
with attention and positions routed (routing.py); the rest of the protocol is the inner
wrapper's (a data-parallel strategy over dp × cp, or a tensor-parallel model over it).

Per micro-batch (forward_backward):
    1. the sequence length is the inputs' first tensor's dimension 1 (B × S × …); every tensor
       of inputs and targets with that length there is cut (ids, labels, a given position_ids),
       anything else passes whole; a length 2·cp does not divide is refused;
    2. positions: a forward that takes `position_ids` (transformers' models) is given this rank's
       global positions, with an attention_mask of ones beside them (so transformers does not
       take the jumps in the positions for packed sequences and build a mask); otherwise
       torch.arange(local length) answers them inside the step (routing.py);
    3. the labels of a transformers causal LM that computes its own loss are shifted whole
       before the cut (its loss takes `shift_labels=` as they are: the shift inside would pair
       tokens across the cut's seams);
    4. the loss: each rank's is a mean over its own valid tokens (targets not -100), and the
       ranks' gradients are averaged over dp × cp, so each rank's loss is weighed by
       cp · n_rank / n_sequence (one all-reduce of the counts over cp): the average over the cp
       ranks is then the mean over the whole sequence's tokens. With no -100 the weight is 1.

Outside train_step (a plain `model(x)`, evaluation) the model runs whole sequences on each rank,
unrouted: correct, without the memory saving.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from paratrain.data.batch import IGNORE_INDEX, label_shift
from paratrain.distributed.comm import ByteCounter
from paratrain.errors import UsageError
from paratrain.parallel.base import LossFn, ParallelModule, Wrapping, uncompiled
from paratrain.parallel.context import sharding
from paratrain.parallel.context.routing import Cut, routed


class ContextParallelModel(Wrapping):
    """`inner` trained on this rank's cut of each sequence; see the module docstring. The ranks of
    a cp group read the same batches: `replicas` counts dp only."""

    def __init__(self, inner: ParallelModule, group, cp_rank: int, cp: int, *, replicas: int, replica_index: int,
                 mode: str = "ring", arange_positions: bool = True):
        super().__init__(inner, replicas=replicas, replica_index=replica_index)
        self.group, self.cp_rank, self.cp, self.mode = group, cp_rank, cp, mode
        self.counter: ByteCounter | None = None  # set one to count the bytes of K and V the ring sends
        model = uncompiled(self.module)
        parameters = inspect.signature(model.forward).parameters
        self.position_arg = next((n for n in ("position_ids", "positions") if n in parameters), None)
        self.takes_mask = "attention_mask" in parameters
        self.first_arg = next(iter(parameters), None)
        self.arange_positions = arange_positions and self.position_arg is None
        self.shifts_labels = label_shift(model)

    # -- the step ------------------------------------------------------------------------------

    def forward_backward(self, inputs: Any, targets: Any, loss_fn: LossFn, scale: float) -> torch.Tensor:
        length = _sequence_length(inputs)
        sharding.check_length(length, self.cp)
        own_loss = isinstance(inputs, Mapping) and loss_fn == self.default_loss
        inputs, counted = self._cut_inputs(inputs, length, own_loss)
        targets = self._cut(targets, length)
        if not own_loss:
            counted = targets
        share = self._share(counted)
        weighted = loss_fn if share is None else (lambda outputs, y: _weighed(loss_fn(outputs, y), share))
        cut = Cut(self.group, self.cp_rank, self.cp, length, self.mode, self.arange_positions, self.counter)
        with routed(cut):
            return self.inner.forward_backward(inputs, targets, weighted, scale)

    def _cut(self, value: Any, length: int) -> Any:
        if torch.is_tensor(value):
            return sharding.cut(value, self.cp_rank, self.cp) if value.dim() >= 2 and value.shape[1] == length else value
        if isinstance(value, Mapping):
            return {k: self._cut(v, length) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(self._cut(v, length) for v in value)
        return value

    def _cut_inputs(self, inputs: Any, length: int, own_loss: bool) -> tuple[Any, Any]:
        """This rank's inputs, with positions where the forward takes them; and the labels the
        model's own loss is a mean over (None when the loss is loss_fn's)."""
        whole = inputs
        if isinstance(inputs, Mapping):
            inputs = dict(inputs)
            mask = inputs.get("attention_mask")
            if torch.is_tensor(mask) and not bool(mask.all()):
                raise UsageError(f"Mesh(cp={self.cp}) cuts each sequence across ranks, and this batch's attention_mask "
                                 "pads some of them: context parallelism attends causally (or fully) over whole "
                                 "sequences. Pack the batch without padding (labels -100 where the loss must not "
                                 "look), or train without cp")
            counted = None
            if own_loss and torch.is_tensor(inputs.get("labels")):
                counted = self._cut(self._own_loss_labels(inputs), length)
            inputs = self._cut(inputs, length)
        elif torch.is_tensor(inputs) and self.position_arg is not None:
            inputs, counted = {self.first_arg: self._cut(inputs, length)}, None
        else:
            return self._cut(inputs, length), None
        first = _first_tensor(whole)
        if self.position_arg is not None and self.position_arg not in inputs:
            inputs[self.position_arg] = sharding.positions(length, self.cp_rank, self.cp, first.device).expand(
                first.shape[0], -1)
            if self.takes_mask:  # whole (no padding): transformers then reads no packing into the positions
                inputs["attention_mask"] = torch.ones(first.shape[0], length // self.cp, dtype=torch.long,
                                                      device=first.device)
        return inputs, counted

    def _own_loss_labels(self, inputs: dict) -> torch.Tensor:
        """For a causal LM that shifts its labels inside its loss: the shifted labels, whole
        (cut with the rest), passed as shift_labels=; the labels the loss is a mean over."""
        labels = inputs["labels"]
        if self.shifts_labels is None and "input_ids" in inputs and labels.shape == inputs["input_ids"].shape:
            raise UsageError(f"Mesh(cp={self.cp}) cuts the labels with the sequence, and this model computes its own "
                             "loss from labels=, shifting them inside, where the shift would pair tokens across the "
                             "cut: pass loss_fn(outputs, targets) with targets shifted already, or use a transformers "
                             "causal LM (its loss takes shift_labels=)")
        if not self.shifts_labels:
            return labels
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        inputs["shift_labels"] = shifted
        return shifted

    def _share(self, counted: Any) -> torch.Tensor | None:
        """cp · n_rank / n_sequence for the labels `counted` (cut), None for targets that are not
        labels: every rank then holds the same number of items."""
        if not torch.is_tensor(counted) or counted.is_floating_point() or counted.dim() < 2:
            return None
        mine = (counted != IGNORE_INDEX).sum().to(torch.float64)
        total = mine.clone()
        dist.all_reduce(total, group=self.group)
        return mine * self.cp / total.clamp(min=1)

    # -- the rest of the protocol is the inner wrapper's (Wrapping), and so is its check of
    # -- finite reductions: cp holds no parameter shard, each reduction is the whole gradient's

    def reduced_finite(self) -> torch.Tensor | None:
        return self.inner.reduced_finite()

    def watch_reductions(self) -> None:
        self.inner.watch_reductions()


def _weighed(loss: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    return loss * share.to(loss.dtype)


def _first_tensor(inputs: Any) -> torch.Tensor:
    if torch.is_tensor(inputs):
        return inputs
    values = inputs.values() if isinstance(inputs, Mapping) else inputs if isinstance(inputs, (tuple, list)) else ()
    for value in values:
        if torch.is_tensor(value) and value.dim() >= 2:
            return value
    raise UsageError(f"Mesh(cp=...) cuts each batch's sequence (dimension 1 of its first tensor, batch × sequence × "
                     f"…), and these inputs ({type(inputs).__name__}) hold no tensor of two or more dimensions")


def _sequence_length(inputs: Any) -> int:
    return _first_tensor(inputs).shape[1]
