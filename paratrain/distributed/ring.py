"""Reference ring all-reduce built from p2p sends only: what `dist.all_reduce` does on a ring, in
a form that can be read and whose bytes can be counted (tests check it equals `dist.all_reduce`
and sends exactly 2(N-1)/N × the size per rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paratrain.distributed.comm import ByteCounter, count_bytes, global_rank, nbytes


def ring_all_reduce(tensor: torch.Tensor, group=None, *, counter: ByteCounter | None = None) -> int:
    """Reference ring all-reduce (SUM, in place) from p2p sends only; returns the bytes sent.

    Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
    workstations". The tensor is flattened, zero-padded to N·c elements and cut into N chunks.
    Rank r sends only to its right neighbour r+1 and receives only from its left neighbour r-1.

    Phase 1, reduce-scatter (N-1 steps): at step s, send chunk (r-s) mod N and add the chunk
    received into chunk (r-s-1) mod N. After it, chunk (r+1) mod N holds the full sum.
    Phase 2, all-gather (N-1 steps): at step s, send chunk (r+1-s) mod N and overwrite chunk
    (r-s) mod N with the one received, so every finished chunk travels once around the ring.

    Each rank sends 2(N-1) chunks: 2(N-1)/N × the padded size, the lower bound for all-reduce.
    """
    n, r = dist.get_world_size(group), dist.get_rank(group)
    chunks = _padded_chunks(tensor, n)  # (n, c)
    right, left = global_rank(group, (r + 1) % n), global_rank(group, (r - 1) % n)
    incoming = torch.empty_like(chunks[0])  # (c,)
    sent = 0
    for s in range(n - 1):
        sent += _exchange(chunks[(r - s) % n], incoming, right, left, group)
        chunks[(r - s - 1) % n] += incoming
    for s in range(n - 1):
        sent += _exchange(chunks[(r + 1 - s) % n], chunks[(r - s) % n], right, left, group)
    tensor.copy_(chunks.view(-1)[: tensor.numel()].view(tensor.shape))
    return count_bytes(counter, sent)


def _padded_chunks(tensor: torch.Tensor, n: int) -> torch.Tensor:
    chunk = -(-tensor.numel() // n)  # ceil: the last chunks are zero padding
    flat = tensor.new_zeros(n * chunk)
    flat[: tensor.numel()] = tensor.reshape(-1)
    return flat.view(n, chunk)


def _exchange(outgoing: torch.Tensor, incoming: torch.Tensor, right: int, left: int, group) -> int:
    # Both posted before either is waited on: every rank sends at once, and a blocking send would
    # wait for a receive its neighbour has not posted yet (torch docs of batch_isend_irecv).
    ops = [dist.P2POp(dist.irecv, incoming, left, group), dist.P2POp(dist.isend, outgoing, right, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return nbytes(outgoing)
