"""Models built on the meta device: each rank materialises only what it holds, by a rule whose
values depend on the seed and the model alone, so a meta-built model trained under any strategy
equals the same model materialised whole and trained by one process."""

import pytest
import torch
from torch import nn

import paratrain as pt
from paratrain.components.materialize import Materializer, MetaInit
from paratrain.testing import max_param_diff, run_on_ranks
from tests.support.pipeline_models import TinyGPT, next_token_loss, tiny_gpt_strategy, token_batches, train_one_process

STEPS = 3


def init_positions(module: nn.Module) -> None:
    """What TinyGPT's own code does for the parameter it holds directly (it has no reset_parameters())."""
    if isinstance(module, TinyGPT):
        nn.init.normal_(module.positions, std=0.1)


def meta_gpt() -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT()


class Buffered(nn.Module):
    """A tied weight, BatchNorm statistics and a non-persistent buffer its init_fn fills."""

    def __init__(self):
        super().__init__()
        self.embed, self.norm = nn.Embedding(7, 6), nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 7)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.empty(6), persistent=False)

    def reset_parameters(self):
        self.scale.fill_(0.5)


def test_values_do_not_depend_on_which_part_is_built_first_or_alone():
    with torch.device("meta"):
        whole, pieces = Buffered(), Buffered()
    Materializer(whole, MetaInit(seed=3)).materialize()
    parts = Materializer(pieces, MetaInit(seed=3))
    parts.materialize([pieces.head.bias])  # the head's own first: its weight is the embedding's
    assert pieces.embed.weight.is_meta and pieces.head.weight is pieces.embed.weight
    parts.materialize(list(pieces.norm.buffers()))
    parts.materialize()
    expected = {**whole.state_dict(), "scale": whole.scale}
    got = {**pieces.state_dict(), "scale": pieces.scale}
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert torch.equal(whole.scale, torch.full((6,), 0.5)) and torch.equal(whole.norm.running_var, torch.ones(6))
    assert whole.head.weight is whole.embed.weight  # still tied
    with torch.device("meta"):
        other = Buffered()
    pt.materialize(other, seed=4)
    assert not torch.equal(other.embed.weight, whole.embed.weight)  # the seed matters


def test_a_meta_tensor_nothing_can_initialise_is_named():
    with pytest.raises(pt.ConfigError, match=r"the model \(TinyGPT\) holds positions on the meta device but "
                                             r"has no reset_parameters\(\).*init_fn"):
        pt.materialize(meta_gpt())


class Masked(nn.Module):
    """nanoGPT's pattern: a causal mask made in __init__, which on the meta device holds no values."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("causal", torch.tril(torch.ones(4, 4)), persistent=False)
        self.gain = nn.Parameter(torch.ones(4))


def test_a_tensor_that_no_owner_sets_is_named_not_left_as_garbage():
    def gain_only(module):
        if isinstance(module, Masked):
            module.gain.fill_(1.0)
    with torch.device("meta"):
        model = Masked()
    with pytest.raises(pt.ConfigError, match=r"^causal of the meta-built model was not set .* reset_parameters\(\) "
                                             r"nor by init_fn.*init_fn=fn"):
        pt.materialize(model, init_fn=gain_only)

    def half_of_the_mask(module):
        gain_only(module)
        if isinstance(module, Masked):
            module.causal[:2] = 1.0  # the other two rows stay unset
    with torch.device("meta"):
        model = Masked()
    with pytest.raises(pt.ConfigError, match=r"^causal of the meta-built model was not set \(wholly or in part\)"):
        pt.materialize(model, init_fn=half_of_the_mask)

    def mask_and_gain(module):
        gain_only(module)
        if isinstance(module, Masked):
            module.causal.copy_(torch.tril(torch.ones(4, 4)))
    with torch.device("meta"):
        model = Masked()
    pt.materialize(model, init_fn=mask_and_gain)
    assert torch.equal(model.causal, torch.tril(torch.ones(4, 4))) and torch.equal(model.gain, torch.ones(4))


class Rotary(nn.Module):
    """torchtitan's pattern: RoPE's table as a complex buffer (`freqs_cis`), and a step counter."""

    def __init__(self, dtype):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("table", torch.zeros(8, 2, dtype=dtype))

    def fill(self):
        angles = torch.outer(torch.arange(8.0), torch.tensor([1.0, 0.1]))
        value = torch.polar(torch.ones_like(angles), angles) if self.table.is_complex() else torch.ones(8, 2)
        self.table.copy_(value.to(self.table.dtype))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.int64, torch.bool])
def test_a_tensor_of_any_dtype_that_no_owner_sets_is_named(dtype):
    with torch.device("meta"):
        model = Rotary(dtype)
    with pytest.raises(pt.ConfigError, match=r"^table of the meta-built model was not set"):
        pt.materialize(model, init_fn=lambda m: None)  # an init_fn that forgets the table
    if dtype.is_complex:  # a part left unset is found too
        with torch.device("meta"):
            model = Rotary(dtype)
        with pytest.raises(pt.ConfigError, match=r"^table of the meta-built model was not set \(wholly or in part"):
            pt.materialize(model, init_fn=lambda m: m.table[:4].fill_(1) if isinstance(m, Rotary) else None)
    with torch.device("meta"):
        model = Rotary(dtype)
    pt.materialize(model, init_fn=lambda m: m.fill() if isinstance(m, Rotary) else None)
    expected = Rotary(dtype)
    expected.fill()
    assert torch.equal(model.table, expected.table)


def reference():
    return train_one_process(pt.materialize(meta_gpt(), seed=0, init_fn=init_positions), STEPS)


def _train(topo, name: str, stages: int):
    held = []  # after each part is built (a zero3 unit, a pipeline stage): the parameters whole here
    if name in ("zero3", "pipeline"):
        build = Materializer.materialize

        def counting(self, tensors=None, device=None):
            build(self, tensors, device)
            held.append(sum(p.numel() for p in self.model.parameters()
                            if not p.is_meta and not getattr(p, "_paratrain_sharded", False)))
        Materializer.materialize = counting
    session = pt.Session(tiny_gpt_strategy(name, stages), topology=topo, progress_bar=False)
    model = meta_gpt()
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             init_fn=init_positions)
    xs, ys = token_batches()
    for step in range(STEPS):
        x, y = xs[step].chunk(model.replicas)[model.replica_index], ys[step].chunk(model.replicas)[model.replica_index]
        session.train_step((x, y), next_token_loss)
    stage = sum(p.numel() for p in model.module.parameters()) if name == "pipeline" else None
    return session.full_state_dict(), held, stage


@pytest.mark.parametrize("name,world,stages", [("single", 1, 1), ("ddp", 2, 1), ("zero3", 2, 1), ("zero3", 4, 1),
                                               ("pipeline", 2, 2), ("pipeline", 4, 2)])
def test_a_meta_built_model_trains_as_the_same_model_built_whole_on_one_process(name, world, stages):
    expected = reference()
    block = sum(p.numel() for p in TinyGPT().blocks[0].parameters())
    for state, held, stage in run_on_ranks(_train, world, name, stages):
        assert max_param_diff(state, expected) < 1e-6  # measured: up to 1.5e-7 (0 for single)
        if name == "zero3":  # one unit whole at a time: a block (the root's tokens, positions, ln last)
            assert len(held) == 5 and max(held[:4]) == block
        if name == "pipeline":  # the stage's parts only; the other stages' stay on the meta device
            assert held == [stage] and stage < sum(p.numel() for p in TinyGPT().parameters())
