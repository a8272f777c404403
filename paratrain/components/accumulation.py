"""Gradient accumulation over micro-batches whose losses are means over different numbers of
tokens: the bookkeeping behind `Session.backward(loss, weight=...)` (see its docstring).

Each micro-batch's loss enters backward as weight · loss (its sum over tokens); at the end of the
accumulation window one all-reduce of the weights gives Σ weight over every micro-batch of every
rank, and the gradients are multiplied by world / Σ weight, so the step's gradient is that of the
mean over every token. Why the world size: the gradients are averaged over the data-parallel
ranks (dp; dp × cp under context parallelism, whose ranks each weigh their share of a sequence,
parallel/context/model.py), and every rank of a tensor-parallel group passes the same weight, so
Σ weight over the world is tp × the tokens: world / Σ weight = dp · cp / tokens in every case.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from paratrain.distributed.comm import group_device
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

    def normaliser(self) -> float:
        """world / (Σ weight over every rank), 1.0 without weights; resets the window. A
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
        return dist.get_world_size() / total if total > 0 else 1.0  # no tokens anywhere: the gradients are 0


class MicroBatch:
    """The context of one micro-batch (Session.accumulation). On an error inside it, the window's
    token weights and losses forget the micro-batch, and `abandoned()` tells the session, so that
    a loop may catch the error and go on with the next batch. A class, not a generator: it is
    entered once per micro-batch."""

    __slots__ = ("last", "weights", "losses", "abandoned", "_weights", "_losses")

    def __init__(self, last: bool, weights: TokenWeights, losses: Any, abandoned: Callable[[], None]):
        self.last, self.weights, self.losses, self.abandoned = last, weights, losses, abandoned
        self._weights, self._losses = (weights.total, weights.weighted, weights.plain), len(losses.items)

    def __enter__(self) -> bool:
        return self.last

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is not None:
            self.abandoned()
            self.weights.total, self.weights.weighted, self.weights.plain = self._weights
            del self.losses.items[self._losses:]
