"""Activation checkpointing under every strategy: the same training with and without it, on real
ranks, blocks with dropout; and which modules each way of choosing picks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.testing import max_param_diff, run_on_ranks

STEPS, GLOBAL_BATCH = 3, 16


class Block(nn.Module):
    calls = 0  # forwards run in this process, recomputes included

    def __init__(self, d: int):
        super().__init__()
        self.ln, self.up, self.down, self.drop = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.Dropout(0.2)

    def forward(self, x):  # (B, d) → (B, d)
        Block.calls += 1
        return x + self.drop(self.down(torch.tanh(self.up(self.ln(x)))))


class Net(nn.Module):
    """12 → 16, four Blocks in a ModuleList, → 5 classes; cut by the pipeline at its blocks."""

    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(12, d)  # before the blocks: the first stage's
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 5)  # after them: the last stage's

    def pipeline_embed(self, x):
        return self.inp(x)

    def pipeline_head(self, h):
        return self.head(h)

    def forward(self, x):
        h = self.pipeline_embed(x)
        for block in self.blocks:
            h = block(h)
        return self.pipeline_head(h)


def _strategy(name: str):
    if name == "zero3":  # each block a unit: gathered for its backward before its recompute runs
        return pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(Block,)))
    if name == "pipeline":
        return pt.Pipeline(stages=2, layers="blocks", microbatches=2)
    return name


def _train(topo, name: str, which):
    session = pt.Session(_strategy(name), topology=topo, progress_bar=False, activation_checkpointing=which)
    model = Net()  # after the session seeded torch: the same start on every rank, with or without
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    Block.calls = 0
    for _ in range(STEPS):
        x, y = torch.randn(GLOBAL_BATCH, 12, generator=g), torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
        session.train_step((x.chunk(model.replicas)[model.replica_index],
                            y.chunk(model.replicas)[model.replica_index]), F.cross_entropy)
    return session.full_state_dict(), Block.calls


@pytest.mark.parametrize("name,world", [("single", 1), ("ddp", 2), ("hierarchical", 4), ("zero1", 2), ("zero2", 2), ("zero3", 2),
                                        ("pipeline", 2), ("pipeline", 4)])
def test_training_with_activation_checkpointing_equals_training_without(name, world):
    nodes = 2 if name == "hierarchical" else 1  # 2 nodes × 2: both of its reduction's levels
    plain = run_on_ranks(_train, world, name, None, nodes=nodes)
    checkpointed = run_on_ranks(_train, world, name, "auto", nodes=nodes)
    for (state, calls), (expected, plain_calls) in zip(checkpointed, plain):
        assert max_param_diff(state, expected) == 0  # the recompute replays the forward exactly, dropout too
        assert plain_calls > 0 and calls == 2 * plain_calls  # every block ran again in backward


def test_what_each_way_of_choosing_picks():
    blocks = [f"blocks.{i}" for i in range(4)]
    assert pt.checkpoint_activations(Net(), "auto") == blocks
    assert pt.checkpoint_activations(Net(), Block) == blocks
    assert pt.checkpoint_activations(Net(), (nn.Linear,)) == ["inp"] + [
        f"blocks.{i}.{p}" for i in range(4) for p in ("up", "down")] + ["head"]
    assert pt.checkpoint_activations(Net(), lambda name, m: name.startswith("blocks")) == blocks  # not the list
    with pytest.raises(pt.ConfigError, match="an nn.ModuleList is never called: choose its members"):
        pt.checkpoint_activations(Net(), lambda name, m: name == "blocks")


def test_a_checkpointed_module_still_copies_and_evaluates_as_itself():
    import copy

    model = Net()
    pt.checkpoint_activations(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.blocks[0].up.weight.zero_()  # the copy's forward must use the copy's weights
        x = torch.randn(3, 12)
        Block.calls = 0
        assert not torch.equal(twin(x), model(x)) and Block.calls == 8  # no recompute without grad


@pytest.mark.parametrize("which,message", [
    ("auto", "chose no module of Sequential: name its block class"),
    (nn.Conv2d, "activation_checkpointing=Conv2d chose no module"),
    (3, "takes a module class, a tuple of them, a predicate"),
])
def test_choosing_nothing_is_a_clear_error(which, message):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(pt.ConfigError, match=message):
        pt.checkpoint_activations(model, which)
