"""Misuse a user of a training library would hit, each a clear paratrain error that says what went
wrong and what to do: the session's own cases, most one row of a table. The finite check's are in
test_finite_check.py, a checkpoint's in tests/checkpoint/, a launch's in tests/launch/."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.testing import RankFailure, run_on_ranks
from tests.support.models import make_batches, make_model

XS, YS = make_batches(2, 4, seed=1)
BATCH = (XS[0], YS[0])


def _dataset(n=8):
    return TensorDataset(torch.randn(n, 12), torch.randint(0, 5, (n,)))


@contextlib.contextmanager
def _session(strategy="single", **kwargs):
    session = pt.Session(strategy, progress_bar=False, **kwargs)
    try:
        yield session
    finally:
        session.close()


def _setup(session, with_optimizer=True):
    model = make_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if with_optimizer else None
    return session.setup(model, optimizer)


# -- one process -----------------------------------------------------------------------------------

def _setup_twice(session, tmp_path):
    model, optimizer = _setup(session)
    session.setup(model, optimizer)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))


def _stream_without_batch_size(session, tmp_path):
    model = make_model("mlp")
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_Stream(), batch_size=None))


def _scheduler_before_setup(session, tmp_path):
    model = make_model("mlp")
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)  # steps an optimizer ZeRO replaces
    session.setup(model, optimizer)


def _step_without_optimizer(session, tmp_path):
    _setup(session, with_optimizer=False)
    session.train_step(BATCH, F.cross_entropy)


def _load_before_setup(session, tmp_path):
    session.load(tmp_path / "step-00000001")


def _load_missing_checkpoint(session, tmp_path):
    _setup(session)
    session.load(tmp_path / "no-such-checkpoint")


def _log_without_log_dir(session, tmp_path):
    session.log(loss=1.0)


def _zero_without_optimizer(session, tmp_path):
    _setup(session, with_optimizer=False)


def _register_without_state(session, tmp_path):
    session.register(epochs=10)


class _Opaque:
    def state_dict(self):
        return {"fn": print}

    def load_state_dict(self, state):
        pass


def _register_state_that_is_not_json(session, tmp_path):
    _setup(session)
    session.register(opaque=_Opaque())
    session.save(tmp_path / "c")


def _load_without_a_registered_object(session, tmp_path):
    _, optimizer = _setup(session)
    session.save(tmp_path / "c")
    session.register(scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    session.load(tmp_path / "c")


SESSION_CASES = [  # (case, Session arguments, what the user does, error, message)
    ("setup twice", {}, _setup_twice, pt.UsageError, "setup\\(\\) was already called"),
    ("stream without batch_size", {}, _stream_without_batch_size, pt.ConfigError,
     "a loader over an IterableDataset needs a batch_size"),
    ("scheduler before setup", dict(strategy="zero1"), _scheduler_before_setup, pt.ConfigError,
     "scheduler was created on the optimizer before setup\\(\\), but zero1 replaces"),
    ("step without optimizer", {}, _step_without_optimizer, pt.UsageError,
     "step\\(\\) needs an optimizer: pass it to session.setup"),
    ("load before setup", {}, _load_before_setup, pt.UsageError, "call session.setup"),
    ("missing checkpoint", {}, _load_missing_checkpoint, pt.ConfigError,
     "no checkpoint at .*no-such-checkpoint: nothing exists there"),
    ("log without log_dir", {}, _log_without_log_dir, pt.UsageError, "Session\\(log_dir=...\\)"),
    ("zero3 without optimizer", dict(strategy="zero3"), _zero_without_optimizer, pt.ConfigError,
     "zero3 shards the optimizer: pass it"),
    ("register without state", {}, _register_without_state, pt.UsageError,
     "register\\(epochs=...\\) takes objects with state_dict\\(\\) and load_state_dict\\(\\).*got int"),
    ("registered state not JSON", {}, _register_state_that_is_not_json, pt.ConfigError,
     "state_dict\\(\\) of registered object 'opaque' is not JSON"),
    ("registered after save", {}, _load_without_a_registered_object, pt.ConfigError,
     "holds no state for registered object\\(s\\) \\['scheduler'\\]: it was saved before"),
]


@pytest.mark.parametrize("case,kwargs,action,error,message", SESSION_CASES, ids=[c[0] for c in SESSION_CASES])
def test_session_misuse(case, kwargs, action, error, message, tmp_path):
    with _session(**kwargs) as session:
        with pytest.raises(error, match=message):
            action(session, tmp_path)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_grad_norm=0.0), "max_grad_norm must be a positive norm to clip to; got 0.0"),
    (dict(max_grad_norm=-1.0), "max_grad_norm must be a positive norm"),
    (dict(timeout=0), "timeout must be a positive number of seconds; got 0"),
    (dict(accumulate=0), "accumulate must be at least 1"),
])
def test_bad_session_settings(kwargs, message):
    with pytest.raises(pt.ConfigError, match=message):
        pt.Session("single", **kwargs)


def test_a_timeout_from_the_environment_must_be_a_number(monkeypatch):
    monkeypatch.setenv("PARATRAIN_TIMEOUT", "ten minutes")
    with pytest.raises(pt.ConfigError, match="PARATRAIN_TIMEOUT='ten minutes' is not a number"):
        pt.Session("single")


def test_a_scheduler_on_an_optimizer_setup_keeps_is_fine():
    with _session() as session:
        model = make_model("mlp")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        _, same = session.setup(model, optimizer)
        session.train_step(BATCH, F.cross_entropy)
        scheduler.step()
        assert same is optimizer and same.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("settings", [{}, {"max_grad_norm": 1.0}, {"precision": "fp16"}, {"strategy": "ddp"},
                                      {"strategy": "zero3"}], ids=["plain", "clip", "fp16", "ddp", "zero3"])
@pytest.mark.parametrize("graph", [True, False], ids=["through-gradients", "detached"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_stops_before_the_optimizer_steps(bad, graph, settings):
    # detached: a non-finite term with no path to the parameters leaves every gradient finite,
    # so only the loss itself tells (under fp16 a non-finite gradient is an overflow, skipped).
    # ddp and zero3 (world 1) answer the gradients' check from their reductions' sums.
    with _session(**settings) as session:
        model, _ = _setup(session)
        session.train_step(BATCH, F.cross_entropy)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        term = (lambda loss: loss * bad) if graph else (lambda loss: loss + torch.tensor(bad))
        with pytest.raises(pt.UsageError, match=f"the loss is {bad} at optimizer step 1 \\(micro-batch 1, "
                                                "epoch 0\\) on rank 0; the optimizer did not step"):
            session.train_step(BATCH, lambda out, y: term(F.cross_entropy(out, y)))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("accumulate", [1, 3])
def test_a_non_finite_loss_in_a_custom_step_stops_at_the_step_naming_its_micro_batch(accumulate):
    # the losses are read at the optimizer step, with the gradients (one wait for the device),
    # not after each forward: the micro-batch is named there, before the optimizer steps
    with _session(accumulate=accumulate) as session:
        model, _ = _setup(session)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        for i in range(accumulate):
            with session.accumulation():
                bad = float("nan") if i == accumulate - 2 or accumulate == 1 else 1.0
                session.backward(F.cross_entropy(model(XS[i % 2]), YS[i % 2]) * bad)
            if i < accumulate - 1:
                assert not session.step()
        micro = max(accumulate - 2, 0)
        with pytest.raises(pt.UsageError, match=f"the loss is nan at optimizer step 0 \\(micro-batch {micro}, "):
            session.step()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert session._losses.items == []  # read once: a later step does not report it again


def test_nan_check_off_lets_the_loss_through():
    with _session(nan_check=False) as session:
        model, _ = _setup(session)
        loss = session.train_step(BATCH, lambda out, y: F.cross_entropy(out, y) * float("nan"))
        assert loss.isnan() and all(p.isnan().all() for p in model.parameters())


# -- on ranks ----------------------------------------------------------------------------------------

def _on_ranks(topo, case, path):
    session = pt.Session("ddp", topology=topo, progress_bar=False)
    model = make_model("mlp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if case == "batch smaller than the world":
        session.setup(model, optimizer, DataLoader(_dataset(), batch_size=1))


@pytest.mark.parametrize("case,message", [
    ("batch smaller than the world", "ConfigError: the global batch size 1 must be a multiple of the 2 "
                                     "data-parallel replicas; use a batch size of 2"),
])
def test_misuse_on_ranks(case, message, tmp_path):
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(_on_ranks, 2, case, str(tmp_path / "c"), timeout=60)


def _nan_loss_on_one_rank(topo, strategy):
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = {k: v.clone() for k, v in session.full_state_dict().items()}
    scale = float("nan") if topo.rank == 1 else 1.0
    try:
        for x, y in zip(XS, YS):
            session.train_step((x[:2], y[:2]), lambda out, t: F.cross_entropy(out, t) * scale)
    except pt.UsageError as e:
        unchanged = all(torch.equal(before[k], v) for k, v in session.full_state_dict().items())
        return str(e), session.micro_step, unchanged
    return None, session.micro_step, False


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_nan_loss_on_one_rank_stops_both_at_the_first_step_and_that_rank_names_it(strategy):
    # the averaged (or reduced) gradients are NaN on both ranks: both stop before the optimizer
    # steps; the rank whose loss it was names the micro-batch, the other points at its peers
    (msg0, steps0, same0), (msg1, steps1, same1) = run_on_ranks(_nan_loss_on_one_rank, 2, strategy, timeout=60)
    assert steps0 == steps1 == 1 and same0 and same1
    assert msg1.startswith("the loss is nan at optimizer step 0 (micro-batch 0, epoch 0) on rank 1; the optimizer "
                           "did not step"), msg1
    assert msg0.startswith("a gradient is NaN or infinite although the loss was finite"), msg0
    assert "another rank's error may name a non-finite loss" in msg0


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- stepping the optimizer given to setup, not the one it returned -------------------------------

def _old_optimizer(topo, strategy):
    session = pt.Session(pt.Pipeline(stages=2, microbatches=2) if strategy == "pipeline" else strategy,
                         topology=topo, progress_bar=False)
    model = make_model("mlp").net if strategy == "pipeline" else make_model("mlp")
    old = _sgd(model)
    model, new = session.setup(model, old)
    for group in old.param_groups:  # an lr change through the old one reaches the new one
        group["lr"] = 0.05
    lrs = [g["lr"] for g in new.param_groups]
    session.train_step(BATCH, F.cross_entropy)
    try:
        old.step()
        return lrs, None
    except pt.UsageError as e:
        return lrs, str(e)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "pipeline"])
def test_stepping_the_replaced_optimizer_is_refused(strategy):
    for lrs, error in run_on_ranks(_old_optimizer, 2, strategy):
        assert lrs and set(lrs) == {0.05}
        assert error is not None and ("step the optimizer setup() returned" in error
                                      or "use the optimizer that" in error)


# -- the step's contract ---------------------------------------------------------------------

def test_several_accumulation_blocks_before_one_step_are_refused():
    with pt.Session("single", accumulate=2, progress_bar=False) as session:
        model = make_model("mlp")
        model, _ = session.setup(model, _sgd(model))
        with session.accumulation():
            session.backward(F.cross_entropy(model(XS[0]), YS[0]))
        with pytest.raises(pt.UsageError, match="entered again before session.step"):
            with session.accumulation():
                pass


@pytest.mark.parametrize("loss_fn,message", [
    (lambda out, y: None, "returned None: a model called without labels"),
    (lambda out, y: F.cross_entropy(out, y, reduction="none"), r"returned \(4,\), not a scalar"),
])
def test_a_loss_function_that_returns_no_scalar_is_named(loss_fn, message):
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, _ = session.setup(model, _sgd(model))
        with pytest.raises(pt.UsageError, match=message):
            session.train_step((BATCH), loss_fn)
