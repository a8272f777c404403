"""torch.compile under the session: a model compiled before or after setup trains as the
eager model does, checkpoints and exports with the model's own keys; a pipeline refuses one."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.testing import max_param_diff, run_on_ranks
from tests.support.models import make_batches, make_model, resumed_mlp_state


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _compiled(topo, strategy, when, tmp, backend):
    """Train 3 steps with the model compiled before or after setup (dynamo's "eager" backend: the
    tracing is real, no C++ compiler needed; "inductor" also generates and compiles C++ kernels),
    checkpoint and export, and return what a user sees, and whether setup warned of an eager forward."""
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    if when == "before":
        model = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = session.setup(model, _sgd(model))
    warned = any("trains a torch.compile'd model correctly but uncompiled" in str(w.message) for w in caught)
    if when == "after":
        model = torch.compile(model, backend=backend)
    xs, ys = make_batches(3, 8)
    for x, y in zip(xs, ys):
        x, y = x.chunk(topo.world_size)[topo.rank], y.chunk(topo.world_size)[topo.rank]
        session.train_step((x, y), lambda out, t: F.cross_entropy(out, t)) if when != "after" else \
            _manual_step(session, model, x, y)
    session.checkpoint(tmp)
    session.export(f"{tmp}/model.safetensors")
    return session.full_state_dict(), sorted(session.unwrap().state_dict()), warned


def _manual_step(session, compiled, x, y):
    with session.accumulation():
        session.backward(F.cross_entropy(compiled(x), y))
    session.step()


def _reference_mlp(steps=3):
    model = make_model("mlp")
    opt = _sgd(model)
    for x, y in zip(*make_batches(steps, 8)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("strategy,when,backend", [("ddp", "before", "eager"), ("ddp", "before", "inductor"),
                                                    ("zero3", "before", "eager"), ("zero3", "after", "eager")])
def test_compiled_models_train_checkpoint_and_export_with_the_models_own_keys(strategy, when, backend, tmp_path):
    from safetensors.torch import load_file

    reference = _reference_mlp()
    expected = sorted(reference.state_dict())
    ranks = run_on_ranks(_compiled, 2, strategy, when, str(tmp_path), backend, timeout=300)
    for state, unwrapped_keys, warned in ranks:
        # measured: 1.5e-8, with either backend
        assert sorted(state) == expected and max_param_diff(state, reference.state_dict()) < 1e-6
        assert warned == (strategy == "zero3" and when == "before")  # an eager zero3 forward is said at setup
        if strategy == "ddp":
            assert unwrapped_keys == expected  # session.unwrap() is the model itself, not the compiled wrapper
    plain = make_model("mlp")
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)  # no _orig_mod. keys
    restored = run_on_ranks(resumed_mlp_state, 1, str(tmp_path))[0]  # resumed without compile
    assert max_param_diff(restored, reference.state_dict()) < 1e-6


def test_a_compiled_model_cannot_be_cut_into_pipeline_stages():
    topo = pt.Topology.from_env({}, rank=0, world_size=2)
    with pytest.raises(pt.ConfigError, match="compile the layers in place"):
        pt.Pipeline(stages=2).setup(torch.compile(make_model("mlp").net), None, pt.ProcessGrid(topo))
