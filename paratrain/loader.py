"""The loader a Session trains from: the user's loader rebuilt so each data-parallel replica
reads its share of every global batch, counting what it handed out and what was trained on (so
a checkpoint records the right position), and moving batches to the device."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, RandomSampler

from paratrain.data import DistributedSampler
from paratrain.errors import ConfigError


class ShardedLoader(DataLoader):
    """The loader `shard_loader` returns: a DataLoader that also counts, in the pass in progress,
    the batches it handed out and those whose optimizer step completed (Session.step tells it),
    so a checkpoint records the data trained on, not what workers or a prefetching loop fetched
    ahead. A batch fetched ahead across an epoch's end counts towards the new pass."""

    passes = 0  # iterations begun
    delivered = 0  # batches handed out in this pass
    trained = 0  # of those, batches whose backward completed
    stepped = 0  # of those, batches whose optimizer step completed

    def __iter__(self):
        self.passes += 1
        self.delivered = self.trained = self.stepped = 0
        for batch in super().__iter__():
            self.delivered += 1
            yield batch

    def count_trained(self, optimizer_stepped: bool) -> None:
        """One more micro-batch of this pass trained; all trained so far stepped, if it stepped."""
        self.trained = min(self.trained + 1, self.delivered)
        if optimizer_stepped:
            self.stepped = self.trained

    def position(self) -> dict:
        """The sampler's state counting the batches whose optimizer step completed."""
        return self.sampler.state_dict(per_replica_samples=self.stepped * self.batch_size)


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor moved to `device` (a pair of tensors without a tree walk: the
    common case, once per micro-batch)."""
    if type(batch) in (tuple, list) and len(batch) == 2 and all(torch.is_tensor(t) for t in batch):
        return type(batch)(t.to(device, non_blocking=True) for t in batch)
    return tree_map(lambda t: t.to(device, non_blocking=True) if torch.is_tensor(t) else t, batch)


def shard_loader(loader: DataLoader, *, replicas: int, index: int, seed: int, rank: int,
                 pin_memory: bool = False) -> DataLoader:
    """`loader` rebuilt to read replica `index`'s share: its `batch_size` is the global batch, each
    of `replicas` gets batch_size / replicas per step, from a `DistributedSampler` that shuffles
    when the loader did."""
    batch = loader.batch_size
    if batch is None:
        raise ConfigError("the loader has no batch_size (it uses a batch_sampler): build it "
                          "with DataLoader(dataset, batch_size=GLOBAL_BATCH, shuffle=...)")
    if batch < replicas or batch % replicas:
        raise ConfigError(f"the global batch size {batch} must be a multiple of the "
                          f"{replicas} data-parallel replicas; use a batch size of "
                          f"{max(replicas, batch // replicas * replicas)}")
    sampler = DistributedSampler(loader.dataset, num_replicas=replicas, rank=index,
                                 shuffle=isinstance(loader.sampler, RandomSampler),
                                 seed=seed, drop_last=loader.drop_last)
    # its own generator: starting an iterator draws the workers' base seed from it, and from
    # torch's global RNG without one, which would shift dropout masks after a resume
    generator = torch.Generator().manual_seed(seed + rank)
    return ShardedLoader(loader.dataset, batch_size=batch // replicas, sampler=sampler, generator=generator,
                      num_workers=loader.num_workers, collate_fn=loader.collate_fn,
                      pin_memory=loader.pin_memory or pin_memory, drop_last=loader.drop_last,
                      timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
                      persistent_workers=loader.persistent_workers)
