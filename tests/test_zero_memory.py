"""Bytes each rank holds under ZeRO, counted from the live tensors, against the paper's formulas
(Rajbhandari et al. 2020, Figure 1: fp32 Adam, K = 12 bytes of optimizer state per parameter)."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.testing import run_on_ranks

WIDTH, LAYERS = 63, 8  # sizes not divisible by 2 or 4: padding is counted too


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _live_storages() -> dict[int, int]:
    """Every tensor storage reachable from Python: data pointer → bytes."""
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.nbytes():
                out[storage.data_ptr()] = storage.nbytes()
    return out


def _bytes_after_step(topo, stage, param_dtype=None):
    x = torch.randn(8, WIDTH)
    before = _live_storages()  # the batch, and anything the harness holds
    model = _model()
    policy = pt.WrapPolicy(module_classes=(nn.Linear,))
    model, opt = pt.shard(model, torch.optim.Adam(model.parameters(), lr=1e-3), stage=stage,
                          wrap_policy=policy, param_dtype=param_dtype)
    F.mse_loss(model(x), x).backward()
    opt.step()  # held now: parameters, gradients and optimizer state (before zero_grad)
    held = sum(n for ptr, n in _live_storages().items() if ptr not in before)
    peak = model.peak_gathered_bytes if stage == 3 else 0
    unit = max((f.full_bytes for u in model.units for f in u.flats), default=0) if stage == 3 else 0
    return held, peak, unit


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_rank_match_the_zero_formulas(world):
    psi = sum(p.numel() for p in _model().parameters())
    formula = {1: 4 * psi + 4 * psi + 8 * psi / world, 2: 4 * psi + 12 * psi / world, 3: 16 * psi / world}
    for stage in (1, 2, 3):
        for held, peak, unit in run_on_ranks(_bytes_after_step, world, stage):
            assert formula[stage] <= held <= 1.05 * formula[stage], (stage, held, formula[stage])
            if stage == 3:  # transient: never more than two units gathered at once
                assert unit > 0 and peak <= 2 * unit, (peak, unit)


@pytest.mark.parametrize("world", [2, 3])
def test_bytes_per_rank_with_bf16_compute_and_fp32_masters(world):
    """bf16 parameters and gradients where the model computes; fp32 master shards, their fp32
    gradients and Adam's two moments sharded (stage12.py, [Note: master shards])."""
    psi = sum(p.numel() for p in _model().parameters())
    formula = {1: 2 * psi + 2 * psi + 16 * psi / world, 2: 2 * psi + 18 * psi / world, 3: 16 * psi / world}
    for stage in (1, 2, 3):
        for held, _, _ in run_on_ranks(_bytes_after_step, world, stage, torch.bfloat16):
            assert formula[stage] <= held <= 1.05 * formula[stage], (stage, held, formula[stage])


VOCAB, EMBED = 8192, 512  # a 16 MiB embedding, tied to the head


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, EMBED)
        self.mid = nn.Linear(EMBED, EMBED)
        self.head = nn.Linear(EMBED, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


def _backward_peak_mib(topo):
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from common import peak_rss_mb, reset_peak_rss, return_freed_memory_to_os, rss_mb

    return_freed_memory_to_os()  # freed blocks leave RSS at once: the peak is the live tensors'
    torch.manual_seed(0)
    model = _TiedLM()
    model, _ = pt.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                        wrap_policy=pt.WrapPolicy(module_classes=(nn.Linear,)))
    tokens = torch.randint(0, VOCAB, (2, 8))
    for _ in range(2):  # the second backward, when every lazily made buffer exists
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        start = rss_mb()
        reset_peak_rss()
        loss.backward()
        peak = peak_rss_mb() - start
        model.zero_grad()
    return peak


def test_a_tied_weight_gradient_is_accumulated_in_place_not_held_twice():
    """The root unit holds the embedding, whose gradient comes from the head at the start of
    backward and from the embedding at its end. Autograd adds both into the unit's one flat
    gradient buffer ([Note: one leaf per use]): backward holds that buffer plus one use's
    gradient at a time (2 × 16 MiB), where a split of the flat parameter held the head's share,
    the embedding's and their cat (3 ×, the old way)."""
    embedding_mib = VOCAB * EMBED * 4 / 2**20
    for peak in run_on_ranks(_backward_peak_mib, 2):
        assert peak < 2.5 * embedding_mib, f"backward peaked {peak:.1f} MiB above its start"
