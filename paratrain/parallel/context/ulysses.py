"""All-to-all attention (DeepSpeed-Ulysses: Jacobs et al. 2023): the heads scattered, the
sequence gathered, attention whole, and back.

    q, k, v   (B, H, L, D), L = S/cp this rank's tokens
      → all-to-all: rank j gets head group j of every rank's tokens: (B, H/cp, S, D),
        put back in sequence order (the cut is not contiguous: sharding.restore)
      → attention over the whole sequence for H/cp heads (torch's SDPA, causal or full)
      → all-to-all back: (B, H, L, D)

Four all-to-alls per layer (q, k, v forward; the output), each sending (cp−1)/cp of its tensor,
against ring attention's cp−1 block passes; it needs the query and key-value heads to divide by
cp, and attends with whatever kernel SDPA picks. The all-to-all's backward is the reverse
all-to-all (it permutes elements, so its adjoint is its inverse).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.debug.flight_recorder import labelled
from paratrain.errors import ConfigError
from paratrain.parallel.context import sharding


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool,
                         scale: float | None = None) -> torch.Tensor:
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ConfigError(f"Mesh(cp={cp}, cp_mode='all-to-all') scatters the attention heads over the cp ranks, and "
                          f"{q.shape[1]} query heads / {k.shape[1]} key-value heads do not divide by {cp}: use "
                          "cp_mode='ring', or a cp that divides both")
    q, k, v = (_Scatter.apply(t, group) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return _Gather.apply(out, group)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(B, H, L, D) this rank's tokens → (B, H/cp, S, D) this rank's heads, in sequence order."""
    cp, b, h, length, d = dist.get_world_size(group), *x.shape
    send = x.reshape(b, cp, h // cp, length, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    with labelled("all-to-all attention (cp): heads to sequence"):
        dist.all_to_all_single(received, send, group=group)
    return sharding.restore(list(received.unbind(0)), dim=2)


def sequence_to_heads(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse of heads_to_sequence."""
    cp = dist.get_world_size(group)
    send = torch.stack([sharding.cut(y, j, cp, dim=2) for j in range(cp)]).contiguous()
    received = torch.empty_like(send)
    with labelled("all-to-all attention (cp): sequence to heads"):
        dist.all_to_all_single(received, send, group=group)
    b, length, d = received.shape[1], received.shape[3], received.shape[4]
    return received.transpose(0, 1).reshape(b, -1, length, d)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return sequence_to_heads(grad.contiguous(), ctx.group), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return sequence_to_heads(y.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_sequence(grad.contiguous(), ctx.group), None
