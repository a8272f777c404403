"""A batch cut into micro-batches: each tensor of it (a tensor, or a tuple / dict of them) along
dim 0, and the key that names a micro-batch's shapes (p2p.py agrees shapes once per key)."""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from paratrain.errors import ConfigError, UsageError


def chunks(batch: Any, m: int, exact: bool = True) -> list[Any]:
    """`batch` as m micro-batches along dim 0 (exact: equal ones; else the last may be shorter)."""
    leaves, spec = tree_flatten(batch)
    if not leaves or not all(torch.is_tensor(t) and t.dim() > 0 for t in leaves):
        raise UsageError("a pipeline step takes inputs and targets that are tensors, or tuples / dicts of "
                         f"tensors, cut into micro-batches along dim 0; got {type(batch).__name__}")
    rows = {t.shape[0] for t in leaves}
    if len(rows) > 1:
        raise UsageError(f"every tensor of a pipeline batch is cut along dim 0, so they must share its "
                         f"size; got sizes {sorted(rows)}")
    if exact and rows.pop() % m:
        raise ConfigError(f"{m} micro-batches do not divide this stage's batch of {leaves[0].shape[0]} "
                          f"samples: use a per-replica batch that is a multiple of {m}, "
                          "or change Pipeline(microbatches=...)")
    pieces = [t.chunk(m) for t in leaves]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(len(pieces[0]))]


def shape_key(micro_batch: Any) -> Hashable:
    """What identifies a micro-batch's shapes: its leaves' shapes, in order."""
    return tuple(tuple(t.shape) for t in tree_flatten(micro_batch)[0])
