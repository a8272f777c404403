"""Bitwise resume beyond DDP in fp32 (test_checkpoint.py has that one): ZeRO-3, a pipeline, fp16
with its loss scale, a checkpoint taken in the middle of an accumulation, a loader with worker
processes, and augmentation drawn from torch, Python's random, NumPy and the loader's generator.

Each case trains `first` micro-batches, checkpoints, trains `then` more; a fresh session with
every random state moved elsewhere resumes from the checkpoint and trains the same `then`: its
parameters must equal the uninterrupted run's bit for bit.

Then what a resume keeps and refuses: a prefetching loop resumes on the batch after the last one
trained; another optimizer class is refused unless only weights are loaded; a new learning rate is
named and can be kept; Adam's betas come back as the learning rate does."""

import functools
import itertools
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import paratrain as pt
from paratrain.checkpoint import random_state as rs
from paratrain.components.precision import GradScaler
from paratrain.testing import assert_same_params, max_param_diff, run_on_ranks
from tests.support.models import make_batches, make_model
from tests.support.pipeline_models import chain

GLOBAL_BATCH, SAMPLES = 8, 48  # 6 optimizer steps per epoch


class Jittered(Dataset):
    """Samples with noise added when loaded, from torch, Python's random and NumPy: in the
    training process (num_workers=0), or in the workers, seeded from the loader's generator."""

    def __init__(self, augment: bool):
        xs, ys = make_batches(1, SAMPLES, seed=7)
        self.x, self.y, self.augment = xs[0], ys[0], augment

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        if not self.augment:
            return self.x[i], self.y[i]
        noise = torch.randn(12) + random.gauss(0.0, 1.0) + float(np.random.standard_normal())
        return self.x[i] + 0.1 * noise, self.y[i]


CASES = {  # name: (Session arguments, model, loader arguments)
    "zero3": (dict(strategy=pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(torch.nn.Linear,)))),
              "dropout", {}),
    "pipeline": (dict(strategy=pt.Pipeline(stages=2, schedule="1f1b", microbatches=2)), "chain", {}),
    "fp16": (dict(strategy="ddp", precision="fp16", grad_scaler=None), "dropout", {}),
    "mid-accumulation": (dict(strategy="zero2", accumulate=2), "dropout", {}),
    "workers": (dict(strategy="ddp"), "dropout", dict(num_workers=2)),
    "augmented": (dict(strategy="ddp"), "mlp", dict(augment=True)),
    "augmented-in-workers": (dict(strategy="ddp"), "mlp", dict(augment=True, num_workers=2)),
}


def _session(topo, case):
    kwargs, name, data = CASES[case]
    kwargs = dict(kwargs)
    if "grad_scaler" in kwargs:  # a scale that grows every 2 steps: a resume must bring it back
        kwargs["grad_scaler"] = GradScaler(init_scale=2.0**10, growth_interval=2)
    session = pt.Session(**kwargs, topology=topo, progress_bar=False, seed=3)
    model = chain() if name == "chain" else make_model(name)
    loader = DataLoader(Jittered(data.get("augment", False)), batch_size=GLOBAL_BATCH // session.accumulate,
                        shuffle=True, num_workers=data.get("num_workers", 0))
    session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), loader)
    return session


def _epochs(session):
    while True:  # epoch after epoch, as a training loop does
        yield from session.progress(session.loader)


def _train_until(session, micro_step):
    """One uninterrupted loop until `micro_step` micro-batches are done (a run resumed inside an
    accumulation computes that accumulation's first micro-batches again)."""
    if not hasattr(session, "_test_batches"):
        session._test_batches = _epochs(session)
    while session.micro_step < micro_step:
        session.train_step(next(session._test_batches), F.cross_entropy)
    return session.full_state_dict()


def _resume(topo, root, case, first, then):
    straight = _session(topo, case)
    _train_until(straight, first)
    straight.checkpoint(root)
    expected = _train_until(straight, first + then)
    resumed = _session(topo, case)
    torch.manual_seed(99)  # whatever happened since, the checkpoint's states must win
    random.seed(99)
    np.random.seed(99)
    assert resumed.resume(root)
    got = _train_until(resumed, first + then)
    scales = [s.scaler.state_dict() if s.scaler else None for s in (straight, resumed)]
    return expected, got, scales


@pytest.mark.parametrize("case,first,then", [
    ("zero3", 4, 5), ("pipeline", 4, 5), ("fp16", 5, 4), ("mid-accumulation", 5, 9),
    ("workers", 4, 5), ("augmented", 4, 5),
    # workers draw augmentations from streams seeded when an epoch's pass starts, which a
    # checkpoint cannot hold: their runs resume bitwise from an epoch's end
    ("augmented-in-workers", 6, 7),
])
def test_resume_is_bitwise(tmp_path, case, first, then):
    for expected, got, (scale, resumed_scale) in run_on_ranks(_resume, 2, str(tmp_path), case, first, then):
        assert_same_params(got, expected, atol=0)
        assert resumed_scale == scale
        if case == "fp16":  # grown from 2^10 every 2 good steps: the loaded scale, not the initial one
            assert scale["scale"] > 2.0**10


def test_the_augmentation_really_draws_from_every_random_state():
    """Without restoring them the resumed data would differ: each source moves the samples."""
    data = Jittered(augment=True)
    for reseed in (lambda: torch.manual_seed(1), lambda: random.seed(1), lambda: np.random.seed(1)):
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        first = data[0][0]
        torch.manual_seed(0), random.seed(0), np.random.seed(0)
        reseed()
        assert not torch.equal(data[0][0], first)


def _same_numpy_state(a, b):
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_the_step_snapshot_is_get_state_after_any_draws():
    """rng_state() reads Python's and NumPy's states whole only when their generator words moved
    or a cached gaussian could have: after draws of every kind, odd numbers of gaussians (one is
    left cached, then used without moving a word) and reseeding, it equals getstate() and
    np.random.get_state() every time, and the words were read (not every state read whole)."""
    from paratrain.checkpoint.random_state import rng_state, rng_tensors, set_rng_state

    actions = [lambda: None, lambda: np.random.rand(3), lambda: np.random.standard_normal(),
               lambda: np.random.standard_normal(2), lambda: np.random.seed(5), lambda: np.random.randint(9),
               lambda: random.random(), lambda: random.gauss(0.0, 1.0), lambda: random.seed(5)]
    picks = random.Random(0)
    np.random.seed(0), random.seed(0)
    for _ in range(400):
        actions[picks.randrange(len(actions))]()
        state = rng_state()
        assert _same_numpy_state(state["numpy"], np.random.get_state()) and state["python"] == random.getstate()
    assert rs._NUMPY.memory and rs._PYTHON.memory, "every state was read whole"

    np.random.seed(2), random.seed(2)
    np.random.standard_normal(), random.gauss(0.0, 1.0)  # a gaussian left cached in each ...
    saved = rng_tensors(rng_state())
    assert rng_state()["numpy"][3] == 1 and rng_state()["python"][2] is not None
    np.random.standard_normal(), random.gauss(0.0, 1.0)  # ... and used: no word moved
    assert rng_state()["numpy"][3] == 0 and rng_state()["python"][2] is None
    set_rng_state(saved)  # our restore brings the cached gaussians back
    state = rng_state()
    assert _same_numpy_state(state["numpy"], np.random.get_state()) and np.random.get_state()[3] == 1
    assert state["python"] == random.getstate() and random.getstate()[2] is not None


def test_the_snapshot_reads_whole_where_the_words_are_elsewhere():
    """Words that do not match the state read whole (another layout) turn the cache off."""
    from paratrain.checkpoint.random_state import WatchedState

    python_state = WatchedState(random.getstate, lambda: rs._python_address() + 4, rs._python_words)
    numpy_state = WatchedState(rs._numpy_get, lambda: rs._numpy_address() + 4, rs._numpy_words)
    for draw in (lambda: None, lambda: (random.random(), np.random.rand())):
        draw()
        assert python_state.state() == random.getstate() and python_state.memory is False
        assert _same_numpy_state(numpy_state.state(), np.random.get_state()) and numpy_state.memory is False


XS, YS = make_batches(2, 8, seed=1)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _seeded_dataset(n=48):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))


# -- the data position counts batches trained on ---------------------------------------------------

def _prefetching_loop(topo, tmp, stop_after, accumulate, workers):
    """nanoGPT's habit: the next batch is fetched before this one's step. Checkpoint after
    `stop_after` micro-batches (None: run through), then resume from `tmp` in a new session."""
    states = []
    for attempt in ("first", "resumed") if stop_after is not None else ("only",):
        session = pt.Session("ddp", topology=topo, progress_bar=False, accumulate=accumulate, seed=5)
        model = make_model("dropout")
        loader = DataLoader(_seeded_dataset(), batch_size=4, shuffle=True, num_workers=workers)
        model, opt, loader = session.setup(model, _sgd(model), loader)
        if attempt == "resumed":
            assert session.resume(tmp)
        for epoch in range(session.epoch, 2):
            batches = iter(session.progress(loader))
            batch = next(batches, None)
            while batch is not None:
                upcoming = next(batches, None)  # fetched ahead of the step
                session.train_step(batch, F.cross_entropy)
                if attempt == "first" and session.micro_step == stop_after:
                    session.checkpoint(tmp)
                    break
                batch = upcoming
            else:
                continue
            break
        states.append(session.full_state_dict())  # (both sessions share the process group)
    return states[-1]


@pytest.mark.parametrize("stop_after,accumulate,workers", [(5, 1, 0), (5, 2, 0), (7, 3, 0)])
def test_a_prefetching_loop_resumes_on_the_batch_after_the_last_trained(tmp_path, stop_after, accumulate, workers):
    """(5, 2) and (7, 3): checkpointed mid-accumulation, the window is trained again from its
    start. (Loader workers cannot start inside run_on_ranks' daemonic ranks.)"""
    whole = run_on_ranks(_prefetching_loop, 2, str(tmp_path / "a"), None, accumulate, workers)
    resumed = run_on_ranks(_prefetching_loop, 2, str(tmp_path / "b"), stop_after, accumulate, workers)
    for a, b in itertools.product(whole, resumed):
        assert max_param_diff(a, b) == 0


# -- resuming with another optimizer, or another learning rate ------------------------------------

def _train_and_save(path, optimizer_class, lr):
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, opt = session.setup(model, optimizer_class(model.parameters(), lr=lr))
        session.train_step((XS[0], YS[0]), F.cross_entropy)
        session.save(path)
        return session.full_state_dict()


def test_resuming_into_another_optimizer_class_is_refused_unless_weights_only(tmp_path):
    saved = _train_and_save(tmp_path / "adam", torch.optim.Adam, 0.01)
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(pt.ConfigError, match="holds the state of a torch.optim.adam.Adam.*weights_only=True"):
            session.load(tmp_path / "adam")
        session.load(tmp_path / "adam", weights_only=True)
        assert max_param_diff(session.full_state_dict(), saved) == 0
        assert not opt.state and opt.param_groups[0]["lr"] == 0.1 and session.micro_step == 0


def test_a_new_learning_rate_at_resume_is_named_and_can_be_kept(tmp_path):
    _train_and_save(tmp_path / "sgd", torch.optim.SGD, 0.1)
    for policy, lr in [("checkpoint", 0.1), ("current", 0.02)]:
        with pt.Session("single", progress_bar=False) as session:
            model = make_model("mlp")
            model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.02))
            if policy == "checkpoint":
                with pytest.warns(UserWarning, match="replaces this optimizer's lr 0.02 → 0.1"):
                    session.load(tmp_path / "sgd")
            else:
                session.load(tmp_path / "sgd", hyperparameters=policy)
            assert opt.param_groups[0]["lr"] == lr and session.micro_step == 1


def test_adams_betas_come_back_from_the_checkpoint_as_the_learning_rate_does(tmp_path):
    """A tuple hyperparameter (Adam's betas) is saved and restored, as a tuple, and a new value of
    yours is named like a new learning rate (it was dropped at save: yours won, silently)."""
    _train_and_save(tmp_path / "adam", functools.partial(torch.optim.Adam, betas=(0.8, 0.9)), 0.01)
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, opt = session.setup(model, torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.5)))
        with pytest.warns(UserWarning, match=r"replaces this optimizer's betas \(0.5, 0.5\) → \[0.8, 0.9\]"):
            session.load(tmp_path / "adam")
        assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    with pt.Session("single", progress_bar=False) as session:  # the same betas: nothing to name
        model = make_model("mlp")
        model, opt = session.setup(model, torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            session.load(tmp_path / "adam")
