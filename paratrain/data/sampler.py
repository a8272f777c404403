"""Data sharding: a resumable distributed sampler, the per-rank batch size, a seeded partitioner.

[Note: one global order per epoch]
Every rank builds the same permutation of range(n) from a `torch.Generator` seeded with
seed + epoch, exactly as `torch.utils.data.DistributedSampler` does, so that without a resume the
two yield the same indices. Rank r of R takes order[r::R]: once every rank has drawn k indices,
exactly order[:k*R] has been consumed. That is what makes a resume independent of the world size:
a checkpoint only records how far into the order the epoch got (`consumed`), and the rest,
order[consumed:], is split anew over however many ranks resume it.

Padding (drop_last=False) repeats the global order cyclically from its start, as torch does; this
keeps a resume under the same world size exact, padding included. drop_last=True instead cuts the
remaining order down to a multiple of R.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, Sequence, Sized

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler, Subset

from paratrain.errors import ConfigError

_STATE_KEYS = ("epoch", "seed", "shuffle", "drop_last", "consumed", "dataset_len")


class DistributedSampler(Sampler[int]):
    """Each rank's disjoint share of a map-style dataset, reshuffled every epoch and resumable.

    The arguments follow `torch.utils.data.DistributedSampler`, in the same order, so that changing
    the import is enough to port a script.

    dataset: a dataset with `len()`, or just its length.
    num_replicas: ranks sharing the data; default: the default group's world size, else 1.
    rank: this rank among them; default: the default group's rank, else 0.
    shuffle: a new permutation every epoch; False: the dataset's order.
    seed: shared by every rank; the epoch's order comes from seed + epoch.
    drop_last: cut the tail so every rank gets the same count, instead of padding with repeats.

    Resuming: `state_dict()` (the same on every rank; save rank 0's) records the epoch and how many
    samples of its order all ranks together have consumed; `load_state_dict()` makes the next pass
    continue from there, under any world size. Alone, the count comes from indices this sampler
    has handed out, which is exact with a `DataLoader(num_workers=0)` and a loop that fetches no
    batch ahead. A Session counts instead the batches whose optimizer step completed
    (`ShardedLoader`), which is exact with workers and with loops that prefetch.
    """

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        super().__init__()
        self.dataset_len = _length(dataset)
        self.num_replicas, self.rank = _replicas_and_rank(num_replicas, rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        self._reset_position()

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next pass follows; a new epoch starts at its beginning.

        Setting the epoch a loaded state is already in keeps the loaded position, so the usual
        `load_state_dict(sd); for epoch in range(sd["epoch"], …): set_epoch(epoch)` loop resumes.
        """
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._reset_position()

    def set_position(self, consumed: int) -> None:
        """Make the next pass start `consumed` samples into this epoch's global order."""
        if not 0 <= int(consumed) <= self.dataset_len:
            raise ConfigError(f"position {consumed} is outside this epoch of {self.dataset_len} samples: "
                              f"pass the number of samples all ranks together consumed, 0 … {self.dataset_len}")
        self._pending = int(consumed)

    @property
    def consumed(self) -> int:
        """Samples of this epoch's order consumed by all ranks together; padding is not counted."""
        if self._pending is not None:
            return self._pending
        if self._exhausted:  # a finished pass has used the whole epoch, drop_last's tail included
            return self.dataset_len
        return min(self._start + self._yielded * self.num_replicas, self.dataset_len)

    def state_dict(self, per_replica_samples: int | None = None) -> dict[str, int | bool]:
        """Plain ints and bools: where this epoch stands, identical on every rank at the same step.
        `per_replica_samples`: count the pass in progress as this many samples per replica from
        its start (what a Session has trained on), instead of the indices handed out."""
        consumed = self.consumed
        if per_replica_samples is not None:
            consumed = min(self._pass_start_or_next() + per_replica_samples * self.num_replicas, self.dataset_len)
        return dict(epoch=self.epoch, seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last,
                    consumed=consumed, dataset_len=self.dataset_len)

    def load_state_dict(self, state: dict) -> None:
        """Continue the saved epoch at its saved position; the world size may differ from the saver's."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ConfigError(f"sampler state lacks {missing}: pass what DistributedSampler.state_dict() returned")
        if int(state["dataset_len"]) != self.dataset_len:
            raise ConfigError(
                f"the sampler state was saved for a dataset of {state['dataset_len']} samples, but this one has "
                f"{self.dataset_len}: resume with the same dataset, or skip load_state_dict() and call "
                f"set_epoch({state['epoch']}) to start that epoch from its beginning")
        consumed = int(state["consumed"])
        self.set_position(consumed)  # checks the range before anything else is changed
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])
        self.shuffle, self.drop_last = bool(state["shuffle"]), bool(state["drop_last"])
        self._reset_position()
        self._pending = consumed

    def __iter__(self) -> Iterator[int]:
        # A generator: the position is taken when the first index is requested, not at iter().
        start = self._pending if self._pending is not None else 0
        self._reset_position()
        self._start = start
        for index in self._rank_indices(start):
            # Counted when handed out: with num_workers=0 that is exactly what has been trained on.
            self._yielded += 1
            yield index
        self._exhausted = True

    def __len__(self) -> int:
        """Indices this rank yields in the pass in progress, or else in the next pass."""
        return self._steps(self.dataset_len - self._pass_start())

    def global_order(self) -> torch.Tensor:
        """This epoch's permutation of range(len(dataset)), the same on every rank."""
        if not self.shuffle:
            return torch.arange(self.dataset_len)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_len, generator=generator)

    def _rank_indices(self, start: int) -> list[int]:
        order = self.global_order()
        total = self._steps(self.dataset_len - start) * self.num_replicas
        pad = start + total - self.dataset_len
        if pad > 0:  # repeat the order from its start, as torch does (see the Note above)
            order = torch.cat([order, order.repeat(math.ceil(pad / self.dataset_len))[:pad]])
        return order[start:start + total][self.rank::self.num_replicas].tolist()

    def _steps(self, remaining: int) -> int:
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def _pass_start(self) -> int:
        if self._pending is not None:
            return self._pending
        return 0 if self._exhausted else self._start

    def _pass_start_or_next(self) -> int:
        """Where the pass in progress started; before any pass, where the next one will."""
        return self._start if (self._yielded or self._exhausted) else (self._pending or 0)

    def _reset_position(self) -> None:
        self._pending: int | None = None  # where the next pass starts; None: at 0
        self._start = 0  # where the current pass started in the global order
        self._yielded = 0  # indices this rank has handed out in the current pass
        self._exhausted = False  # the current pass ran to its end


def per_rank_batch_size(global_batch_size: int, num_replicas: int | None = None) -> int:
    """The batch each rank loads so that all ranks together make `global_batch_size`."""
    world, _ = _replicas_and_rank(num_replicas, None)
    if global_batch_size < 1 or global_batch_size % world:
        lower = max(world, global_batch_size // world * world)
        raise ConfigError(f"a global batch of {global_batch_size} does not split evenly over {world} ranks: "
                          f"choose a multiple of {world}, e.g. {lower} or {lower + world}")
    return global_batch_size // world


def partition_indices(length: int, fractions: Sequence[float], *, seed: int = 0) -> list[list[int]]:
    """Split range(length), shuffled by `seed`, into parts of the given fractions.

    Each part gets floor(fraction × length); the samples left over go one each to the parts with
    the largest fractional remainders (ties to the earlier part), so sizes sum to `length` and
    each is within one of its exact share.
    """
    fractions = _check_fractions(fractions)
    total = sum(fractions)  # within 1e-6 of 1; dividing by it keeps the floors from overshooting
    exact = [f / total * length for f in fractions]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (sizes[i] - exact[i], i))
    for i in by_remainder[:length - sum(sizes)]:
        sizes[i] += 1
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    order = torch.randperm(length, generator=generator).tolist()
    bounds = [0, *itertools.accumulate(sizes)]
    return [order[a:b] for a, b in zip(bounds, bounds[1:])]


def partition(dataset: Dataset, fractions: Sequence[float], *, seed: int = 0) -> list[Subset]:
    """Split a dataset into disjoint `Subset`s of the given fractions (see `partition_indices`)."""
    return [Subset(dataset, part) for part in partition_indices(_length(dataset, allow_empty=True),
                                                                fractions, seed=seed)]


def _check_fractions(fractions: Sequence[float]) -> list[float]:
    fractions = [float(f) for f in fractions]
    if not fractions or any(not math.isfinite(f) or f <= 0 for f in fractions):
        raise ConfigError(f"fractions must be positive numbers, one per part; got {fractions}")
    if abs(sum(fractions) - 1.0) > 1e-6:
        raise ConfigError(f"fractions must sum to 1; got {fractions}, which sum to {sum(fractions):.6g}")
    return fractions


def _length(dataset: Sized | int, allow_empty: bool = False) -> int:
    if isinstance(dataset, int):
        n = dataset
    else:
        try:
            n = len(dataset)
        except TypeError:
            raise ConfigError(f"{type(dataset).__name__} has no len(): pass a map-style dataset or its "
                              "length (an IterableDataset must shard itself by rank)") from None
    if n < 0 or (n == 0 and not allow_empty):
        raise ConfigError(f"the dataset is empty (length {n}): there is nothing to shard over ranks")
    return n


def _replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    # Defaults come from the default group when one exists; a single process is rank 0 of 1,
    # so world size 1 runs the same code as world size N.
    initialised = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    if num_replicas < 1:
        raise ConfigError(f"num_replicas must be at least 1; got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ConfigError(f"rank {rank} is not inside {num_replicas} replicas: use 0 … {num_replicas - 1}")
    return int(num_replicas), int(rank)
