"""Counting a deep model from shallow copies of it: the probe's shortcut for models built of L
identical blocks (a GPT's, a Llama's decoder layers).

Blocks of one class with parameters of the same shapes and dtypes do the same work and save the
same bytes, so every count the probe makes is `c(L) = c0 + L · c1` in the number of blocks L
(a tensor saved by every block, such as an attention mask, is counted once, in the first).
Two runs, with the stack cut to its first block and to its first two, give c0 and c1:

    c(L) = c(1) + (L − 1) · (c(2) − c(1))

so llama-2-70b's 80 layers cost two fake runs of one and two layers each, not one of 80. The
forward must iterate the stack (`for block in self.layers`, or a slice of it), as models do.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from torch import nn

SHORTEST = 3  # a stack of 2 gains nothing from being cut to 1 and 2


@dataclass(frozen=True)
class Stack:
    """A ModuleList of identical blocks."""

    name: str  # its path in the model
    length: int  # how many blocks it holds

    def block(self, index: int) -> str:
        return f"{self.name}.{index}"


def find_stack(model: nn.Module) -> Stack | None:
    """The longest ModuleList of at least SHORTEST identical blocks (module docstring), if any."""
    found = [Stack(name, len(module)) for name, module in model.named_modules()
             if isinstance(module, nn.ModuleList) and len(module) >= SHORTEST and _identical(module)]
    return max(found, key=lambda stack: stack.length, default=None)


def _identical(blocks: nn.ModuleList) -> bool:
    def shapes(block: nn.Module) -> list:
        return [(name, tuple(p.shape), p.dtype) for name, p in block.named_parameters()]

    first = blocks[0]
    return all(type(b) is type(first) and shapes(b) == shapes(first) for b in blocks)


@contextmanager
def cut(model: nn.Module, stack: Stack, keep: int) -> Iterator[nn.Module]:
    """`model` with the stack holding its first `keep` blocks only, while this lasts."""
    parent_name, _, leaf = stack.name.rpartition(".")
    parent = model.get_submodule(parent_name)
    whole = getattr(parent, leaf)
    setattr(parent, leaf, nn.ModuleList(whole[:keep]))
    try:
        yield model
    finally:
        setattr(parent, leaf, whole)


def extend(one: int, two: int, stack: Stack) -> int:
    """A count for the whole stack from the counts with one block and with two."""
    return one + (stack.length - 1) * (two - one)


def extend_blocks(two: dict[str, int], stack: Stack) -> dict[str, int]:
    """Per-block figures of the run with two blocks, for all of them: the second block stands
    for every later one (the first may hold what all blocks share)."""
    inside = {name: value for name, value in two.items() if name.startswith(stack.name + ".")}
    out = {name: value for name, value in two.items() if name not in inside}
    if not inside:
        return out
    out[stack.block(0)] = two[stack.block(0)]
    out.update({stack.block(i): two[stack.block(1)] for i in range(1, stack.length)})
    return out
