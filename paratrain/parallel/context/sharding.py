"""Which tokens of a sequence each rank of a cp group holds: the load-balanced causal cut.

Under causal attention the k-th token attends to k tokens, so cutting a sequence into cp
contiguous parts gives the last rank cp times the first one's work. Instead the sequence is cut
into 2·cp chunks and rank r holds chunks r and 2·cp−1−r: an early chunk and its mirror, the same
work on every rank (Megatron-core's and torch's `context_parallel` "head-tail" cut; Brandon et
al. 2023, "Striped attention", discuss the alternatives).

    cp = 2, a sequence of 8 tokens, chunks of 2:   [0 1 | 2 3 | 4 5 | 6 7]
    rank 0 holds chunks 0 and 3:  tokens 0 1 6 7
    rank 1 holds chunks 1 and 2:  tokens 2 3 4 5

The same cut applies to inputs, labels and positions, along dimension 1 (batch × sequence × …).
"""

from __future__ import annotations

import torch

from paratrain.errors import ConfigError


def chunks_of(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def check_length(length: int, cp: int) -> None:
    if length % (2 * cp):
        lower, upper = length // (2 * cp) * 2 * cp, -(-length // (2 * cp)) * 2 * cp
        raise ConfigError(
            f"Mesh(cp={cp}) cuts each sequence into 2·cp = {2 * cp} equal chunks (two per rank, for equal "
            f"causal work), and {length} tokens do not divide by {2 * cp}: make the sequence length a multiple "
            f"of {2 * cp} ({lower or 2 * cp} or {upper}), padding with labels of -100, which the loss ignores")


def positions(length: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The global positions of the tokens rank `rank` holds of a sequence of `length`."""
    check_length(length, cp)
    chunk = length // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunks_of(rank, cp)])


def cut(tensor: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `tensor` along `dim` (a copy, contiguous)."""
    check_length(tensor.shape[dim], cp)
    pieces = tensor.chunk(2 * cp, dim=dim)
    return torch.cat([pieces[c] for c in chunks_of(rank, cp)], dim=dim)


def restore(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `cut` (rank order): the inverse of cut."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = chunks_of(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)
