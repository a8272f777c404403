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
from tests.support.titan import Transformer, TransformerBlock, titan

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


# -- built on the meta device, initialised from the root: torchtitan's init_weights() ---------------

def _meta_titan():
    with torch.device("meta"):
        return Transformer()


def _one_process_init(seed=0):
    """What one process writes for a meta-built torchtitan model."""
    model = _meta_titan()
    torch.manual_seed(seed)
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def _initialised(topo, name):
    session = pt.Session(STRATEGIES[name], topology=topo, progress_bar=False, seed=0)
    model = _meta_titan()
    model, _ = session.setup(model, _sgd(model), init="init_weights")
    initial = {k: v.clone() for k, v in session.full_state_dict().items()}  # before training changes it
    freqs_cis = model.module.freqs_cis.clone()
    xs, ys = token_batches()
    for step in range(STEPS):
        mine = xs[step].chunk(model.replicas)[model.replica_index], ys[step].chunk(model.replicas)[model.replica_index]
        session.train_step(mine, next_token_loss)
    return initial, freqs_cis, session.full_state_dict()


@pytest.mark.parametrize("name,world", [("zero3", 2), ("zero3", 3), ("pipeline", 2), ("ddp", 2)])
def test_init_weights_from_the_root_gives_what_one_process_gets(name, world):
    expected = _one_process_init()
    wo = [expected.layers[str(i)].attention.wo.weight.std().item() for i in range(4)]
    assert wo == sorted(wo, reverse=True)  # the init depends on depth: torch's default would not
    initial, freqs_cis = {k: v.clone() for k, v in expected.state_dict().items()}, expected.freqs_cis.clone()
    trained = _trained(expected)
    for state, table, after in run_on_ranks(_initialised, world, name, timeout=300):
        assert max_param_diff(state, initial) == 0  # the values, to the bit
        assert torch.equal(table, freqs_cis)  # a buffer left out of the state dict
        assert max_param_diff(after, trained) < 1e-6


def _trained(model):
    optimizer = _sgd(model)
    xs, ys = token_batches()
    for step in range(STEPS):
        next_token_loss(model(xs[step]), ys[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_an_init_fn_that_calls_the_roots_init_weights_is_refused():
    """Each module's tensors are set by that module alone: the root's writes would be lost."""
    with pytest.raises(pt.ConfigError, match=r"init_fn\(the model\) wrote layers.0.attention.wk.weight, .* "
                                             r"setup\(\.\.\., init='init_weights'\)"):
        pt.materialize(_meta_titan(), init_fn=lambda m: m.init_weights() if hasattr(m, "init_weights") else None)


def test_init_refusals_say_what_to_pass():
    with pytest.raises(pt.ConfigError, match="pass one of them"):
        pt.materialize(_meta_titan(), init="init_weights", init_fn=lambda m: None)
    with pytest.raises(pt.ConfigError, match="has no method 'init_model'"):
        pt.materialize(_meta_titan(), init="init_model")
    with pt.Session("single", progress_bar=False) as session, \
            pytest.raises(pt.ConfigError, match=r"holds real tensors already: call model.init_weights\(\) yourself"):
        session.setup(titan(), init="init_weights")


class _Copying(nn.Module):
    """An init that sets one part from another: not computable from a part alone."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def init_weights(self):
        nn.init.normal_(self.a.weight)
        self.b.weight.copy_(self.a.weight * 2)
        for bias in (self.a.bias, self.b.bias):
            bias.zero_()


def test_a_part_computed_from_another_part_is_refused_by_name():
    from paratrain.components.materialize import Materializer, MetaInit

    with torch.device("meta"):
        model = _Copying()
    parts = Materializer(model, MetaInit(root="init_weights"))
    with pytest.raises(pt.ConfigError, match="computes b.weight from tensors of another part"):
        parts.materialize([model.b.weight, model.b.bias])
