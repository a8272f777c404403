"""Loaders beyond a map-style dataset with a batch size: a batch sampler's global batches, and
streams (IterableDataset), each cut into equal, disjoint shares that cover the data, resumable."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

import paratrain as pt
import paratrain.data.loader as loader_module
from paratrain.data.loader import ShardedStream, shard_loader
from paratrain.errors import ConfigError
from paratrain.testing import RankFailure, max_param_diff, run_on_ranks

N = 50  # items: not a multiple of the replicas, so a last incomplete row exists


class Stream(IterableDataset):
    """Items 0 … N-1 as (features, label), the whole stream on every call."""

    def __iter__(self):
        g = torch.Generator().manual_seed(4)
        for i in range(N):
            yield torch.randn(6, generator=g) + i % 3, torch.tensor(i % 3), torch.tensor(i)


def _as_worker(monkeypatch, worker, workers):
    info = None if workers == 1 else type("Info", (), {"id": worker, "num_workers": workers})()
    monkeypatch.setattr(loader_module, "get_worker_info", lambda: info)


@pytest.mark.parametrize("replicas,workers", [(2, 1), (3, 1), (3, 2)])
def test_a_stream_is_cut_into_equal_disjoint_shares_that_cover_it(monkeypatch, replicas, workers):
    shares = []
    for replica in range(replicas):
        mine = []
        for worker in range(workers):
            _as_worker(monkeypatch, worker, workers)
            mine += [int(i) for _, _, i in ShardedStream(Stream(), replicas, replica, batch_size=2)]
        shares.append(sorted(mine))
    assert len({len(s) for s in shares}) == 1  # every replica takes as many steps
    taken = sorted(i for s in shares for i in s)
    assert taken == list(range(N // replicas * replicas))  # disjoint, and all but the incomplete last row


@pytest.mark.parametrize("workers,skip", [(1, 3), (2, 3), (2, 4)])
def test_a_stream_resumed_skips_exactly_the_batches_trained(monkeypatch, workers, skip):
    """The loader hands out the workers' batches in turn; a resumed pass must start at batch
    `skip` of that order."""
    def in_order(skip):
        per_worker = []
        for worker in range(workers):
            _as_worker(monkeypatch, worker, workers)
            stream = ShardedStream(Stream(), 2, 0, batch_size=2)
            stream.skip = skip
            items = [int(i) for _, _, i in stream]
            per_worker.append([items[j:j + 2] for j in range(0, len(items), 2)])
        return [b for turn in zip(*per_worker) for b in turn]  # the loader's round robin
    assert in_order(skip)[:3] == in_order(0)[skip:skip + 3]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _train_stream(topo, root, stop_after):
    """Two epochs over the stream, global batch 4; checkpoint after `stop_after` steps and resume."""
    states = []
    for attempt in ("first", "resumed") if stop_after else ("only",):
        session = pt.Session("ddp", topology=topo, progress_bar=False)
        model = _model()
        model, _, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         DataLoader(Stream(), batch_size=4))
        if attempt == "resumed":
            assert session.resume(root)
        done = False
        for _ in range(session.epoch, 2):
            for x, y, _ in session.progress(loader):
                session.train_step((x, y), F.cross_entropy)
                if attempt == "first" and session.micro_step == stop_after:
                    session.checkpoint(root)
                    done = True
                    break
            if done:
                break
        states.append(session.full_state_dict())
    return states[-1]


def test_training_on_a_stream_resumes_mid_epoch_bitwise(tmp_path):
    whole = run_on_ranks(_train_stream, 2, str(tmp_path / "a"), 0)
    resumed = run_on_ranks(_train_stream, 2, str(tmp_path / "b"), 7)
    assert max_param_diff(whole[0], resumed[0]) == 0 and max_param_diff(resumed[0], resumed[1]) == 0


def _batch_sampler_shares(topo, seeded):
    data = TensorDataset(torch.arange(40))
    generator = torch.Generator().manual_seed(1) if seeded else None
    if not seeded:
        torch.manual_seed(topo.rank)  # each rank's own global RNG: each draws other batches
    sampler = BatchSampler(RandomSampler(data, generator=generator), batch_size=8, drop_last=False)
    loader = shard_loader(DataLoader(data, batch_sampler=sampler), replicas=2, index=topo.rank, seed=0, rank=topo.rank)
    return [b[0].tolist() for b in loader]


def test_a_batch_sampler_is_cut_batch_by_batch_and_must_agree_across_ranks():
    mine, theirs = run_on_ranks(_batch_sampler_shares, 2, True)
    assert len(mine) == len(theirs) == 5
    for a, b in zip(mine, theirs):
        assert len(a) == len(b) == 4 and not set(a) & set(b)
    assert sorted(i for batch in mine + theirs for i in batch) == list(range(40))
    with pytest.raises(RankFailure, match="different global batches on different ranks"):
        run_on_ranks(_batch_sampler_shares, 2, False, timeout=60)


def _order_of(loader: DataLoader, replicas: int = 1, index: int = 0, epoch: int = 0) -> list[int]:
    sharded = shard_loader(loader, replicas=replicas, index=index, seed=0, rank=index)
    sharded.set_epoch(epoch)
    return [int(i) for batch in sharded for i in batch[-1]]


@pytest.mark.parametrize("sampler", [
    lambda data: SubsetRandomSampler(range(10)),
    lambda data: WeightedRandomSampler([1.0] * 5 + [0.0] * 35, num_samples=8),
    lambda data: RandomSampler(data, replacement=True),
    lambda data: RandomSampler(data, num_samples=12),
], ids=["subset", "weighted", "replacement", "num_samples"])
def test_a_sampler_that_chooses_its_samples_is_refused_not_replaced(sampler):
    data = TensorDataset(torch.arange(40))
    with pytest.raises(ConfigError, match=r"would replace this loader's \w+Sampler.*Subset.*batch_sampler"):
        shard_loader(DataLoader(data, batch_size=4, sampler=sampler(data)), replicas=2, index=0, seed=0, rank=0)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_ported_scripts_distributed_sampler_keeps_its_shuffle_and_seed(replicas):
    """A torch DDP script's loader (torch's DistributedSampler, shuffle=True, its seed): each
    replica reads what torch's sampler would give it, epoch by epoch (the global batch is the
    loader's batch_size, cut between the replicas)."""
    data = TensorDataset(torch.arange(40))
    for index in range(replicas):
        for epoch in (0, 1):
            theirs = TorchDistributedSampler(data, num_replicas=replicas, rank=index, shuffle=True, seed=7)
            theirs.set_epoch(epoch)
            given = TorchDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=7)
            assert _order_of(DataLoader(data, batch_size=3 * replicas, sampler=given), replicas, index,
                             epoch) == list(theirs)
    ordered = TorchDistributedSampler(data, num_replicas=1, rank=0, shuffle=False)
    assert _order_of(DataLoader(data, batch_size=4, sampler=ordered)) == list(range(40))
    ours, theirs = (cls(data, num_replicas=1, rank=0, shuffle=True, seed=7)
                    for cls in (pt.DistributedSampler, TorchDistributedSampler))
    theirs.set_epoch(1)
    assert _order_of(DataLoader(data, batch_size=4, sampler=ours), epoch=1) == list(theirs)
    assert _order_of(DataLoader(data, batch_size=4, shuffle=False)) == list(range(40))


def test_a_loader_without_automatic_batching_is_refused_with_what_to_pass():
    data = TensorDataset(torch.arange(40))
    with pytest.raises(ConfigError, match="batch_size=None and no batch_sampler.*global batch_size"):
        shard_loader(DataLoader(data, batch_size=None), replicas=2, index=0, seed=0, rank=0)


def test_iterating_the_training_loader_itself_reshuffles_each_epoch_as_progress_does():
    """A loop that iterates the loader setup() returned (no session.progress) gets a new order on
    every complete pass, as the DataLoader(shuffle=True) it replaced did, and the same orders as
    the loop through progress(); a pass broken off does not end the epoch."""
    data = TensorDataset(torch.randn(16, 6), torch.arange(16))
    orders = {}
    for how in ("itself", "progress"):
        session = pt.Session("single", progress_bar=False)
        model = _model()
        _, _, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                     DataLoader(data, batch_size=4, shuffle=True))
        passes = []
        for _ in range(3):
            passes.append([int(i) for _, y in (loader if how == "itself" else session.progress(loader))
                           for i in y])
        assert session.epoch == 3
        for _ in loader:
            break
        assert session.epoch == 3
        session.close()
        orders[how] = passes
    assert orders["itself"] == orders["progress"]
    assert all(sorted(p) == list(range(16)) for p in orders["itself"])
    assert len({tuple(p) for p in orders["itself"]}) == 3


def test_a_resumed_stream_with_persistent_workers_skips_only_in_the_resumed_pass():
    """Persistent loader workers keep their copy of the stream between passes: the batches a
    resumed pass skips must not be skipped again by the next epoch."""
    loader = shard_loader(DataLoader(Stream(), batch_size=4, num_workers=2, persistent_workers=True),
                          replicas=1, index=0, seed=0, rank=0)
    loader.load_position({"kind": "batches", "batches": 3})
    firsts = [[int(i[0]) for _, _, i in loader] for _ in range(3)]
    assert firsts == [list(range(12, N, 4)), list(range(0, N, 4)), list(range(0, N, 4))]


@pytest.mark.parametrize("kind", ["stream", "batch_sampler"])
def test_a_pass_resumed_twice_counts_the_batches_skipped_the_first_time(kind):
    """A run resumed at batch 3 of a pass trains two more and checkpoints again: that
    checkpoint's position is batch 5, not 2 (which would train batches 2-4 twice)."""
    data = TensorDataset(torch.arange(40))
    given = (DataLoader(Stream(), batch_size=4) if kind == "stream" else
             DataLoader(data, batch_sampler=BatchSampler(range(40), 4, drop_last=False)))
    loader = shard_loader(given, replicas=1, index=0, seed=0, rank=0)
    loader.load_position({"kind": "batches", "batches": 3})
    assert loader.position() == {"kind": "batches", "batches": 3}  # saved again before a step
    batches = iter(loader)
    for _ in range(2):
        next(batches)
        loader.count_trained(optimizer_stepped=True)
    assert loader.position() == {"kind": "batches", "batches": 5}
    assert int(next(batches)[-1][0]) == 20
