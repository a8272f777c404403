"""Hybrid sharding (`pt.ZeRO(stage=S, replicate=R)`, `pt.Mesh(dp="zeroS", replicate=R)`): ZeRO
within groups of world / R ranks, each gradient slice all-reduced across the R groups, proved
against one process on the same global batches, with every replica's shards equal."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import free_port
from paratrain.parallel.zero import OwnerCollectives
from paratrain.testing import assert_same_params, run_on_ranks
from tests.support.models import make_batches, make_model, make_optimizer, reference, train_on_rank

STEPS, GLOBAL_BATCH = 3, 16


def _hybrid(topo, name, optim, replicate, accumulate, forced, stage=3):
    """ZeRO `stage` of `name` over the grid's "shard" groups, replicated over its "replicate" ones."""
    topo = topo.init(timeout=60)
    grid = ProcessGrid(topo, replicate=replicate)
    model = make_model(name)
    model, opt = pt.shard(model, make_optimizer(optim, model.parameters()), stage=stage,
                          wrap_policy=pt.WrapPolicy(module_classes=(torch.nn.Linear,)),
                          process_group=grid.group("shard")[0], replicate_group=grid.group("replicate")[0],
                          collectives=OwnerCollectives(reduce_scatter=True, all_gather=True) if forced else None)
    assert (model.replicas, model.replica_index) == (topo.world_size, topo.rank)
    train_on_rank(topo, model, opt, steps=STEPS, global_batch=GLOBAL_BATCH, accumulate=accumulate)
    state = pt.full_state_dict(model)
    shards = [s.detach().clone() for s in model.shards]
    # one forward of the same rows everywhere: it starts from the buffers every rank was given
    # (DDP's rule, across the groups too) and moves them alike, so they end equal on every rank
    model(make_batches(1, 8, seed=11)[0][0])
    buffers = [b.clone() for b in model.modules_buffers]
    pt.destroy()
    return state, shards, grid.ranks("replicate"), buffers


CASES = [("mlp", "adam", 2, 1, False, 3), ("tied", "sgd", 2, 2, False, 3), ("bn", "adam", 2, 1, False, 3),
         ("tied", "adam", 2, 1, True, 3), ("mlp", "sgd", 4, 1, False, 3),  # replicate 4: shards of one rank
         ("bn", "adam", 2, 1, False, 2), ("tied", "sgd", 2, 2, True, 2), ("mlp", "adam", 2, 2, False, 1),
         ("tied", "adam", 4, 1, False, 1)]


@pytest.mark.parametrize("name,optim,replicate,accumulate,forced,stage", CASES)
def test_hybrid_sharding_matches_one_process_and_its_replicas_hold_equal_shards(name, optim, replicate, accumulate,
                                                                               forced, stage):
    ours = run_on_ranks(_hybrid, 4, name, optim, replicate, accumulate, forced, stage)
    ref = reference(name, optim, world=4, accumulate=accumulate, steps=STEPS, global_batch=GLOBAL_BATCH)
    for state, _, _, _ in ours:
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)
    for rank, (_, shards, replicas, buffers) in enumerate(ours):
        for other in replicas:  # the ranks holding this rank's shards in the other groups
            assert all(torch.equal(a, b) for a, b in zip(shards, ours[other][1])), (rank, other)
        assert all(torch.equal(a, b) for a, b in zip(buffers, ours[0][3])), rank


def data():
    xs, ys = make_batches(1, 48, seed=7)
    return TensorDataset(xs[0], ys[0])


def session_run(topo, strategy, load=None, save=None, steps=0):
    """Through the session: set up, load, train, save; the whole state after, and the next port."""
    with pt.Session(strategy, topology=topo, progress_bar=False, seed=3) as session:
        model = make_model("bn")
        session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                      DataLoader(data(), batch_size=8, shuffle=True))
        if load is not None:
            session.load(load)
        batches = iter(session.progress(session.loader))
        for _ in range(steps):
            session.train_step(next(batches), F.cross_entropy)
        if save is not None:
            session.save(save)
        state = {k: v.clone() for k, v in session.full_state_dict().items()}
        port = pt.broadcast_object(free_port() if topo.rank == 0 else None) if topo.world_size > 1 else None
    return state, port


def chain(topo, runs):
    out = []
    for strategy, kwargs in runs:
        out.append(session_run(topo, strategy, **kwargs))
        topo = dataclasses.replace(topo, master_port=out[-1][1])
    return out


@pytest.mark.parametrize("stage", [3, 2])
def test_a_hybrid_checkpoint_loads_into_ddp_and_back_and_training_goes_on_as_without_stopping(tmp_path, stage):
    """Saved by replicate 2 × shard 2 (BatchNorm statistics included), loaded by DDP at 4 and by
    one process; DDP's checkpoint loaded back by hybrid sharding; each then trains on exactly as
    the uninterrupted hybrid run."""
    hybrid, saved, again = pt.ZeRO(stage=stage, replicate=2), str(tmp_path / "hybrid"), str(tmp_path / "ddp")
    runs = [(hybrid, dict(save=saved, steps=2)), ("ddp", dict(load=saved, save=again, steps=0)),
            (hybrid, dict(load=again, steps=2)), (hybrid, dict(steps=4))]
    first, ddp, resumed, straight = run_on_ranks(chain, 4, runs, timeout=300)[0]
    one = run_on_ranks(session_run, 1, "single", load=saved)[0][0]
    assert_same_params(ddp[0], first[0], atol=0)
    assert_same_params(one, first[0], atol=0)
    assert_same_params(resumed[0], straight[0], atol=1e-6)


def mesh_replicas(topo, dp="zero3"):
    with pt.Session(pt.Mesh(dp=dp, replicate=2), topology=topo, progress_bar=False) as session:
        model = make_model("mlp")
        model, _, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                         DataLoader(data(), batch_size=8))
        return model.replicas, model.replica_index, len(loader)


def test_mesh_replicate_reads_a_quarter_of_the_data_on_each_of_four_ranks_and_refuses_what_it_lacks():
    for dp in ("zero3", "zero1"):
        assert sorted(run_on_ranks(mesh_replicas, 4, dp)) == [(4, r, 6) for r in range(4)]
    for kwargs, words in [(dict(dp="ddp", replicate=2), r"it takes dp='zero1', 'zero2' or 'zero3' \(got 'ddp'\)"),
                          (dict(dp="zero3", replicate=2, cp=2), "does not compose with pp or cp yet"),
                          (dict(dp="zero3", replicate=0), "a positive integer; got 0")]:
        with pytest.raises(pt.ConfigError, match=words):
            pt.Mesh(**kwargs)
    with pytest.raises(pt.ConfigError, match=r"ZeRO\(replicate=...\) is the number of groups"):
        pt.ZeRO(stage=2, replicate=0)
