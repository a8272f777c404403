"""The loader a Session trains from: the user's loader rebuilt so each data-parallel replica
reads its share of every global batch, counting what it handed out and what was trained on (so
a checkpoint records the right position), and moving batches to the device.

Three kinds of loader, each sharded by its own rule (every replica takes the same number of
steps, so no rank waits in a collective for one that ran out):

    DataLoader(dataset, batch_size=B)       a DistributedSampler: each replica reads B / replicas
                                            samples of every global batch (data/sampler.py)
    DataLoader(dataset, batch_sampler=S)    each global batch S yields is cut into `replicas`
                                            equal, consecutive parts; replica r takes part r.
                                            S must yield the same batches on every rank
                                            (checked on each pass's first batch)
    DataLoader(iterable_dataset, batch_size=B)  the stream, read whole by every replica (and every
                                            loader worker), is cut into rows of `replicas` items:
                                            replica r keeps the row's r-th item; loader worker w
                                            of W makes batches w, w+W, …; a last, incomplete row
                                            is dropped, so the shares are equal

A loader's own sampler is kept only for what it says about the order: a RandomSampler or a
DistributedSampler that shuffles (its seed too), a SequentialSampler or one that does not. Any
other sampler chooses its samples (a subset, weights, draws with replacement), which a
DistributedSampler over the whole dataset would silently change: setup refuses it and says how to
keep it (a Subset, or a batch_sampler).

Epochs: the Session owns the count. Every pass over the training loader reads
`session.epoch` (reshuffling for it) and a complete pass advances it, whether the loop goes
through `session.progress(loader)` or iterates the loader itself, as a DataLoader with
shuffle=True reshuffles on every pass.

Resuming: the first kind records the sampler's position; the other two the number of batches
whose optimizer step completed in the pass, which the next pass skips.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler, get_worker_info
from torch.utils.data.distributed import DistributedSampler as TorchDistributedSampler

from paratrain.data.sampler import DistributedSampler
from paratrain.errors import ConfigError, UsageError


class ShardedLoader(DataLoader):
    """The loader `shard_loader` returns: a DataLoader that also counts, in the pass in progress,
    the batches it handed out and those whose optimizer step completed (Session.step tells it),
    so a checkpoint records the data trained on, not what workers or a prefetching loop fetched
    ahead. A batch fetched ahead across an epoch's end counts towards the new pass."""

    passes = 0  # iterations begun
    delivered = 0  # batches handed out in this pass
    trained = 0  # of those, batches whose backward completed
    stepped = 0  # of those, batches whose optimizer step completed
    start = 0  # batches of this pass a resumed run skipped (a batch sampler's or a stream's)
    pass_generator: torch.Tensor | None = None  # the generator before this pass drew from it
    # set by count_epochs: each pass reads the epoch to shuffle for, a complete pass reports its end
    epoch_of_pass: Callable[[], int] | None = None
    pass_ended: Callable[[], None] | None = None

    def __iter__(self):
        if self.epoch_of_pass is not None:
            self.set_epoch(self.epoch_of_pass())
        self.passes += 1
        self.delivered = self.trained = self.stepped = 0
        self.start = getattr(self._share(), "skip", 0)  # the pass's own iteration then clears it
        self.pass_generator = self.generator.get_state()  # super().__iter__() draws the workers' seed
        for batch in super().__iter__():
            self.delivered += 1
            if self.delivered == 1 and isinstance(self.dataset, ShardedStream):
                self.dataset.skip = 0  # taken by the pass (and by the workers' copies) by now
            yield batch
        self.pass_generator = None  # the pass ran out: the next draws from the generator as it is
        if self.pass_ended is not None:
            self.pass_ended()

    def count_epochs(self, epoch: Callable[[], int], ended: Callable[[], None]) -> None:
        """Train epochs with this loader: every pass reshuffles for `epoch()`, and a complete pass
        calls `ended()` (the Session passes its epoch and end_epoch)."""
        self.epoch_of_pass, self.pass_ended = epoch, ended

    def generator_state(self) -> torch.Tensor:
        """The generator as a resumed run needs it: as it was when the pass in progress began, so
        the resumed pass draws the same seeds for its workers (and every later pass too); as it is
        between passes."""
        return self.pass_generator if self.pass_generator is not None else self.generator.get_state()

    def count_trained(self, optimizer_stepped: bool) -> None:
        """One more micro-batch of this pass trained; all trained so far stepped, if it stepped."""
        self.trained = min(self.trained + 1, self.delivered)
        if optimizer_stepped:
            self.stepped = self.trained

    def position(self) -> dict:
        """Where this pass stands, counting the batches whose optimizer step completed."""
        if isinstance(self.sampler, DistributedSampler):
            return self.sampler.state_dict(per_replica_samples=self.stepped * self.batch_size)
        return {"kind": "batches", "batches": self.start + self.stepped}

    def dataset_len(self) -> int | None:
        """The samples a position counts (its sampler's dataset), or None for a batch sampler or a stream."""
        return self.sampler.dataset_len if isinstance(self.sampler, DistributedSampler) else None

    def load_position(self, state: dict) -> None:
        """Make the next pass start where `position()` said this one stood."""
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.load_state_dict(state)
        elif state.get("kind") == "batches":
            self._share().skip = self.start = int(state["batches"])
            self.delivered = self.trained = self.stepped = 0
        else:
            raise ConfigError("the checkpoint's data position is a sampler's, and this loader reads a batch "
                              "sampler or a stream: resume with the loader the saving run used")

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next pass reads (the sampler's shuffle, or the user's own set_epoch)."""
        for owner in (self.sampler, getattr(self.batch_sampler, "batch_sampler", None), self.dataset):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)
                return

    def _share(self) -> "ShardedBatches | ShardedStream":
        return self.dataset if isinstance(self.dataset, ShardedStream) else self.batch_sampler


class ShardedBatches:
    """Replica `index`'s part of every global batch a user's batch sampler yields."""

    def __init__(self, batch_sampler: Any, replicas: int, index: int):
        self.batch_sampler, self.replicas, self.index, self.skip = batch_sampler, replicas, index, 0

    def __iter__(self):
        skip, self.skip = self.skip, 0
        for number, batch in enumerate(self.batch_sampler):
            batch = list(batch)
            if number == skip:
                _same_everywhere(batch)
            if number < skip:
                continue
            if len(batch) % self.replicas:
                raise UsageError(f"the batch sampler gave a global batch of {len(batch)} samples, which does not "
                                 f"cut into {self.replicas} equal parts, one per data-parallel replica: make its "
                                 f"batches multiples of {self.replicas}")
            part = len(batch) // self.replicas
            yield batch[self.index * part:(self.index + 1) * part]

    def __len__(self) -> int:
        return len(self.batch_sampler)


class ShardedStream(IterableDataset):
    """Replica `index`'s share of an iterable dataset, split again between loader workers."""

    def __init__(self, dataset: IterableDataset, replicas: int, index: int, batch_size: int):
        self.dataset, self.replicas, self.index, self.batch_size, self.skip = dataset, replicas, index, batch_size, 0

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # read once per pass by each copy: a persistent worker's copy, made for the resumed pass,
        # must not skip again in the passes after it
        skip, self.skip = self.skip, 0
        # batch b is this replica's rows b·B … (b+1)·B-1. The loader hands out its workers'
        # batches in turn, so worker w makes the batches b of this pass with b ≡ w (mod W): the
        # pass yields them in stream order, also when it resumes after `skip` trained batches
        for row, mine in enumerate(self._rows()):
            batch = row // self.batch_size - skip
            if batch >= 0 and batch % workers == worker:
                yield mine

    def _rows(self):
        """This replica's item of each complete row of `replicas` items of the stream."""
        row: list[Any] = []
        for item in self.dataset:
            row.append(item)
            if len(row) == self.replicas:
                yield row[self.index]
                row = []

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def _same_everywhere(batch: list[int]) -> None:
    """Every rank must cut the same global batches: compare the pass's first one (a collective)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, batch)
    if any(other != everyone[0] for other in everyone):
        raise UsageError("the batch sampler gave different global batches on different ranks, so replicas "
                         "would train on overlapping data: give its sampler a generator seeded alike on "
                         "every rank (e.g. torch.Generator().manual_seed(seed)), or use batch_size=")


class IgnoringSignals:
    """A loader worker's init: ignore `signals`, then the user's own init. A scheduler's SIGTERM
    reaches every process of the job (`paratrain run`'s agent signals each rank's process group):
    a worker killed by it would fail the rank before the step at which it checkpoints."""

    def __init__(self, init: Any, signals: tuple[int, ...]):
        self.init, self.signals = init, signals

    def __call__(self, worker_id: int) -> None:
        for sig in self.signals:
            signal.signal(sig, signal.SIG_IGN)
        if self.init is not None:
            self.init(worker_id)


def _order(sampler: Any, seed: int) -> tuple[bool, int, bool]:
    """(shuffle, seed, drop_last) of the DistributedSampler that replaces a loader's `sampler`:
    what the loader said about the order. A sampler that chooses its own samples is refused."""
    if type(sampler) is SequentialSampler:
        return False, seed, False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return True, seed, False
    if isinstance(sampler, (DistributedSampler, TorchDistributedSampler)):  # a ported DDP script's
        return sampler.shuffle, sampler.seed, sampler.drop_last
    raise ConfigError(
        f"setup() shards a loader by giving it a DistributedSampler over the whole dataset, which would replace "
        f"this loader's {type(sampler).__name__} and change which samples are trained on. For a subset, pass "
        "torch.utils.data.Subset(dataset, indices) with shuffle=True; for weighted or other sampling of your "
        "own, pass DataLoader(dataset, batch_sampler=BatchSampler(sampler, global_batch, drop_last)) with the "
        "sampler's generator seeded alike on every rank: each global batch is then cut between the replicas")


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor moved to `device` (a pair of tensors without a tree walk: the
    common case, once per micro-batch)."""
    if type(batch) in (tuple, list) and len(batch) == 2:
        first, second = batch
        if torch.is_tensor(first) and torch.is_tensor(second):
            return type(batch)((first.to(device, non_blocking=True), second.to(device, non_blocking=True)))
    return tree_map(lambda t: t.to(device, non_blocking=True) if torch.is_tensor(t) else t, batch)


def shard_loader(loader: DataLoader, *, replicas: int, index: int, seed: int, rank: int,
                 pin_memory: bool = False, ignored_signals: tuple[int, ...] = ()) -> DataLoader:
    """`loader` rebuilt to read replica `index`'s share (module docstring): its `batch_size` is the
    global batch, each of `replicas` gets batch_size / replicas per step, from a
    `DistributedSampler` that shuffles when the loader did; or a batch sampler's batches, or a
    stream, cut the same way. `ignored_signals`: what its worker processes ignore (the rank acts
    on them: session/preemption.py)."""
    generator = torch.Generator().manual_seed(seed + rank)
    init = IgnoringSignals(loader.worker_init_fn, ignored_signals) if ignored_signals else loader.worker_init_fn
    options = dict(num_workers=loader.num_workers, collate_fn=loader.collate_fn, generator=generator,
                   pin_memory=loader.pin_memory or pin_memory, timeout=loader.timeout,
                   worker_init_fn=init, persistent_workers=loader.persistent_workers,
                   multiprocessing_context=loader.multiprocessing_context, prefetch_factor=loader.prefetch_factor)
    batch = loader.batch_size
    if isinstance(loader.dataset, IterableDataset):
        if batch is None or batch % replicas:
            raise ConfigError(f"a loader over an IterableDataset needs a batch_size (the global batch) that the "
                              f"{replicas} data-parallel replicas divide; got {batch}")
        stream = ShardedStream(loader.dataset, replicas, index, batch // replicas)
        return ShardedLoader(stream, batch_size=batch // replicas, drop_last=loader.drop_last, **options)
    if batch is None and loader.batch_sampler is None:
        raise ConfigError("a loader with batch_size=None and no batch_sampler (automatic batching off: each "
                          "item is already a batch) cannot be cut between data-parallel replicas: give it the "
                          "global batch_size and let it collate, or a batch_sampler= of global batches")
    if batch is None:
        return ShardedLoader(loader.dataset, batch_sampler=ShardedBatches(loader.batch_sampler, replicas, index),
                             **options)
    if batch < replicas or batch % replicas:
        raise ConfigError(f"the global batch size {batch} must be a multiple of the "
                          f"{replicas} data-parallel replicas; use a batch size of "
                          f"{max(replicas, batch // replicas * replicas)}")
    shuffle, seed, drop_last = _order(loader.sampler, seed)
    sampler = DistributedSampler(loader.dataset, num_replicas=replicas, rank=index, shuffle=shuffle,
                                 seed=seed, drop_last=loader.drop_last or drop_last)
    # its own generator: starting an iterator draws the workers' base seed from it, and from
    # torch's global RNG without one, which would shift dropout masks after a resume
    return ShardedLoader(loader.dataset, batch_size=batch // replicas, sampler=sampler,
                         drop_last=loader.drop_last, **options)
