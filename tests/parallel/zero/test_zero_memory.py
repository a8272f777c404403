"""Bytes each rank holds under ZeRO, counted from the live tensors, against the paper's formulas
(Rajbhandari et al. 2020, Figure 1: fp32 Adam, K = 12 bytes of optimizer state per parameter)."""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.testing import run_on_ranks
from tests.support import ROOT_DIR
from tests.support.models import live_storages, mse_in_output_dtype

WIDTH, LAYERS = 63, 8  # sizes not divisible by 2 or 4: padding is counted too


def _model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _bytes_after_step(topo, stage, param_dtype=None, bound=None):
    """Bytes of the storages the sharded model holds after a step. A reduction's buffer can stay
    referenced by gloo's worker thread for a moment after its work completed (seen once in a full
    suite on a loaded machine: one unit's 16 KiB over at world 4): above `bound`, the count is
    taken again for up to two seconds, so that only what stays is counted."""
    x = torch.randn(8, WIDTH)
    before = live_storages()  # the batch, and anything the harness holds
    model = _model()
    policy = pt.WrapPolicy(module_classes=(nn.Linear,))
    model, opt = pt.shard(model, torch.optim.Adam(model.parameters(), lr=1e-3), stage=stage,
                          wrap_policy=policy, param_dtype=param_dtype)
    mse_in_output_dtype(model(x), x).backward()
    opt.step()  # held now: parameters, gradients and optimizer state (before zero_grad)
    deadline = time.monotonic() + 2.0
    while (held := sum(n for ptr, n in live_storages().items() if ptr not in before)) > (bound or held) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    peak = model.peak_gathered_bytes if stage == 3 else 0
    unit = max((f.full_bytes for u in model.units for f in u.flats), default=0) if stage == 3 else 0
    return held, peak, unit


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_rank_match_the_zero_formulas(world):
    psi = sum(p.numel() for p in _model().parameters())
    formula = {1: 4 * psi + 4 * psi + 8 * psi / world, 2: 4 * psi + 12 * psi / world, 3: 16 * psi / world}
    for stage in (1, 2, 3):
        for held, peak, unit in run_on_ranks(_bytes_after_step, world, stage, None, 1.05 * formula[stage]):
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
        for held, _, _ in run_on_ranks(_bytes_after_step, world, stage, torch.bfloat16, 1.05 * formula[stage]):
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
    sys.path.insert(0, os.path.join(ROOT_DIR, "bench"))
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


def test_a_tied_weight_gradient_is_never_held_twice():
    """The root unit holds the embedding, whose gradient comes from the head at the start of
    backward and from the embedding at its end. The embedding is a flat of its own, so each use's
    gradient is the flat's buffer as autograd made it, and the head's is reduced before mid's
    backward ([Note: the root's big parameters], [Note: a unit used twice]): backward holds one
    16 MiB gradient at a time and this rank's 8 MiB shard of it (1.55 × measured). Copying the
    head's into a zeroed buffer that the embedding's then added into held 2 × (2.05 ×); a split of
    the flat parameter held both shares and their cat (3 ×)."""
    embedding_mib = VOCAB * EMBED * 4 / 2**20
    for peak in run_on_ranks(_backward_peak_mib, 2):
        assert peak < 1.75 * embedding_mib, f"backward peaked {peak:.1f} MiB above its start"


def test_the_root_s_big_parameters_get_flats_of_their_own():
    """[Note: the root's big parameters]: in a model cut into units, a root parameter of at least
    OWN_FLAT_ELEMENTS is a flat by itself (per param group); the root's small ones share one, a
    wrapped unit keeps one flat per group whatever its sizes, and a model not cut at all keeps one
    flat."""
    from paratrain.parallel.zero import units
    model = _TiedLM()
    model.norm = nn.LayerNorm(EMBED)
    by_unit = units.params_by_unit(units.owners_by_param(model), ["mid"])
    group_of = {p: 0 for p in model.parameters()}
    flats = units.flats_by_unit(by_unit, group_of)
    assert flats["mid"] == [[model.mid.weight, model.mid.bias]]
    assert flats[""] == [[model.emb.weight], [model.norm.weight, model.norm.bias]]
    group_of[model.norm.bias] = 1  # a second param group: flats never mix groups
    assert units.flats_by_unit(by_unit, group_of)[""] == [[model.emb.weight], [model.norm.weight], [model.norm.bias]]
    assert units.OWN_FLAT_ELEMENTS > model.mid.weight.numel()  # below it, mid's weight would be split if it were root's
    alone = units.params_by_unit(units.owners_by_param(model), [])
    assert units.flats_by_unit(alone, {p: 0 for p in model.parameters()})[""] == [list(alone[""])]


def test_a_parameter_belongs_to_the_deepest_unit_that_holds_every_name_it_has():
    """units.innermost_unit looks a parameter's unit up by its names' prefixes; it must give what
    the definition gives, a scan of every unit, for nested units, tied names, and look-alike names
    ("blocks.1" is not inside "blocks.10")."""
    from paratrain.parallel.zero.units import innermost_unit
    units = ["blocks", "blocks.1", "blocks.10", "blocks.1.attn", "head", "blocks.1.attn.q"]
    cases = [["blocks.1.attn.q.weight"], ["blocks.1.attn.k.weight"], ["blocks.10.weight"], ["blocks.1.mlp.bias"],
             ["blocks.1.attn.q.weight", "blocks.1.mlp.weight"], ["blocks.1.attn.q.weight", "blocks.10.weight"],
             ["emb.weight", "head.weight"], ["head.weight"], ["norm.weight"], ["blocks.2.weight"]]
    for names in cases:
        scanned = max([u for u in units if all(n.startswith(u + ".") for n in names)], key=len, default="")
        assert innermost_unit(names, set(units)) == scanned, names
    assert [innermost_unit(n, set(units)) for n in cases[:3]] == ["blocks.1.attn.q", "blocks.1.attn", "blocks.10"]
    assert [innermost_unit(n, set(units)) for n in cases[4:7]] == ["blocks.1", "blocks", ""]


def test_min_params_counts_what_no_unit_inside_holds():
    """WrapPolicy(min_params) looks each parameter's units up by prefix; it must choose what the
    definition chooses, a scan of the chosen units for every parameter, at every threshold, on
    nested blocks with names that share a prefix ("1" and "10") and a tied weight."""
    from paratrain.parallel.zero.wrap_policy import NEVER_CALLED, WrapPolicy

    def scanned(policy, root):
        chosen = []
        for name, module in reversed(list(root.named_modules())):
            if not name or isinstance(module, NEVER_CALLED):
                continue
            inner = [c for c in chosen if c.startswith(name + ".")]
            free = sum(p.numel() for n, p in module.named_parameters()
                       if not any(f"{name}.{n}".startswith(c + ".") for c in inner))
            if isinstance(module, policy.module_classes) or (policy.min_params > 0 and free >= policy.min_params):
                chosen.append(name)
        return chosen

    def block(width):
        return nn.Sequential(nn.Linear(width, width), nn.Sequential(nn.Linear(width, 2 * width), nn.Linear(2 * width, width)))

    model = nn.Sequential(*[block(w) for w in (3, 5, 8, 2, 4, 6, 3, 5, 7, 9, 4)], nn.Linear(9, 9))
    model[10][0].weight = model[1][0].weight = nn.Parameter(torch.randn(4, 4))  # tied across blocks
    model[1][0].bias = nn.Parameter(torch.randn(4))
    thresholds = sorted({p.numel() for p in model.parameters()} | {40, 100, 300, 10**6})
    picks = [WrapPolicy(min_params=t).select(model) for t in thresholds]
    assert picks == [scanned(WrapPolicy(min_params=t), model) for t in thresholds]
    assert len({tuple(p) for p in picks}) > 4  # the thresholds choose different units
    linear = WrapPolicy(module_classes=(nn.Linear,), min_params=60)
    assert linear.select(model) == scanned(linear, model)


class _TiedWithGaps(nn.Module):
    """Root parameters (the tied embedding, two LayerNorms) used between the Linear units."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.a, self.norm_a = nn.Linear(16, 16), nn.LayerNorm(16)
        self.b, self.norm_b = nn.Linear(16, 16), nn.LayerNorm(16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(self.norm_b(self.b(self.norm_a(self.a(self.emb(tokens))))))


def _root_gradient_during_backward(topo):
    from paratrain.parallel.zero.flat_shard import FlatShard
    torch.manual_seed(0)
    model = _TiedWithGaps()
    model, _ = pt.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=3,
                        wrap_policy=pt.WrapPolicy(module_classes=(nn.Linear,)))
    root = next(u for u in model.units if u.name == "").flats[0]
    seen, reductions = [], []
    for name in ("a", "b"):  # after each unit's own backward: what the root holds then
        model.module.get_submodule(name).register_full_backward_hook(
            lambda *_, name=name: seen.append((name, root.grad is None, root.shard.grad is not None)))
    real = FlatShard.start_grad_sync

    def counting(flat, *args, **kwargs):
        if flat is root:
            reductions.append(kwargs.get("partial", False))
        return real(flat, *args, **kwargs)

    FlatShard.start_grad_sync = counting
    try:
        for _ in range(2):
            tokens = torch.randint(0, 64, (2, 8))
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            model.zero_grad()
    finally:
        FlatShard.start_grad_sync = real
    return seen, reductions


def test_a_root_gradient_part_way_is_reduced_before_the_next_units_backward():
    """[Note: a unit used twice]: the head's and norm_b's gradients (the root's) are reduced when
    b's backward starts, so no root buffer is held through b's and a's; norm_a's and the
    embedding's fill a second buffer, reduced when the last is in: two reductions per backward,
    not one per gap between units."""
    for seen, reductions in run_on_ranks(_root_gradient_during_backward, 2):
        assert seen == [("b", True, True), ("a", False, True)] * 2  # a: norm_a's share is in
        assert reductions == [True, False] * 2
