"""Ranks given batches of different sizes (data/batch.py): warned once, mended by weighting each
rank's loss by its rows; pipeline stages given different sizes are named."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import paratrain as pt
from paratrain.testing import RankFailure, max_param_diff, run_on_ranks
from tests.support.models import make_model
from tests.support.pipeline_models import chain


def _dataset(n=48):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))


def _uneven(topo, strategy, sizes, weighted):
    """Two steps where rank r holds sizes[r] rows of one 20-row batch per step: the warnings
    rank 0 and the others heard, and the parameters after."""
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = _dataset(sum(sizes) * 2).tensors
    mine = slice(sum(sizes[: topo.rank]), sum(sizes[: topo.rank + 1]))
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        for x, y in zip(xs.chunk(2), ys.chunk(2)):  # two steps of sum(sizes) rows
            session.train_step((x[mine], y[mine]), F.cross_entropy, weight=len(x[mine]) if weighted else None)
    said = [str(w.message) for w in heard if issubclass(w.category, pt.UnevenBatchWarning)]
    return said, session.full_state_dict()


def _one_process_on(rows):
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = _dataset(rows * 2).tensors
    for x, y in zip(xs.chunk(2), ys.chunk(2)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("strategy, sizes", [("ddp", (16, 4)), ("zero3", (16, 4)), ("ddp", (6, 6, 3))])
def test_ranks_given_batches_of_different_sizes_are_warned_once_and_weight_mends_it(strategy, sizes):
    """A mean of means, silently, is what torch's DDP trains; rank 0 names the sizes and weight=,
    and weight=len(batch) then trains what one process does on the same rows."""
    heard = run_on_ranks(_uneven, len(sizes), strategy, sizes, False)
    rank0 = heard[0][0]
    assert len(rank0) == 1, rank0  # once, at the first step
    assert rank0[0].startswith(f"the ranks were given batches of different sizes ({sizes[0]} rows on rank"), rank0
    assert f"{min(sizes)} rows on rank {sizes.index(min(sizes))}" in rank0[0] and "weight=" in rank0[0], rank0
    assert all(not said for said, _ in heard[1:])  # rank 0 speaks for all
    reference = _one_process_on(sum(sizes))
    assert max_param_diff(heard[0][1], reference) > 1e-3  # the mean of means is not one process's step
    weighted = run_on_ranks(_uneven, len(sizes), strategy, sizes, True)
    assert all(not said for said, _ in weighted)
    assert max_param_diff(weighted[0][1], reference) < 1e-5


def test_ranks_given_batches_of_one_size_hear_nothing():
    assert all(not said for said, _ in run_on_ranks(_uneven, 2, "ddp", (8, 8), False))


def _uneven_pipeline(topo):
    session = pt.Session(pt.Pipeline(stages=2, microbatches=2), topology=topo, progress_bar=False)
    model = chain()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _dataset(16 if topo.rank == 0 else 4).tensors
    session.train_step((x, y), F.cross_entropy)


def test_pipeline_stages_given_batches_of_different_sizes_are_named():
    with pytest.raises(RankFailure, match=r"every stage of a pipeline must be given the same batch, and they differ: "
                                          r"stage 0 \(pipeline rank 0\) cut micro-batches of shapes \[\[8, 12\]\] "
                                          r"from its batch, stage 1 \(pipeline rank 1\) micro-batches of shapes "
                                          r"\[\[2, 12\]\]"):
        run_on_ranks(_uneven_pipeline, 2, timeout=60)
