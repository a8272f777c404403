"""All-gather attention: every rank gathers the whole sequence's K and V, and attends its own
queries to them (the variant Llama 3 was trained with: Dubey et al. 2024, §3.3.2; torchtitan's
"allgather" rotation).

    q          (B, H, L, D), L = S/cp this rank's tokens, kept
    k, v       (B, Hkv, L, D) → all-gather over cp: (B, Hkv, S, D), in rank order (each rank's
               cut: its positions are sharding.positions of every rank, concatenated)
    attention  this rank's queries against every key: SDPA with a mask from the global positions
               (causal: key position ≤ query position), or none (full)
    backward   the all-gather's adjoint: a reduce-scatter of dK and dV (comm.all_gather_with_grad)

Each rank receives (cp−1)/cp of K and V in one collective, as the ring does in cp−1 passes, but
holds the whole sequence's K and V at once (the ring holds two blocks), and nothing overlaps the
gather. It needs no head count to divide by cp, and attends with whatever kernel SDPA picks for
a masked call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.debug.flight_recorder import labelled
from paratrain.distributed.comm import ByteCounter, all_gather_with_grad, count_bytes, nbytes
from paratrain.parallel.context import sharding


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool,
                         scale: float | None = None, counter: ByteCounter | None = None) -> torch.Tensor:
    cp, rank, local = dist.get_world_size(group), dist.get_rank(group), q.shape[-2]
    length = local * cp
    with labelled("all-gather attention (cp): K, V"):  # its backward's reduce-scatter runs outside: unlabelled
        keys, values = (all_gather_with_grad(t.contiguous(), group, dim=2) for t in (k, v))  # (B, Hkv, S, D)
    count_bytes(counter, (nbytes(k) + nbytes(v)) * (cp - 1))  # what each rank sends, as the ring counts
    mask = None
    if causal:
        mine = sharding.positions(length, rank, cp, q.device)  # (L,)
        theirs = torch.cat([sharding.positions(length, r, cp, q.device) for r in range(cp)])  # (S,), gathered order
        mask = theirs[None, :] <= mine[:, None]  # (L, S)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != keys.shape[1])
