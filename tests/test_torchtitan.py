"""torchtitan's decoders as they are: the blocks in an nn.ModuleDict, each taking (x, freqs_cis),
trained under ddp, zero3 and a 2-stage pipeline (the built-in cut, and a pt.Cut whose blocks get
the rotary table through block_args), activation checkpointing chosen by "auto"; each equal to
one process on the whole batch."""

import pytest
import torch
from torch import nn

import paratrain as pt
from paratrain.testing import RankFailure, max_param_diff, run_on_ranks
from tests.support.pipeline_models import next_token_loss, token_batches
from tests.support.titan import TransformerBlock, titan

STEPS = 3


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _reference():
    model = titan()
    optimizer = _sgd(model)
    xs, ys = token_batches()
    for step in range(STEPS):
        next_token_loss(model(xs[step]), ys[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


# a user's own cut of the model: its blocks called with the root's rotary table, no closure
def _embed(model, tokens):
    return model.tok_embeddings(tokens)


def _head(model, h):
    return model.output(model.norm(h))


def _rotary_table(model, h):
    return (model.freqs_cis,)


TITAN_CUT = pt.Cut("layers", embed=_embed, head=_head, block_args=_rotary_table)
STRATEGIES = {
    "ddp": "ddp",
    "zero3": pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(TransformerBlock,))),
    "pipeline": pt.Pipeline(stages=2, microbatches=2),  # the built-in cut (adapters.py)
    "pipeline, a Cut at layers.1": pt.Pipeline(stages=2, microbatches=2, cut=TITAN_CUT, split_at=("layers.1",)),
}


def _train(topo, name, checkpointing):
    session = pt.Session(STRATEGIES[name], topology=topo, progress_bar=False, activation_checkpointing=checkpointing)
    model = titan()
    model, _ = session.setup(model, _sgd(model))
    xs, ys = token_batches()
    for step in range(STEPS):
        mine = xs[step].chunk(model.replicas)[model.replica_index], ys[step].chunk(model.replicas)[model.replica_index]
        session.train_step(mine, next_token_loss)
    return session.full_state_dict()


@pytest.mark.parametrize("name,world,checkpointing", [
    ("ddp", 2, "auto"), ("zero3", 2, "auto"), ("pipeline", 2, None), ("pipeline", 4, "auto"),
    ("pipeline, a Cut at layers.1", 2, None),
])
def test_a_torchtitan_decoder_trains_with_its_module_dict_as_one_process(name, world, checkpointing):
    expected = _reference()
    for state in run_on_ranks(_train, world, name, checkpointing, timeout=300):
        assert state.keys() == expected.keys()  # the model's own names: layers.0 …
        assert max_param_diff(state, expected) < 1e-6


def test_auto_checkpointing_chooses_the_module_dicts_blocks():
    assert pt.checkpoint_activations(titan(), "auto") == [f"layers.{i}" for i in range(4)]
    with pytest.raises(pt.ConfigError, match="chose no module"):  # a dict of different modules
        pt.checkpoint_activations(nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Tanh()}), "auto")


def _setup_only(topo, split_at):
    strategy = pt.Pipeline(stages=2, cut=TITAN_CUT, split_at=split_at)
    pt.Session(strategy, topology=topo, progress_bar=False).setup(titan())


def test_a_split_point_outside_the_module_dict_is_named():
    with pytest.raises(RankFailure, match=r"split point 'layers.4' is not a block of 'layers' after the first: "
                                          r"name one of layers.1 … layers.3"):
        run_on_ranks(_setup_only, 2, ("layers.4",), timeout=60)
