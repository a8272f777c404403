"""What `Session.train_step` accepts as a batch, and what it makes of it.

    (inputs, targets)        with loss_fn(outputs, targets): the plain case
    {"input_ids": …, …}      a dict or transformers' BatchEncoding: the model is called with it as
                             keyword arguments; without loss_fn the model computes its own loss
                             (`outputs.loss`, as transformers' models do when given labels=)

`weight="tokens"` counts the label tokens the loss is a mean over: the targets (or the batch's
"labels") that are not -100, the ignore index of torch's cross_entropy and of transformers.
A causal language model that shifts its labels inside predicts labels[..., 1:] only, so those
are counted when the model computes its own loss (no loss_fn): for a transformers model, when
its class is a causal LM (*ForCausalLM, *LMHeadModel; not *ForTokenClassification or
*ForMaskedLM, whose labels line up with input_ids); for a model of your own, when the batch's
input_ids and labels have the same shape.

Each rank's loss is a mean over its own batch, and the replicas average their gradients (torch's
DDP rule), so ranks given batches of different sizes train a mean of means: a row of a small
batch weighs more than one of a large batch. A batch from session.setup's loader is the same size
on every rank; the first train_step of a Session compares the sizes of hand-fed ones (one
all-gather of an integer, once) and warns on rank 0, naming them and `weight=`, which weighs every
row alike (`uneven_warning`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from paratrain.distributed import comm
from paratrain.errors import UsageError

IGNORE_INDEX = -100

LossFn = Callable[[Any, Any], torch.Tensor]


def unpack(batch: Any, loss_fn: LossFn | None, weight: Any,
           shifts_labels: bool | None = None) -> tuple[Any, Any, LossFn | None, Any]:
    """(inputs, targets, loss_fn or None for the model's own loss, weight) of one batch.
    `shifts_labels`: whether the model's own loss predicts labels[..., 1:] (label_shift); None:
    judged by the batch's shapes."""
    if isinstance(batch, Mapping):
        targets = batch.get("labels")
        if loss_fn is not None and targets is None:
            raise UsageError(f"a dict batch gives loss_fn(outputs, targets) its 'labels' as the targets, and this "
                             f"one has none (keys {sorted(batch)}); add them, or leave loss_fn out for a model "
                             "that computes its own loss")
        if weight == "tokens":
            causal = _causal_lm(batch) if shifts_labels is None else shifts_labels
            weight = _tokens(targets, shifted=loss_fn is None and causal)
        return batch, targets, loss_fn, weight
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise UsageError(f"train_step takes batch = (inputs, targets), or a dict of model inputs; got a "
                         f"{type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. "
                         "For other batches write the step: `with session.accumulation(): loss = ...; "
                         "session.backward(loss)`, then `session.step()`")
    if loss_fn is None:
        raise UsageError("train_step((inputs, targets)) needs loss_fn(outputs, targets); only a dict batch "
                         "(a model that computes its own loss from labels=) may leave it out")
    inputs, targets = batch
    return inputs, targets, loss_fn, _tokens(targets, shifted=False) if weight == "tokens" else weight


def label_shift(model: Any) -> bool | None:
    """Whether a transformers model's own loss shifts its labels (a causal LM), by its class;
    None for any other model (the batch's shapes then say)."""
    kind = type(model)
    if not kind.__module__.startswith("transformers."):
        return None
    return kind.__name__.endswith(("ForCausalLM", "LMHeadModel"))


def _causal_lm(batch: Mapping) -> bool:
    ids, labels = batch.get("input_ids"), batch.get("labels")
    return torch.is_tensor(ids) and torch.is_tensor(labels) and ids.shape == labels.shape


def _tokens(targets: Any, shifted: bool) -> torch.Tensor:
    if not torch.is_tensor(targets):
        raise UsageError("weight='tokens' counts label tokens, and this batch has no tensor of labels "
                         "(targets, or a dict's 'labels'); pass the count itself as weight=")
    counted = targets[..., 1:] if shifted else targets
    return (counted != IGNORE_INDEX).sum()


class UnevenBatchWarning(UserWarning):
    """The ranks were given batches of different sizes: the step trains a mean of means."""


def uneven_warning(rows: int) -> str | None:
    """What to say when the ranks' batches (`rows` samples on this rank) differ in size; None when
    they agree. A collective over every rank."""
    sizes = [int(n) for n in comm.all_gather(torch.tensor(rows, device=comm.group_device()))]
    if len(set(sizes)) == 1:
        return None
    by_size = {n: [r for r, m in enumerate(sizes) if m == n] for n in sorted(set(sizes), reverse=True)}
    listed = "; ".join(f"{n} rows on rank{'s' if len(ranks) > 1 else ''} {_few(ranks)}" for n, ranks in by_size.items())
    return (f"the ranks were given batches of different sizes ({listed}). Each rank's loss is the mean over its own "
            f"batch and the replicas average those means, so a row of a {min(sizes)}-row batch weighs "
            f"{max(sizes) / max(min(sizes), 1):.1f}x as much as a row of a {max(sizes)}-row batch: not the mean over "
            f"all {sum(sizes)} rows one process would take. Pass train_step(batch, loss_fn, weight=<the batch's row "
            "count>) on every rank to weigh every row alike, or give every rank batches of one size "
            "(session.setup's loader does)")


def _few(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
