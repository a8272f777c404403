"""Bitwise resume beyond DDP in fp32 (test_checkpoint.py has that one): ZeRO-3, a pipeline, fp16
with its loss scale, a checkpoint taken in the middle of an accumulation, a loader with worker
processes, and augmentation drawn from torch, Python's random, NumPy and the loader's generator.

Each case trains `first` micro-batches, checkpoints, trains `then` more; a fresh session with
every random state moved elsewhere resumes from the checkpoint and trains the same `then`: its
parameters must equal the uninterrupted run's bit for bit."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import paratrain as pt
from paratrain.checkpoint import random_state as rs
from paratrain.components.precision import GradScaler
from paratrain.testing import assert_same_params, run_on_ranks
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
