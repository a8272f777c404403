"""Gradient accumulation over micro-batches whose losses are means over different numbers of
tokens: the bookkeeping behind `Session.backward(loss, weight=...)` (see its docstring).

Each micro-batch's loss enters backward as weight · loss (its sum over tokens); at the end of the
accumulation window one all-reduce of the weights gives Σ weight over every micro-batch of every
rank, and the gradients are multiplied by replicas / Σ weight (replicas undoing the data-parallel
mean), so the step's gradient is that of the mean over every token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.comm import group_device
from paratrain.errors import UsageError


class TokenWeights:
    """The token weights (`backward(loss, weight=...)`) of one accumulation window."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.total, self.weighted, self.plain = 0.0, 0, 0

    def add(self, weight: float | torch.Tensor | None, accumulate: int) -> float:
        if weight is None:
            self.plain += 1
            return 1 / accumulate
        self.total += float(weight)
        self.weighted += 1
        return float(weight)

    def normaliser(self, replicas: int) -> float:
        """replicas / (Σ weight over every rank), 1.0 without weights; resets the window. A
        collective when weights were given (every rank gives them)."""
        weighted, plain, total = self.weighted, self.plain, self.total
        self.reset()
        if not weighted:
            return 1.0
        if plain:
            raise UsageError(f"{weighted} micro-batch(es) of this optimizer step passed weight= and "
                             f"{plain} did not; pass it on every micro-batch (or on none)")
        total_t = torch.tensor(total, dtype=torch.float64, device=group_device())
        dist.all_reduce(total_t)
        total = total_t.item()
        return replicas / total if total > 0 else 1.0  # no tokens anywhere: the gradients are 0
