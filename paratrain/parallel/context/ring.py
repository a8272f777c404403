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

Causal attention needs no mask of global positions: with the head-tail cut (rank r holds chunks
r and 2·cp−1−r) each block is one of three shapes (`_block`), as in Megatron-core and torch's
`context_parallel`:

    its own block           causal in local order (a rank's positions increase along its tokens)
    a lower rank's block    every query sees the block's first chunk, none its second
    a higher rank's block   the second chunk of queries sees the whole block, the first nothing

So every block is plain causal or full attention on slices, which a fused kernel computes with
its log-sum-exp: on the CPU torch's flash attention kernel (aten's
_scaled_dot_product_flash_attention_for_cpu, and its backward, which recomputes the block's
probabilities from the final output and log-sum-exp); elsewhere the math path below, which keeps
L×L scores of one block at a time. Both in at least float32 (float64 stays float64).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from paratrain.debug.flight_recorder import labelled
from paratrain.distributed.comm import ByteCounter, count_bytes, global_rank, nbytes

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
        with labelled(f"ring attention (cp): {'K, V' if tag == KV_TAG else 'the gradient of K, V'}"):
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
        qa = q.to(acc)
        kv = torch.stack((k, v))  # one message per step
        out = torch.zeros_like(qa)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            incoming = ring.pass_on(kv, KV_TAG, counter) if step < ring.size - 1 else None
            rows, keys, is_causal = _block(ring.rank, owner, q.shape[2], causal)
            block_out, block_lse = _attend(qa[:, :, rows], _heads(kv[0], q)[:, :, keys].to(acc),
                                           _heads(kv[1], q)[:, :, keys].to(acc), scale, is_causal)
            out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
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
        grad_out = grad_out.to(acc)
        qa = q.to(acc)
        grad_q = torch.zeros_like(qa)
        kv = torch.stack((k, v))
        passing = None  # the accumulator of the gradient of the K, V block held now, in flight to here
        for step in range(ring.size):
            owner = (ring.rank - step) % ring.size
            incoming = ring.pass_on(kv, KV_TAG) if step < ring.size - 1 else None
            rows, keys, is_causal = _block(ring.rank, owner, q.shape[2], ctx.causal)
            dq, dk, dv = _attend_backward(qa[:, :, rows], _heads(kv[0], q)[:, :, keys].to(acc),
                                          _heads(kv[1], q)[:, :, keys].to(acc), grad_out[:, :, rows],
                                          out[:, :, rows], lse[:, :, rows], ctx.scale, is_causal)
            grad_q[:, :, rows] += dq
            grad_kv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
            grad_kv[0][:, :, keys], grad_kv[1][:, :, keys] = _kv_heads(dk, k), _kv_heads(dv, k)
            if passing is not None:
                grad_kv += passing.wait()  # what the ranks before added to this block's gradient
            passing = ring.pass_on(grad_kv, GRAD_TAG) if ring.size > 1 else None
            if incoming is not None:
                kv = incoming.wait()
        if passing is not None:
            grad_kv = passing.wait()  # this rank's own block, with every rank's share
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None, None, None


ALL = slice(None)


def _block(rank: int, owner: int, local: int, causal: bool) -> tuple[slice, slice, bool]:
    """(this rank's queries, the keys of `owner`'s block they see, whether causally): see the
    module docstring. Each half of a rank's tokens is one chunk of the cut (sharding.chunks_of)."""
    half = local // 2
    if not causal or owner == rank:
        return ALL, ALL, causal
    return (ALL, slice(0, half), False) if owner < rank else (slice(half, None), ALL, False)


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


def _fused(q: torch.Tensor) -> bool:
    """torch's CPU flash attention kernel takes these (and returns the log-sum-exp)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64)


def _attend(q, k, v, scale, causal):
    """(softmax(q kᵀ · scale) v, the log-sum-exp of each query's scores), causal in local order or full."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def _attend_backward(q, k, v, grad_out, out, lse, scale, causal):
    """dq, dk, dv of one block, its probabilities recomputed from the final output and log-sum-exp
    (those of the whole sequence's attention: the block's share of each query's softmax)."""
    if _fused(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(),
            0.0, causal, scale=scale)
    delta = (grad_out * out).sum(-1)  # rowsum(dO ∘ O): the softmax's backward (flash attention)
    probs = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))
    grad_v = probs.transpose(-2, -1) @ grad_out
    grad_scores = probs * (grad_out @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return grad_scores @ k * scale, grad_scores.transpose(-2, -1) @ q * scale, grad_v


def _scores(q, k, scale, causal):
    scores = (q @ k.transpose(-2, -1)) * scale
    if not causal:
        return scores
    seen = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~seen, float("-inf"))


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions over disjoint keys as one: each weighed by its share of the sum of
    exponentials, exp(lse_part − lse_both) (a part that saw no key yet has lse −inf: weight 0)."""
    both = torch.logaddexp(lse, block_lse).unsqueeze(-1)
    return out * torch.exp(lse.unsqueeze(-1) - both) + block_out * torch.exp(block_lse.unsqueeze(-1) - both), both[..., 0]
