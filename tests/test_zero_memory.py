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
