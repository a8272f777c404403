"""Gradient accumulation through Session: k micro-batches per rank equal one batch k × world
times larger on one process — for plain mean losses, and for losses averaged over a varying number
of valid tokens (`weight=`), where the micro-batches and the ranks hold different token counts."""

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.testing import assert_same_params, run_on_ranks
from tests.support.models import make_model

STEPS, K, WORLD, PER_MICRO = 3, 4, 2, 3  # global batch: WORLD × K × PER_MICRO sequences
SEQ, PAD = 5, -100


def _data(step: int):
    """One global batch of sequences: x (G, SEQ, 12), y (G, SEQ) with a padded tail of a
    different length in every sequence (some sequences fully valid, one almost empty)."""
    g = torch.Generator().manual_seed(100 + step)
    n = WORLD * K * PER_MICRO
    x = torch.randn(n, SEQ, 12, generator=g)
    y = torch.randint(0, 5, (n, SEQ), generator=g)
    valid = torch.randint(1, SEQ + 1, (n,), generator=g)
    y[torch.arange(SEQ) >= valid[:, None]] = PAD
    return x, y


def token_mean(out, y):
    """Mean cross-entropy over the valid tokens of a padded batch."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=PAD)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference():
    """One process, the whole global batch at once: the mean over every valid token."""
    model = make_model("mlp")
    optimizer = _sgd(model.parameters())
    for step in range(STEPS):
        token_mean(model(_data(step)[0]), _data(step)[1]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _train(topo, strategy, mode):
    """mode "weighted": weight=valid tokens; "plain": every token valid, no weight (plain means
    of equal micro-batches); "unweighted": padded tokens without weight= (the wrong way)."""
    session = pt.Session(strategy, accumulate=K, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, _sgd(model.parameters()))
    for step in range(STEPS):
        x, y = _data(step)
        if mode == "plain":
            y = y.clamp(min=0)
        for micro in range(K):  # rank r reads rows [r·K·B, (r+1)·K·B), B rows per micro-batch
            rows = slice((topo.rank * K + micro) * PER_MICRO, (topo.rank * K + micro + 1) * PER_MICRO)
            weight = (y[rows] != PAD).sum() if mode == "weighted" else None
            session.train_step((x[rows], y[rows]), token_mean, weight=weight)
    return session.full_state_dict()


def _plain_reference():
    model = make_model("mlp")
    optimizer = _sgd(model.parameters())
    for step in range(STEPS):
        x, y = _data(step)
        token_mean(model(x), y.clamp(min=0)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_k_micro_batches_equal_one_big_batch(strategy):
    for mode, expected in (("plain", _plain_reference()), ("weighted", reference())):
        for state in run_on_ranks(_train, WORLD, strategy, mode):
            assert_same_params(state, expected, atol=1e-6)  # measured: at most 3.0e-8


def test_token_counts_differ_and_matter():
    """The data really is uneven: averaging each micro-batch's own mean (no weight=) trains a
    visibly different model, so the weighted parity above is not an accident."""
    counts = [(y != PAD).sum().item() for y in _data(0)[1].split(PER_MICRO)]
    assert len(set(counts)) > 1
    state = run_on_ranks(_train, WORLD, "ddp", "unweighted")[0]
    with pytest.raises(AssertionError, match="max difference"):  # measured: 1.2e-2 apart
        assert_same_params(state, reference(), atol=1e-4)


def _single_session(accumulate, strategy="single"):
    session = pt.Session(strategy, accumulate=accumulate, progress_bar=False)
    model = make_model("mlp").net  # an nn.Sequential, which a pipeline can cut
    session.setup(model, _sgd(model.parameters()))
    return session


def test_weight_on_some_micro_batches_only_is_an_error():
    session = _single_session(accumulate=2)
    try:
        x, y = _data(0)
        session.train_step((x[:3], y[:3]), token_mean, weight=(y[:3] != PAD).sum())
        with pytest.raises(pt.UsageError, match="1 micro-batch.*passed weight= and 1 did not"):
            session.train_step((x[3:6], y[3:6]), token_mean)
    finally:
        session.close()


@pytest.mark.parametrize("strategy,name", [(pt.Pipeline(stages=1, microbatches=1), "pipeline"),
                                           (pt.DP(devices=("cpu", "cpu"), balanced=True), "dp")])
def test_weight_with_a_strategy_that_cuts_the_batch_itself_is_refused(strategy, name):
    """A pipeline's micro-batches, and balanced DataParallel's chunk losses (weighted by rows:
    it trained with another gradient than one process before), cannot take a batch's weight."""
    session = _single_session(accumulate=1, strategy=strategy)
    try:
        x, y = _data(0)
        with pytest.raises(pt.UsageError, match=f"weight= is not supported with strategy '{name}'"):
            session.train_step((x[:3], y[:3]), token_mean, weight=3)
    finally:
        session.close()
