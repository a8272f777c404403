"""Weights tied across pipeline stages: the token embedding of the first stage that is also the
output head's weight on the last (Press & Wolf 2017; GPT-2).

Each stage that uses the weight holds a copy (they are separate processes). The copies start
equal (broadcast from the lowest stage holding it at setup) and stay equal: after backward, each
copy's gradient is summed over the stages holding it — the weight's gradient is the sum of the
gradients of all its uses, wherever they ran — so every copy takes the same optimizer step.
Megatron-LM does the same over its "embedding group" (the first and last pipeline stages,
`_allreduce_word_embedding_grads`). Summed per replica, after the replicas have averaged their
own gradients: both are linear, so the order does not matter.

A tied weight counts once in the global gradient norm (only its lowest holder adds it), and a
checkpoint stores it once, under its first name in the whole model (stage.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed import comm


def holders(holdings: list[list[nn.Parameter]]) -> dict[int, tuple[int, ...]]:
    """id of each parameter held by several stages → those stages, in order."""
    seen: dict[int, list[int]] = {}
    for stage, params in enumerate(holdings):
        for p in {id(p): p for p in params}.values():
            seen.setdefault(id(p), []).append(stage)
    return {pid: tuple(stages) for pid, stages in seen.items() if len(stages) > 1}


@dataclass
class TiedWeights:
    """The tied parameters one stage holds, and the group of the stages holding each."""

    params: list[nn.Parameter] = field(default_factory=list)
    groups: list[dist.ProcessGroup] = field(default_factory=list)
    counted_here: list[bool] = field(default_factory=list)  # this stage is the lowest holder

    def add(self, p: nn.Parameter, group: dist.ProcessGroup, lowest: bool) -> None:
        self.params.append(p)
        self.groups.append(group)
        self.counted_here.append(lowest)

    @torch.no_grad()
    def broadcast(self) -> None:
        """Start every copy from the lowest holder's values (group rank 0)."""
        for p, group in zip(self.params, self.groups):
            comm.broadcast(p.data, 0, group)

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Sum each copy's gradient over its holders (a missing one counts as zero)."""
        for p, group in zip(self.params, self.groups):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=group)

    def not_counted(self) -> set[int]:
        """ids of the copies whose holder is not the lowest: left out of the gradient norm."""
        return {id(p) for p, here in zip(self.params, self.counted_here) if not here}
