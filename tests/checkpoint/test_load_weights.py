"""pt.load_weights: a consolidated file (safetensors or a torch state dict) loaded into a model
however it is sharded, each rank reading only what it holds; bad keys refused before anything
is written, with one error listing them on every rank."""

import pytest
import torch
from safetensors.torch import save_file, save_model
from torch import nn

import paratrain as pt
import paratrain.checkpoint.weights as weights
from paratrain.testing import max_param_diff, run_on_ranks
from tests.support.pipeline_models import (
    TinyGPT,
    next_token_loss,
    tiny_gpt,
    tiny_gpt_strategy,
    token_batches,
    train_one_process,
)

STEPS = 2


def _load_and_train(topo, name: str, path: str):
    read = []  # elements this rank read from the file
    getitem = weights._SafeTensor.__getitem__
    weights._SafeTensor.__getitem__ = lambda self, index: read.append(getitem(self, index)) or read[-1]
    session = pt.Session(tiny_gpt_strategy(name), topology=topo, progress_bar=False, seed=5)
    with torch.device("meta"):
        model = TinyGPT()
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                             init_fn=lambda m: isinstance(m, TinyGPT) and nn.init.zeros_(m.positions))
    pt.load_weights(model, path)
    loaded = {k: v.clone() for k, v in session.full_state_dict().items()}
    xs, ys = token_batches()
    for step in range(STEPS):
        x, y = xs[step].chunk(model.replicas)[model.replica_index], ys[step].chunk(model.replicas)[model.replica_index]
        session.train_step((x, y), next_token_loss)
    pieces = []
    if name == "zero3":  # what this rank holds: (piece length, row length of its parameter)
        layout = model.checkpoint_layout()
        pieces = [(length, shape[1:].numel()) for flat in layout.flat.values()
                  for n, _, _, length in flat.pieces(flat.rank) for m, _, shape in flat.slots if m == n]
    return loaded, session.full_state_dict(), sum(t.numel() for t in read), pieces


@pytest.mark.parametrize("name,world,suffix", [("ddp", 2, ".safetensors"), ("zero2", 3, ".safetensors"),
                                               ("zero3", 3, ".safetensors"), ("zero3", 2, ".pt"),
                                               ("pipeline", 2, ".safetensors"), ("pipeline", 4, ".safetensors")])
def test_a_file_loads_into_a_sharded_model_that_then_trains_as_the_plain_one(tmp_path, name, world, suffix):
    source = tiny_gpt(seed=1)
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pt":
        torch.save(source.state_dict(), path)
    else:
        save_model(source, str(path))  # keeps one name of the tied weight, as transformers' files do
    expected_loaded = {k: v.clone() for k, v in source.state_dict().items()}
    expected = train_one_process(source, STEPS)
    total = sum(p.numel() for p in source.parameters())
    for loaded, after, read, pieces in run_on_ranks(_load_and_train, world, name, str(path)):
        assert max_param_diff(loaded, expected_loaded) == 0
        assert max_param_diff(after, expected) < 1e-6
        if name == "zero3" and suffix == ".safetensors":  # only the rows holding this rank's pieces
            assert read <= sum(length + 2 * row for length, row in pieces) and read < total / 2


def test_a_plain_model_loads_a_file_under_any_name_of_a_tied_weight(tmp_path):
    source = tiny_gpt(seed=1)
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "tokens.weight"}
    save_file(state, str(tmp_path / "w.safetensors"))
    torch.save(source.state_dict(), tmp_path / "w.pt")
    for file in ("w.safetensors", "w.pt"):
        model = tiny_gpt(seed=2)
        pt.load_weights(model, tmp_path / file)
        assert max_param_diff(model.state_dict(), source.state_dict()) == 0
        assert model.head.weight is model.tokens.weight
    model = tiny_gpt(seed=2)
    pt.load_weights(model, source.state_dict())  # a dict in memory
    assert max_param_diff(model.state_dict(), source.state_dict()) == 0


def test_a_directory_of_safetensors_shards_loads_as_one_file(tmp_path):
    source = tiny_gpt(seed=1)
    state = {k: v.clone() for k, v in source.state_dict().items() if k != "head.weight"}
    keys = sorted(state)
    save_file({k: state[k] for k in keys[:5]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in keys[5:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    model = tiny_gpt(seed=2)
    pt.load_weights(model, tmp_path)
    assert max_param_diff(model.state_dict(), source.state_dict()) == 0


def test_bad_keys_are_listed_together_and_nothing_is_loaded(tmp_path):
    state = tiny_gpt(seed=1).state_dict()
    state["ln.weight"] = torch.ones(3)  # mis-shaped
    del state["blocks.0.linear1.bias"]  # missing
    state["module.extra"] = torch.zeros(2)  # unexpected
    model = tiny_gpt(seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(pt.ConfigError, match=r"nothing was loaded: 1 mis-shaped: ln.weight: \(3,\) in the file, "
                                             r"\(16,\) in the model; 1 missing: blocks.0.linear1.bias; "
                                             r"1 unexpected: module.extra\. .*strip a prefix"):
        pt.load_weights(model, state)
    assert max_param_diff(model.state_dict(), before) == 0
    del state["ln.weight"]
    with pytest.raises(pt.ConfigError, match=r"2 missing: blocks.0.linear1.bias, ln.weight; 1 unexpected.*strict=False"):
        pt.load_weights(model, state)
    pt.load_weights(model, state, strict=False)  # what matches loads; the rest keeps its values
    assert torch.equal(model.ln.weight, before["ln.weight"])
    assert torch.equal(model.blocks[1].linear1.weight, state["blocks.1.linear1.weight"])


def test_unreadable_sources_say_what_to_pass(tmp_path):
    with pytest.raises(pt.ConfigError, match="there is no weights file at"):
        pt.load_weights(tiny_gpt(), tmp_path / "nope.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(pt.ConfigError, match="cannot read .*junk.safetensors as safetensors"):
        pt.load_weights(tiny_gpt(), tmp_path / "junk.safetensors")
    torch.save(tiny_gpt(), tmp_path / "module.pt")  # a pickled module, which weights_only refuses
    with pytest.raises(pt.ConfigError, match="cannot read .*module.pt as a torch state dict"):
        pt.load_weights(tiny_gpt(), tmp_path / "module.pt")
    with pytest.raises(pt.ConfigError, match="without .safetensors files"):
        pt.load_weights(tiny_gpt(), tmp_path / "..")


def _refused(topo, path: str):
    session = pt.Session(tiny_gpt_strategy("zero3"), topology=topo, progress_bar=False)
    model = tiny_gpt(seed=2)
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = session.full_state_dict()
    try:
        pt.load_weights(model, path)
    except pt.ConfigError as e:
        return str(e), max_param_diff(session.full_state_dict(), before)
    return None, None


def test_every_rank_refuses_a_file_only_some_ranks_read_a_bad_key_of(tmp_path):
    state = tiny_gpt(seed=1).state_dict()
    state["blocks.3.linear2.weight"] = torch.zeros(16, 31)  # in one unit: one rank's piece at most
    save_file({k: v.clone() for k, v in state.items() if k != "head.weight"}, str(tmp_path / "w.safetensors"))
    results = run_on_ranks(_refused, 3, str(tmp_path / "w.safetensors"))
    assert len({message for message, _ in results}) == 1
    assert "1 mis-shaped: blocks.3.linear2.weight: (16, 31) in the file, (16, 32) in the model" in results[0][0]
    assert all(diff == 0 for _, diff in results)


def _save_eager(topo, path: str):
    session = pt.Session(tiny_gpt_strategy("zero3"), topology=topo, progress_bar=False)
    model = tiny_gpt(seed=1)
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    session.save(path)


def _load_into_meta(topo, path: str):
    session = pt.Session(tiny_gpt_strategy("zero3"), topology=topo, progress_bar=False)
    with torch.device("meta"):
        model = TinyGPT()
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                  init_fn=lambda m: isinstance(m, TinyGPT) and nn.init.zeros_(m.positions))
    session.load(path)
    return session.full_state_dict()


def test_a_checkpoint_loads_into_a_meta_built_model_at_another_world_size(tmp_path):
    run_on_ranks(_save_eager, 2, str(tmp_path / "ckpt"))
    for state in run_on_ranks(_load_into_meta, 3, str(tmp_path / "ckpt")):
        assert max_param_diff(state, tiny_gpt(seed=1).state_dict()) == 0
