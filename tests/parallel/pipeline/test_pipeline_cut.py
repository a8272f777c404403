"""Pipelines of models that are not an nn.Sequential: cut at named blocks, weights tied across
stages, activations that are tuples, transformers' GPT-2 and Llama-shaped decoders; each equal
to one process."""

import functools
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain as pt
from paratrain.parallel.pipeline import Pipeline
from paratrain.testing import RankFailure, max_param_diff, run_on_ranks
from tests.support import ROOT_DIR
from tests.support.pipeline_models import batches, chain, next_token_loss, tiny_gpt, token_batches

ROOT = ROOT_DIR
STEPS = 3
CLIP = 0.5  # clipping on: a tied weight must count once in the global norm


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _reference(make, data, loss_fn, steps=STEPS):
    """One process on the whole batches, with the same clipping."""
    model = make()
    opt = _sgd(model)
    xs, ys = data
    for step in range(steps):
        loss_fn(model(xs[step]), ys[step]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(topo, make, data, loss_fn, strategy, steps=STEPS):
    session = pt.Session(strategy, topology=topo, progress_bar=False, max_grad_norm=CLIP)
    model = make()
    model, _ = session.setup(model, _sgd(model))
    xs, ys = data
    for step in range(steps):
        x, y = xs[step].chunk(model.replicas)[model.replica_index], ys[step].chunk(model.replicas)[model.replica_index]
        session.train_step((x, y), loss_fn)
    return session.full_state_dict()


def _tied_chain():
    model = chain()  # 2 stages by layers: layers 0-4 and 5-8
    model[6].weight = model[2].weight  # Linear 16→16 on stage 1 shares stage 0's weight
    return model


def _example_gpt():
    """examples/gpt.py's own GPT (its head tied to the token embedding), small."""
    spec = importlib.util.spec_from_file_location("gpt_example", os.path.join(ROOT, "examples", "gpt.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    return example.GPT(vocab=11, block=8, layers=4, width=16, heads=2)


CASES = [
    ("tied chain", 2, 2, "1f1b", None), ("tied chain", 4, 2, "gpipe", None),
    ("gpt", 2, 2, "1f1b", None), ("gpt", 2, 2, "gpipe", ("blocks.3",)), ("gpt", 4, 4, "1f1b", None),
    ("gpt", 4, 4, "gpipe", ("blocks.1", "blocks.2", "blocks.3")), ("gpt", 4, 2, "1f1b", None),
    ("gpt", 4, 2, "gpipe", ("blocks.2",)), ("example gpt", 2, 2, "gpipe", None),
    ("example gpt", 4, 4, "1f1b", None), ("example gpt", 4, 2, "gpipe", None),
    # interleaved (2 chunks per rank: the tied embedding on rank 0, the head on the last chunk of
    # rank 1) and zero-bubble
    ("tied chain", 2, 2, "zb-h1", None), ("gpt", 2, 2, "interleaved-1f1b", None),
    ("gpt", 4, 2, "interleaved-1f1b", ("blocks.1", "blocks.2", "blocks.3")), ("gpt", 4, 4, "zb-h1", None),
    ("example gpt", 2, 2, "interleaved-1f1b", None), ("example gpt", 4, 2, "zb-h1", None),
]
VIRTUAL = {"interleaved-1f1b": 2}
MODELS = {"tied chain": (_tied_chain, batches, F.cross_entropy),
          "gpt": (tiny_gpt, token_batches, next_token_loss),
          "example gpt": (_example_gpt, token_batches, next_token_loss)}


@pytest.mark.parametrize("name,world,stages,schedule,split_at", CASES)
def test_a_model_cut_at_named_blocks_with_tied_weights_equals_one_process(name, world, stages, schedule, split_at):
    make, data, loss_fn = MODELS[name]
    layers = "blocks" if "gpt" in name else None
    strategy = Pipeline(stages=stages, schedule=schedule, microbatches=4, layers=layers, split_at=split_at,
                        virtual=VIRTUAL.get(schedule, 1))
    expected = _reference(make, data(), loss_fn)
    for state in run_on_ranks(_train, world, make, data(), loss_fn, strategy):
        assert state.keys() == expected.keys()  # the tied weight under both its names, as one process has it
        assert max_param_diff(state, expected) < 1e-6  # measured: up to 1.5e-7


def _tied_copies(topo):
    """After training, the two copies of the tied weight (stage 0's token embedding, the last
    stage's head) are identical, and a checkpoint holds the weight once."""
    session = pt.Session(Pipeline(stages=2, layers="blocks"), topology=topo, progress_bar=False)
    model = tiny_gpt()
    model, _ = session.setup(model, _sgd(model))
    xs, ys = token_batches()
    session.train_step((xs[0], ys[0]), next_token_loss)
    mine = model.module.tokens.weight if topo.rank == 0 else model.module.head.weight
    return mine.detach().clone(), sorted(model.checkpoint_layout().params)


def test_tied_copies_stay_identical_and_are_stored_once():
    (w0, names0), (w1, names1) = run_on_ranks(_tied_copies, 2)
    assert torch.equal(w0, w1)
    assert "tokens.weight" in names0 and "tokens.weight" in names1 and "head.weight" not in names1


def _gpt_checkpoint(topo, path, strategy):
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = tiny_gpt()
    model, _ = session.setup(model, _sgd(model))
    xs, ys = token_batches()
    if isinstance(strategy, Pipeline):
        session.train_step((xs[0], ys[0]), next_token_loss)
        session.save(path)
    else:
        session.load(path)
    return session.full_state_dict()


def test_a_pipeline_checkpoint_of_a_tied_model_loads_into_one_process(tmp_path):
    saved = run_on_ranks(_gpt_checkpoint, 2, str(tmp_path / "c"), Pipeline(stages=2, layers="blocks"))[0]
    loaded = run_on_ranks(_gpt_checkpoint, 1, str(tmp_path / "c"), pt.Single())[0]
    assert max_param_diff(saved, loaded) == 0


class PairBlock(nn.Module):
    """A block whose activation is a pair: hidden state and a scale it passes on."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, pair):
        h, scale = pair
        return torch.tanh(self.linear(h)) * scale, scale


class PairModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(PairBlock() for _ in range(4))
        self.out = nn.Linear(16, 5)

    def pipeline_embed(self, x):
        return self.inp(x), torch.full((x.shape[0], 1), 0.5)  # a tuple crosses the stages

    def pipeline_head(self, pair):
        return self.out(pair[0])

    def forward(self, x):
        pair = self.pipeline_embed(x)
        for block in self.blocks:
            pair = block(pair)
        return self.pipeline_head(pair)


def _pair_model():
    torch.manual_seed(0)
    return PairModel()


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1"])
def test_tuple_activations_cross_stages(schedule):
    expected = _reference(_pair_model, batches(), F.cross_entropy)
    strategy = Pipeline(stages=2, layers="blocks", microbatches=2, schedule=schedule, virtual=VIRTUAL.get(schedule, 1))
    for state in run_on_ranks(_train, 2, _pair_model, batches(), F.cross_entropy, strategy):
        assert max_param_diff(state, expected) < 1e-6


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=11, n_positions=8,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


class _Logits(nn.Module):
    """The reference: GPT-2's logits, as the pipeline's head returns them."""

    def __init__(self):
        super().__init__()
        self.model = _gpt2()

    def forward(self, x):
        return self.model(x).logits


@pytest.mark.parametrize("world,schedule", [(2, "1f1b"), (4, "1f1b"), (2, "interleaved-1f1b"), (4, "zb-h1")])
def test_transformers_gpt2_trains_on_stages(world, schedule):
    pytest.importorskip("transformers")
    expected = {k.removeprefix("model."): v for k, v in _reference(_Logits, token_batches(), next_token_loss).items()}
    strategy = Pipeline(stages=2, schedule=schedule, virtual=VIRTUAL.get(schedule, 1))
    for state in run_on_ranks(_train, world, _gpt2, token_batches(), next_token_loss, strategy, timeout=300):
        assert max_param_diff({k: state[k] for k in expected}, expected) < 1e-6


def _decoder(kind: str, attention: str):
    """A small transformers decoder of the Llama shape: rotary positions, RMSNorm, gated MLP, its
    head tied to the token embedding (Llama's is not by default: both ways run)."""
    import transformers

    config_class, model_class = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                 "mistral": ("MistralConfig", "MistralForCausalLM"),
                                 "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[kind]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=8, tie_word_embeddings=kind == "qwen2",
        attn_implementation=attention)
    return getattr(transformers, model_class)(config)


class _DecoderLogits(nn.Module):
    def __init__(self, kind, attention):
        super().__init__()
        self.model = _decoder(kind, attention)

    def forward(self, x):
        return self.model(x).logits


@pytest.mark.parametrize("kind,attention,world,schedule", [
    ("llama", "sdpa", 2, "1f1b"), ("llama", "eager", 2, "gpipe"), ("llama", "sdpa", 4, "1f1b"),
    ("mistral", "sdpa", 2, "zb-h1"), ("qwen2", "sdpa", 2, "1f1b")])
def test_transformers_llama_shaped_decoders_train_on_stages(kind, attention, world, schedule):
    """Each stage computes the rotary table for its own blocks (the rotary embedding, registered
    after the layers, stays on every stage); eager attention gets its causal mask, sdpa none."""
    pytest.importorskip("transformers")
    expected = {k.removeprefix("model."): v
                for k, v in _reference(lambda: _DecoderLogits(kind, attention), token_batches(), next_token_loss).items()}
    strategy = Pipeline(stages=world, schedule=schedule)
    make = functools.partial(_decoder, kind, attention)
    for state in run_on_ranks(_train, world, make, token_batches(), next_token_loss, strategy, timeout=300):
        assert max_param_diff({k: state[k] for k in expected}, expected) < 1e-6


def _train_one_step(topo, make, strategy):
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make()
    model, _ = session.setup(model, _sgd(model))
    ids = torch.zeros(4, 8, dtype=torch.long)
    session.train_step((ids, ids), next_token_loss)


def test_a_sliding_window_shorter_than_the_sequence_is_refused_on_stages():
    """Mistral masks beyond its sliding window, which the built-in cut does not: sequences longer
    than the window are refused, saying what to do (the parity test's are within it)."""
    pytest.importorskip("transformers")
    make = functools.partial(_decoder, "mistral", "sdpa")
    short = functools.partial(_with_window, make, 4)
    with pytest.raises(RankFailure, match=r"sliding window \(4 tokens\) is shorter than these sequences \(8\)"):
        run_on_ranks(_train_one_step, 2, short, Pipeline(stages=2), timeout=120)


def _with_window(make, window):
    model = make()
    model.config.sliding_window = window
    return model


def _setup_only(topo, strategy, make):
    pt.Session(strategy, topology=topo, progress_bar=False).setup(make())


@pytest.mark.parametrize("strategy,message", [
    (Pipeline(stages=2, layers="blocks", split_at=("blocks.9",)), r"split point 'blocks.9' is not a block"),
    (Pipeline(stages=3, layers="blocks", split_at=("blocks.3", "blocks.1")), "split points must be in order"),
    (Pipeline(stages=2, layers="heads"), "has no submodule 'heads'"),
])
def test_bad_split_points_are_named(strategy, message):
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(_setup_only, strategy.stages, strategy, tiny_gpt, timeout=60)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def test_a_model_without_a_cut_says_what_to_give():
    with pytest.raises(RankFailure, match="define pipeline_embed\\(inputs\\) and pipeline_head\\(x\\)"):
        run_on_ranks(_setup_only, 2, Pipeline(stages=2), Plain, timeout=60)
