"""Ring attention: attention over a sequence cut across a cp group (sharding.py), its K and V
passed around the ring while each rank attends with the block it holds.

Liu, Zaharia & Abbeel 2023, "Ring attention with blockwise transformers"; the merge of partial
results by their log-sum-exp is flash attention's (Dao et al. 2022, §3.1). Step s of the cp
steps, on rank r of the ring:

    forward   attend with the K, V of rank r−s (its own at s = 0): a block output and the
              log-sum-exp of its scores, merged into the running ones; meanwhile the block is
              passed on to r+1 and the next one arrives from r−1 (posted before the compute, so
              the transfer overlaps it). Each rank sends cp−1 blocks: (cp−1)/cp of K and V.
    backward  its own ring: the K, V blocks travel again, and beside them an accumulator of
              their gradient, which each rank adds its share to before passing it on; after
              cp steps every accumulator is back at its owner. Scores are recomputed from the
              saved log-sum-exp (nothing of size L×L is kept between forward and backward), so
              the memory kept per rank is that of q, k, v and the output: 1/cp of the whole.

Causal attention masks by global positions (the cut is not contiguous): a block whose keys all
come after the queries is skipped, one whose keys all come before is computed unmasked. The
block arithmetic is the math path in at least float32 (float64 stays float64): exact and
readable, and the same on every device.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from paratrain.distributed.comm import ByteCounter, count_bytes, global_rank, nbytes
from paratrain.parallel.context import sharding

KV_TAG, GRAD_TAG = 1, 2  # the two kinds of message of one ring, kept apart on gloo (NCCL orders by issue)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, causal: bool,
                   scale: float | None = None, counter: ByteCounter | None = None) -> torch.Tensor:
    """Attention of this rank's queries (B, H, L, D) over the whole sequence, whose keys and
    values (B, Hkv, L, D; Hkv dividing H, as grouped-query attention) are cut over `group` as
    sharding.cut cuts them. Differentiable in q, k and v. `counter` adds the bytes of K and V
    this rank sends forward."""
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ValueError(f"ring attention takes q (B, H, L, D) and k, v (B, Hkv, L, D) with Hkv dividing H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, group, causal, scale, counter)


class _Ring:
    """This rank's neighbours on the cp ring, and the exchange of one block with them."""

    def __init__(self, group):
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.right = global_rank(group, (self.rank + 1) % self.size)
        self.left = global_rank(group, (self.rank - 1) % self.size)

    def pass_on(self, tensor: torch.Tensor, tag: int, counter: ByteCounter | None = None) -> "_Incoming":
        """Send `tensor` right and receive its like from the left; wait on the result."""
        incoming = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.right, self.group, tag),
               dist.P2POp(dist.irecv, incoming, self.left, self.group, tag)]
        count_bytes(counter, nbytes(tensor))
        return _Incoming(incoming, dist.batch_isend_irecv(ops))


class _Incoming:
    def __init__(self, tensor: torch.Tensor, works: list):
        self.tensor, self.works = tensor, works

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.tensor


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, counter):
        ring = _Ring(group)
        acc = torch.promote_types(q.dtype, torch.float32)
        masks = _Masks(q.shape[2], ring, causal, q.device)
        kv = torch.stack((k, v))  # one message per step
        out = lse = None
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            incoming = ring.pass_on(kv, KV_TAG, counter) if step < ring.size - 1 else None
            mask = masks.of(owner)
            if mask is not False:
                block_out, block_lse = _attend(q.to(acc), _heads(kv[0], q).to(acc), _heads(kv[1], q).to(acc),
                                               scale, mask)
                out, lse = (block_out, block_lse) if out is None else _merge(out, lse, block_out, block_lse)
            if incoming is not None:
                kv = incoming.wait()
        # laid out (B, L, H, D) in memory as flash attention's output is: the model's
        # out.transpose(1, 2).reshape(B, L, H·D) is then a view, and autograd keeps one copy of it
        out = out.transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        acc = out.dtype
        masks = _Masks(q.shape[2], ring, ctx.causal, q.device)
        grad_out = grad_out.to(acc)
        qa = q.to(acc)
        delta = (grad_out * out).sum(-1)  # rowsum(dO ∘ O): the softmax's backward (flash attention)
        grad_q = torch.zeros_like(qa)
        kv = torch.stack((k, v))
        passing = None  # the accumulator of the gradient of the K, V block held now, in flight to here
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            incoming = ring.pass_on(kv, KV_TAG) if step < ring.size - 1 else None
            grad_kv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            mask = masks.of(owner)
            if mask is not False:
                dq, dk, dv = _attend_backward(qa, _heads(kv[0], q).to(acc), _heads(kv[1], q).to(acc), grad_out,
                                              lse, delta, ctx.scale, mask)
                grad_q += dq
                grad_kv[0], grad_kv[1] = _kv_heads(dk, k), _kv_heads(dv, k)
            if passing is not None:
                grad_kv += passing.wait()  # what the ranks before added to this block's gradient
            passing = ring.pass_on(grad_kv, GRAD_TAG) if ring.size > 1 else None
            if incoming is not None:
                kv = incoming.wait()
        if passing is not None:
            grad_kv = passing.wait()  # this rank's own block, with every rank's share
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


class _Masks:
    """Which of this rank's queries may see which keys of the block a rank owns: None (all),
    False (none: the block is skipped) or a (L, L) boolean mask, by global positions."""

    def __init__(self, local: int, ring: _Ring, causal: bool, device):
        self.causal, self.size, self.local, self.device = causal, ring.size, local, device
        self.queries = sharding.positions(local * ring.size, ring.rank, ring.size, device)

    def of(self, owner: int) -> torch.Tensor | bool | None:
        if not self.causal:
            return None
        keys = sharding.positions(self.local * self.size, owner, self.size, self.device)
        mask = keys[None, :] <= self.queries[:, None]
        return None if bool(mask.all()) else False if not bool(mask.any()) else mask


def _heads(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """K or V with each head repeated for the query heads that share it (grouped-query attention:
    query head h reads kv head h // (H / Hkv), as torch's SDPA with enable_gqa=True)."""
    groups = q.shape[1] // kv.shape[1]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _kv_heads(grad: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The gradient of the repeated heads summed back onto the kv heads they came from."""
    b, h, length, d = grad.shape
    groups = h // kv.shape[1]
    return grad if groups == 1 else grad.view(b, kv.shape[1], groups, length, d).sum(2)


def _attend(q, k, v, scale, mask):
    """(softmax(q kᵀ · scale) v, the log-sum-exp of each query's scores); a query that sees no key
    gets a zero output and a log-sum-exp of −inf, which the merge weighs by zero."""
    scores = _scores(q, k, scale, mask)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - _finite(lse).unsqueeze(-1))
    return probs @ v, lse


def _attend_backward(q, k, v, grad_out, lse, delta, scale, mask):
    """dq, dk, dv of one block, its probabilities recomputed from the final log-sum-exp."""
    probs = torch.exp(_scores(q, k, scale, mask) - _finite(lse).unsqueeze(-1))
    grad_v = probs.transpose(-2, -1) @ grad_out
    grad_scores = probs * (grad_out @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, grad_v


def _scores(q, k, scale, mask):
    scores = (q @ k.transpose(-2, -1)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint keys as one: each weighed by its share of the sum of
    exponentials, exp(lse_part − lse_both)."""
    both = torch.logaddexp(lse, block_lse)
    safe = _finite(both).unsqueeze(-1)
    return out * torch.exp(lse.unsqueeze(-1) - safe) + block_out * torch.exp(block_lse.unsqueeze(-1) - safe), both


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
