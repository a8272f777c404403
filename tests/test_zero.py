"""ZeRO stages on real ranks against single-process training."""

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.testing import assert_same_params, run_on_ranks
from models import make_batches, make_model

STEPS, GLOBAL_BATCH = 3, 16
CHUNKED = {"bn"}  # per-replica BatchNorm statistics: the reference splits the batch too


def _optimizer(kind, params):
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train_sharded(topo, name, stage, optim, accumulate):
    model = make_model(name)
    model, opt = pt.shard(model, _optimizer(optim, model.parameters()), stage=stage, bucket_cap_mb=0.0005)
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    pieces = topo.world_size * accumulate
    for step in range(STEPS):
        for micro in range(accumulate):
            index = topo.rank * accumulate + micro
            x, y = xs[step].chunk(pieces)[index], ys[step].chunk(pieces)[index]
            ctx = model.no_sync() if micro < accumulate - 1 else _nothing()
            with ctx:
                (F.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return pt.full_state_dict(model)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def reference(name, world, accumulate, optim):
    model = make_model(name)
    opt = _optimizer(optim, model.parameters())
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    pieces = world * accumulate if name in CHUNKED else 1
    for step in range(STEPS):
        for x, y in zip(xs[step].chunk(pieces), ys[step].chunk(pieces)):
            (F.cross_entropy(model(x), y) / pieces).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.named_parameters()}


CASES = [(stage, name, world, optim, 1) for stage in (1, 2) for name in ("mlp", "tied", "bn")
         for world in (2, 4) for optim in ("adam", "sgd") if not (world == 4 and name == "bn")]
CASES += [(1, "mlp", 2, "adam", 2), (2, "mlp", 2, "adam", 2), (2, "tied", 4, "sgd", 2)]


@pytest.mark.parametrize("stage,name,world,optim,accumulate", CASES)
def test_zero_matches_single_process(stage, name, world, optim, accumulate):
    ours = run_on_ranks(_train_sharded, world, name, stage, optim, accumulate)
    ref = reference(name, world, accumulate, optim)
    for state in ours:
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-5)


def _policy(name):
    from paratrain.parallel.fsdp import WrapPolicy
    from torch import nn
    return WrapPolicy(module_classes=(nn.Linear,)) if name != "bn" else WrapPolicy(min_params=40)


def _train_stage3(topo, name, optim, accumulate):
    model = make_model(name)
    model, opt = pt.shard(model, _optimizer(optim, model.parameters()), stage=3, wrap_policy=_policy(name))
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    pieces = topo.world_size * accumulate
    for step in range(STEPS):
        for micro in range(accumulate):
            index = topo.rank * accumulate + micro
            x, y = xs[step].chunk(pieces)[index], ys[step].chunk(pieces)[index]
            with model.no_sync() if micro < accumulate - 1 else _nothing():
                (F.cross_entropy(model(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return pt.full_state_dict(model), len(model.units)


CASES3 = [(name, world, optim, 1) for name in ("mlp", "tied", "bn", "unused") for world in (2, 4)
          for optim in ("adam", "sgd") if not (world == 4 and name in ("bn", "unused"))]
CASES3 += [("mlp", 2, "adam", 2), ("tied", 4, "sgd", 2)]


@pytest.mark.parametrize("name,world,optim,accumulate", CASES3)
def test_stage3_matches_single_process(name, world, optim, accumulate):
    ours = run_on_ranks(_train_stage3, world, name, optim, accumulate)
    ref = reference(name, world, accumulate, optim)
    for state, units in ours:
        assert units > 1
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-5)
