"""Counting the collectives a piece of code issues through torch.distributed (what paratrain's
tensor-parallel layers call): the bytes-sent checks of tests and benchmarks."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

COLLECTIVES = tuple(name for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                                       "reduce_scatter_tensor", "reduce_scatter_single", "broadcast")
                    if hasattr(dist, name))


@contextlib.contextmanager
def counting_collectives() -> Iterator[list[tuple[str, int]]]:
    """While this lasts, (function, elements of its tensor) of each collective called, in order
    (an all-gather's or reduce-scatter's output tensor, where it comes first)."""
    calls: list[tuple[str, int]] = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(tensor, *args, **kwargs):
            calls.append((name, (tensor if torch.is_tensor(tensor) else args[0]).numel()))
            return originals[name](tensor, *args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
