"""Ring attention (parallel/context/ring.py), and the all-to-all and all-gather variants, against
full attention on the gathered sequence:
outputs and the gradients of q, k and v, causal and full, grouped-query heads, at cp 2, 3 and 4,
in float64; and the bytes of K and V each rank sends."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.distributed.comm import ByteCounter
from paratrain.errors import ConfigError
from paratrain.parallel.context import sharding
from paratrain.parallel.context.ring import ring_attention
from paratrain.testing import run_on_ranks

B, H, HKV, D = 2, 4, 2, 8


def inputs(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, length, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, length, D, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(B, H, length, D, generator=g, dtype=torch.float64)


def full(length, causal):
    """One process: SDPA on the whole sequence; output and gradients."""
    q, k, v, grad = (t.requires_grad_(i < 3) for i, t in enumerate(inputs(length)))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def on_ranks(topo, length, causal, mode="ring", fused=True):
    """This rank's cut of every tensor, through `mode`'s attention; the cut results and the bytes
    of K and V sent (0 for all-to-all, which counts none). `fused`: the CPU's flash kernel for each
    ring block, else the math path other devices take."""
    from paratrain.parallel.context import ring
    from paratrain.parallel.context.all_gather import all_gather_attention
    from paratrain.parallel.context.ulysses import all_to_all_attention
    if not fused:
        ring._fused = lambda q: False
    topo.init(timeout=60)
    rank, cp = dist.get_rank(), dist.get_world_size()
    q, k, v, grad = (sharding.cut(t, rank, cp, dim=2).requires_grad_(i < 3) for i, t in enumerate(inputs(length)))
    counter = ByteCounter()
    if mode == "all-to-all":
        out = all_to_all_attention(q, k, v, dist.group.WORLD, causal=causal)
    else:
        attend = ring_attention if mode == "ring" else all_gather_attention
        out = attend(q, k, v, dist.group.WORLD, causal=causal, counter=counter)
    out.backward(grad)
    return [t.detach() for t in (out, q.grad, k.grad, v.grad)], counter.sent


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_ring_attention_equals_full_attention_on_the_gathered_sequence(cp, causal, fused):
    length = 4 * cp * 2
    results = run_on_ranks(on_ranks, cp, length, causal, "ring", fused, timeout=120)
    want = full(length, causal)
    for i, name in enumerate(["output", "dq", "dk", "dv"]):
        got = sharding.restore([r[0][i] for r in results], dim=2)
        assert torch.allclose(got, want[i], atol=1e-6, rtol=0), (name, (got - want[i]).abs().max().item())
    # forward: each rank sends cp−1 blocks of K and V, (cp−1)/cp of their whole size
    whole_kv = 2 * B * HKV * length * D * 8
    assert [sent for _, sent in results] == [whole_kv * (cp - 1) // cp] * cp


def test_the_cut_holds_an_early_chunk_and_its_mirror_and_restores():
    x = torch.arange(16).view(1, 16)
    assert sharding.cut(x, 0, 2).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert sharding.cut(x, 1, 2).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert sharding.positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(sharding.restore([sharding.cut(x, r, 4) for r in range(4)]), x)


def test_a_length_that_cannot_be_cut_is_refused_with_lengths_that_can():
    with pytest.raises(ConfigError, match=r"12 tokens do not divide by 8: make the sequence length a multiple of 8 "
                                          r"\(8 or 16\)"):
        sharding.cut(torch.zeros(1, 12), 0, 4)


@pytest.mark.parametrize("causal", [True, False])
def test_all_to_all_attention_equals_full_attention(causal):
    length = 16
    results = run_on_ranks(on_ranks, 2, length, causal, "all-to-all", timeout=120)
    want = full(length, causal)
    for i, name in enumerate(["output", "dq", "dk", "dv"]):
        got = sharding.restore([r[0][i] for r in results], dim=2)
        assert torch.allclose(got, want[i], atol=1e-6, rtol=0), (name, (got - want[i]).abs().max().item())


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("causal", [True, False])
def test_all_gather_attention_equals_full_attention(cp, causal):
    length = 4 * cp * 2
    results = run_on_ranks(on_ranks, cp, length, causal, "all-gather", timeout=120)
    want = full(length, causal)
    for i, name in enumerate(["output", "dq", "dk", "dv"]):
        got = sharding.restore([r[0][i] for r in results], dim=2)
        assert torch.allclose(got, want[i], atol=1e-6, rtol=0), (name, (got - want[i]).abs().max().item())
    whole_kv = 2 * B * HKV * length * D * 8  # the all-gather sends what the ring does: (cp−1)/cp of K and V
    assert [sent for _, sent in results] == [whole_kv * (cp - 1) // cp] * cp
