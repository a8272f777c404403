"""Checkpoints of a tensor-parallel model keep each cut parameter under its whole shape
(checkpoint/layout.py), so they load at another tp, another data-parallel strategy and world,
and into one process: bitwise, and training on from one equals training without stopping.
float64 with Adam, as test_tensor_parallel.py says why."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.distributed.topology import free_port
from paratrain.testing import run_on_ranks
from tests.support.llama import llama, lm_loss, token_batches

BATCH, SAVED_AT, STEPS = 4, 2, 3
MODEL = dict(tied=True, bias=True, kv_heads=4)  # a tied embedding and LM head; biases cut and not; tp 4
PLAN = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
        "layers.*.attn.o": "rowwise", "layers.*.mlp.gate": "colwise", "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise", "embed": "rowwise", "lm_head": "colwise_rep"}


def data():
    batches = token_batches(STEPS, BATCH)
    return TensorDataset(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))


def reference(steps):
    model = llama(**MODEL)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in list(DataLoader(data(), batch_size=BATCH))[:steps]:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def strategy(name):
    return {"tp2 x zero3": pt.Mesh(tp=2, dp="zero3", tp_plan=PLAN), "tp2 x ddp": pt.Mesh(tp=2, tp_plan=PLAN),
            "tp4": pt.Mesh(tp=4, dp="zero2", tp_plan=PLAN), "ddp": pt.Mesh(), "single": "single",
            "tp2 x pp2": pt.Mesh(tp=2, tp_plan=PLAN, pp=pt.Pipeline(stages=2, microbatches=2, layers="layers"))}[name]


def session_run(topo, name, load=None, save=None, steps=0):
    """Set up under `name`, load `load`, train `steps`, save `save`: the whole state after each."""
    with pt.Session(strategy=strategy(name), topology=topo, progress_bar=False) as session:
        model = llama(**MODEL)
        session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                      DataLoader(data(), batch_size=BATCH, shuffle=False))
        states = []
        state = lambda: {k: v.clone() for k, v in session.full_state_dict().items()}  # noqa: E731 (not the live tensors)
        if load is not None:
            session.load(load)
            states.append(state())
        batches = iter(session.progress(session.loader))
        for _ in range(steps):
            session.train_step(next(batches), lm_loss)
        if save is not None:
            session.save(save)
        states.append(state())
        port = pt.broadcast_object(free_port() if topo.rank == 0 else None) if topo.world_size > 1 else None
    return dict(states=states, port=port)


def chain(topo, runs):
    """Each run in turn, a fresh session on a fresh port."""
    out = []
    for kwargs in runs:
        out.append(session_run(topo, **kwargs))
        topo = dataclasses.replace(topo, master_port=out[-1]["port"])
    return out


def assert_equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (k, (got[k] - want[k]).abs().max().item())


@pytest.mark.parametrize("saver", ["tp2 x zero3", "tp2 x pp2"])
def test_a_tensor_parallel_checkpoint_loads_at_another_tp_and_back_bitwise(tmp_path, saver):
    """Saved at tp2 × dp2, loaded at tp1 × dp4 and saved again, loaded back at tp2 and at tp4:
    the same values bitwise each time; training on from each matches one process's three steps."""
    first, again = str(tmp_path / "tp2"), str(tmp_path / "ddp")
    runs = [dict(name=saver, save=first, steps=SAVED_AT), dict(name="ddp", load=first, save=again),
            dict(name="tp2 x ddp", load=again, steps=STEPS - SAVED_AT), dict(name="tp4", load=first)]
    saved, ddp, back, tp4 = run_on_ranks(chain, 4, runs, timeout=300)[0]
    one = run_on_ranks(session_run, 1, "single", load=again, steps=STEPS - SAVED_AT)[0]
    assert_equal(ddp["states"][0], saved["states"][0])
    for loaded in (back, tp4, one):
        assert_equal(loaded["states"][0], saved["states"][0])
    expected = reference(STEPS)
    for trained in (back, one):
        for k, v in expected.items():
            assert torch.allclose(trained["states"][-1][k], v, atol=1e-10, rtol=0), k


def weights_into(topo, name, path):
    """A fresh model under `name`, given the weights file `path` (each rank reads its slice)."""
    with pt.Session(strategy=strategy(name), topology=topo, progress_bar=False) as session:
        model = llama(**MODEL)
        model, _ = session.setup(model, torch.optim.Adam(model.parameters()))
        pt.load_weights(model, path)
        return session.full_state_dict()


def test_a_tensor_parallel_checkpoint_exports_whole_tensors_and_they_load_back(tmp_path):
    """`paratrain ckpt export` of a tp2 × zero3 checkpoint: the plain model's state dict, which
    `pt.load_weights` reads back into tp2 × zero3 and tp4, each rank its own boxes."""
    from safetensors.torch import load_file

    from paratrain.checkpoint.export import export_checkpoint

    path = str(tmp_path / "tp2")
    saved = run_on_ranks(session_run, 4, "tp2 x zero3", save=path, steps=SAVED_AT)[0]["states"][0]
    export_checkpoint(path, tmp_path / "model.safetensors")
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert_equal(exported, saved)
    model = llama(**MODEL)
    model.load_state_dict(exported)  # strict: every key, the tied head's too
    assert F.mse_loss(model.lm_head.weight, model.embed.weight) == 0
    for name in ("tp2 x zero3", "tp4"):
        assert_equal(run_on_ranks(weights_into, 4, name, str(tmp_path / "model.safetensors"))[0], saved)


def format_1_into_tp(topo, path):
    from paratrain import checkpoint

    checkpoint.save_load.FORMAT = 1  # as paratrain before tensor parallelism saved: flattened
    topo = dataclasses.replace(topo, master_port=session_run(topo, "ddp", save=path)["port"])
    checkpoint.save_load.FORMAT = 2
    try:
        session_run(topo, "tp2 x ddp", load=path)
    except pt.ConfigError as e:
        return str(e)


def test_a_format_1_checkpoint_is_refused_by_a_tensor_parallel_model_with_what_to_do(tmp_path):
    for message in run_on_ranks(format_1_into_tp, 2, str(tmp_path / "old")):
        assert "format 1" in message and "load it without tp and save it again" in message
