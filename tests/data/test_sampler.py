import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from paratrain.data.sampler import DistributedSampler, partition, partition_indices, per_rank_batch_size
from paratrain.errors import ConfigError
from paratrain.testing import run_on_ranks

FAST = settings(max_examples=60, deadline=None)


def shards(n, world, epoch=0, **kw):
    """Every rank's indices for one uninterrupted epoch."""
    out = []
    for rank in range(world):
        sampler = DistributedSampler(n, num_replicas=world, rank=rank, **kw)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def interleave(per_rank):
    """The order in which the ranks consumed the global order: step by step, rank by rank."""
    return [i for step in zip(*per_rank) for i in step]


def draw(samplers, steps):
    """Each rank draws `steps` indices and stops, as a loop that is checkpointed mid-epoch."""
    return [list(itertools.islice(iter(s), steps)) for s in samplers]


def make(n, world, **kw):
    return [DistributedSampler(n, num_replicas=world, rank=r, **kw) for r in range(world)]


sizes = st.integers(1, 60)
worlds = st.integers(1, 6)
flags = st.booleans()


@FAST
@given(n=sizes, world=worlds, shuffle=flags, drop_last=flags, seed=st.integers(0, 2**31), epoch=st.integers(0, 5))
def test_without_a_resume_it_yields_what_torch_does(n, world, shuffle, drop_last, seed, epoch):
    ours = shards(n, world, epoch, shuffle=shuffle, seed=seed, drop_last=drop_last)
    for rank in range(world):
        theirs = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank,
                                                     shuffle=shuffle, seed=seed, drop_last=drop_last)
        theirs.set_epoch(epoch)
        assert ours[rank] == list(theirs)


@FAST
@given(n=sizes, world=worlds, shuffle=flags, seed=st.integers(0, 100))
def test_padding_covers_every_sample_and_only_repeats(n, world, shuffle, seed):
    per_rank = shards(n, world, shuffle=shuffle, seed=seed)
    steps = -(-n // world)
    assert all(len(indices) == steps for indices in per_rank)
    seen = interleave(per_rank)
    assert sorted(seen[:n]) == list(range(n))  # the first n consumed are the whole dataset, once
    assert set(seen[n:]) <= set(range(n)) and len(seen) - n < world  # then fewer than `world` repeats


@FAST
@given(n=sizes, world=worlds, shuffle=flags, seed=st.integers(0, 100))
def test_drop_last_is_disjoint_with_equal_lengths(n, world, shuffle, seed):
    per_rank = shards(n, world, shuffle=shuffle, seed=seed, drop_last=True)
    assert all(len(indices) == n // world for indices in per_rank)
    seen = [i for indices in per_rank for i in indices]
    assert len(set(seen)) == len(seen) == n - n % world


@FAST
@given(n=sizes, world=worlds, drop_last=flags)
def test_len_is_what_each_rank_yields(n, world, drop_last):
    for sampler in make(n, world, drop_last=drop_last):
        assert len(sampler) == len(list(sampler))


def test_each_epoch_has_its_own_order_and_an_epoch_repeats_exactly():
    orders = [interleave(shards(50, 2, epoch, seed=7)) for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert orders[1] == interleave(shards(50, 2, 1, seed=7))
    assert interleave(shards(50, 2, 1, seed=8)) != orders[1]


def test_without_shuffle_ranks_take_the_dataset_order_in_turn():
    assert shards(7, 3, shuffle=False) == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    assert shards(7, 3, shuffle=False, drop_last=True) == [[0, 3], [1, 4], [2, 5]]


@FAST
@given(n=sizes, world=worlds, shuffle=flags, drop_last=flags, data=st.data())
def test_resume_under_the_same_world_continues_exactly(n, world, shuffle, drop_last, data):
    kw = dict(shuffle=shuffle, drop_last=drop_last, seed=3)
    full = shards(n, world, 2, **kw)
    steps = data.draw(st.integers(0, len(full[0])))
    before = make(n, world, **kw)
    for s in before:
        s.set_epoch(2)
    head = draw(before, steps)
    states = [s.state_dict() for s in before]
    assert all(state == states[0] for state in states)  # any rank's state will do
    after = make(n, world, shuffle=not shuffle, seed=99)  # the state, not the constructor, decides the order
    for s in after:
        s.load_state_dict(json.loads(json.dumps(states[0])))  # plain ints and bools survive JSON
        s.set_epoch(2)  # the usual loop calls it again; it must keep the loaded position
    tail = [list(s) for s in after]
    assert [h + t for h, t in zip(head, tail)] == full


@FAST
@given(n=sizes, old=worlds, new=worlds, shuffle=flags, data=st.data())
def test_resume_under_another_world_sees_every_sample_once(n, old, new, shuffle, data):
    order = interleave(shards(n, 1, 1, shuffle=shuffle))  # one rank yields the global order itself
    before = make(n, old, shuffle=shuffle)
    for s in before:
        s.set_epoch(1)
    steps = data.draw(st.integers(0, len(before[0])))
    head = interleave(draw(before, steps))
    consumed = before[0].state_dict()["consumed"]
    assert consumed == min(steps * old, n)  # padding is not counted
    after = make(n, new)
    for s in after:
        s.load_state_dict(before[0].state_dict())
    tails = [list(s) for s in after]
    assert len({len(t) for t in tails}) == 1  # every new rank takes the same number of steps
    tail = interleave(tails)
    # Real samples first, padding after: together they are the epoch's order, each sample once.
    assert head[:consumed] + tail[:n - consumed] == order
    assert len(tail) - (n - consumed) < new


@FAST
@given(n=sizes, old=worlds, new=worlds, data=st.data())
def test_resume_under_another_world_with_drop_last_never_repeats(n, old, new, data):
    order = interleave(shards(n, 1))
    before = make(n, old, drop_last=True)
    steps = data.draw(st.integers(0, n // old))
    head = interleave(draw(before, steps))
    after = make(n, new)
    for s in after:
        s.load_state_dict(before[0].state_dict())
    tails = [list(s) for s in after]
    assert len({len(t) for t in tails}) == 1
    seen = head + interleave(tails)
    left = n - steps * old
    assert seen == order[:steps * old + left - left % new]  # no repeats, only the tail dropped


def test_after_the_resumed_epoch_the_next_starts_from_the_beginning():
    sampler = DistributedSampler(20, num_replicas=2, rank=1, seed=5)
    sampler.set_epoch(3)
    state = dict(sampler.state_dict(), consumed=12)
    sampler.load_state_dict(state)
    assert len(sampler) == 4 and sampler.consumed == 12
    assert list(sampler) == shards(20, 2, 3, seed=5)[1][6:]
    assert sampler.consumed == 20 and len(sampler) == 10
    assert list(sampler) == shards(20, 2, 3, seed=5)[1]  # iterating again: the same epoch afresh
    sampler.load_state_dict(state)
    sampler.set_epoch(4)  # a new epoch drops the loaded position
    assert list(sampler) == shards(20, 2, 4, seed=5)[1]


def test_a_finished_drop_last_pass_leaves_nothing_of_its_epoch():
    sampler = DistributedSampler(10, num_replicas=4, rank=0, drop_last=True)
    assert len(list(sampler)) == 2
    state = sampler.state_dict()
    assert state["consumed"] == 10  # the dropped tail is over with, not pending
    resumed = DistributedSampler(10, num_replicas=1, rank=0)
    resumed.load_state_dict(state)
    assert list(resumed) == []


def test_set_position_is_an_explicit_resume_for_loops_that_prefetch():
    sampler = DistributedSampler(20, num_replicas=4, rank=2)
    sampler.set_position(8)
    assert list(sampler) == shards(20, 4)[2][2:]


def test_the_counter_is_exact_with_a_single_process_dataloader():
    dataset = TensorDataset(torch.arange(30))
    samplers = make(30, 2, seed=1)
    loaders = [DataLoader(dataset, batch_size=4, sampler=s) for s in samplers]
    head = [int(x) for loader in loaders for (batch,) in itertools.islice(loader, 2) for x in batch]
    state = samplers[0].state_dict()
    assert state["consumed"] == 2 * 4 * 2 == len(set(head))
    resumed = make(30, 3)
    tail = []
    for sampler in resumed:
        sampler.load_state_dict(state)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler)
        assert len(loader) == 2  # 14 samples left: 5 per rank, in batches of 4 and 1
        tail += [int(x) for (batch,) in loader for x in batch]
    assert len(tail) == 15 and sorted(set(head + tail)) == list(range(30))


@pytest.mark.parametrize("kwargs,message", [
    (dict(dataset=10, num_replicas=0), "num_replicas must be at least 1"),
    (dict(dataset=10, num_replicas=2, rank=2), "rank 2 is not inside 2 replicas"),
    (dict(dataset=10, num_replicas=2, rank=-1), "rank -1"),
    (dict(dataset=0), "empty"),
    (dict(dataset=TensorDataset(torch.zeros(0))), "empty"),
    (dict(dataset=iter(range(3))), "has no len"),
])
def test_bad_arguments_are_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DistributedSampler(**kwargs)


def test_bad_positions_and_states_are_config_errors():
    sampler = DistributedSampler(10, num_replicas=1, rank=0)
    for position in (-1, 11):
        with pytest.raises(ConfigError, match="outside this epoch of 10"):
            sampler.set_position(position)
    other = DistributedSampler(12, num_replicas=1, rank=0).state_dict()
    with pytest.raises(ConfigError, match="dataset of 12 samples, but this one has 10"):
        sampler.load_state_dict(other)
    with pytest.raises(ConfigError, match="lacks"):
        sampler.load_state_dict({"epoch": 1})
    with pytest.raises(ConfigError, match="position 11 is outside"):
        sampler.load_state_dict(dict(sampler.state_dict(), epoch=3, consumed=11))
    assert sampler.consumed == 0 and sampler.epoch == 0  # a refused state changes nothing


def test_per_rank_batch_size():
    assert per_rank_batch_size(32, 4) == 8
    with pytest.raises(ConfigError, match="multiple of 4, e.g. 28 or 32"):
        per_rank_batch_size(30, 4)


fraction_lists = st.lists(st.integers(1, 20), min_size=1, max_size=5).map(lambda w: [x / sum(w) for x in w])


@FAST
@given(n=st.integers(0, 200), fractions=fraction_lists, seed=st.integers(0, 100))
def test_partition_is_complete_disjoint_proportional_and_deterministic(n, fractions, seed):
    parts = partition_indices(n, fractions, seed=seed)
    assert sorted(i for part in parts for i in part) == list(range(n))
    assert all(abs(len(part) - f * n) < 1 for part, f in zip(parts, fractions))
    assert partition_indices(n, fractions, seed=seed) == parts


def test_partition_of_a_dataset_gives_subsets():
    dataset = TensorDataset(torch.arange(100))
    train, val = partition(dataset, [0.8, 0.2], seed=1)
    assert (len(train), len(val)) == (80, 20)
    values = [int(x[0]) for x in train] + [int(x[0]) for x in val]
    assert sorted(values) == list(range(100)) and values != list(range(100))  # shuffled, complete
    assert partition(dataset, [0.8, 0.2], seed=2)[0].indices != train.indices
    assert [len(p) for p in partition(dataset, [1 / 3] * 3)] == [34, 33, 33]


def test_partition_gives_the_leftovers_to_the_largest_remainders():
    assert [len(p) for p in partition_indices(5, [0.25, 0.25, 0.5])] == [1, 1, 3]
    assert [len(p) for p in partition_indices(3, [0.1, 0.9])] == [0, 3]


@pytest.mark.parametrize("fractions", [[0.5, 0.6], [1.2, -0.2], [1.0, 0.0], [], [float("nan")]])
def test_bad_fractions_are_config_errors(fractions):
    with pytest.raises(ConfigError, match="fractions must"):
        partition_indices(10, fractions)


def _shard_on_rank(topo):
    dataset = TensorDataset(torch.arange(10))
    sampler = DistributedSampler(dataset, seed=4)  # world and rank from the initialised group
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    return sampler.num_replicas, sampler.rank, [int(x) for (batch,) in loader for x in batch]


def test_real_ranks_each_load_a_disjoint_share():
    (world0, rank0, a), (world1, rank1, b) = run_on_ranks(_shard_on_rank, 2)
    assert (world0, rank0, world1, rank1) == (2, 0, 2, 1)
    assert len(a) == len(b) == 5 and sorted(a + b) == list(range(10))
    assert [a, b] == shards(10, 2, seed=4)
