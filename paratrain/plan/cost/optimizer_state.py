"""What an element-wise optimizer keeps per tensor it steps, and what its step makes beyond that
(memory.py counts both for each strategy's rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.errors import ConfigError


@dataclass(frozen=True)
class OptimizerState:
    """What an element-wise optimizer keeps for each tensor it steps."""

    name: str
    per_element: int  # state tensors the size of the stepped tensor, in its dtype (Adam: 2 moments)
    scalar_bytes: int = 0  # per stepped tensor (Adam's `step`: a 0-dim float32 tensor)
    temporaries: int = 0  # tensors the size of a stepped one that its step makes (Adam: √v, then √v/c)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> "OptimizerState":
        """The state of a torch optimizer, by its class and first param group's settings."""
        group = optimizer.param_groups[0]
        if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            return cls(type(optimizer).__name__.lower(), 3 if group.get("amsgrad") else 2, 4, 2)
        if isinstance(optimizer, torch.optim.SGD):
            return OPTIMIZERS["sgd-momentum" if group.get("momentum") else "sgd"]
        raise ConfigError(f"the planner knows the state of Adam, AdamW and SGD; got {type(optimizer).__name__}")

    def bytes(self, stepped: list[tuple[int, torch.dtype]]) -> int:
        """For the tensors it steps, given as (elements, dtype)."""
        return sum(self.per_element * n * dtype.itemsize + self.scalar_bytes for n, dtype in stepped)

    def workspace(self, stepped: list[tuple[int, torch.dtype]], foreach: bool = False) -> int:
        """What its step makes beyond the state, in the order it steps the tensors. torch's
        single-tensor Adam (its default on the CPU) makes `temporaries` tensors the size of the
        one it steps (`denom = (v.sqrt() / c).add_(eps)`), while the previous tensor's `denom`
        is still held; its foreach implementation (the default for CUDA tensors) makes one for
        every stepped tensor at once (`_foreach_sqrt`). Tested against a real step."""
        sizes = [n * dtype.itemsize for n, dtype in stepped]
        if not self.temporaries or not sizes:
            return 0
        if foreach:
            return sum(sizes)
        return max(self.temporaries * size + (sizes[i - 1] if i else 0) for i, size in enumerate(sizes))


OPTIMIZERS = {"adam": OptimizerState("adam", 2, 4, 2), "adamw": OptimizerState("adamw", 2, 4, 2),
              "sgd": OptimizerState("sgd", 0), "sgd-momentum": OptimizerState("sgd-momentum", 1)}
