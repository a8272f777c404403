"""What a Session tells about the job and the model, whatever the strategy: ranks, the device,
batches moved to it, loaders sharded for it and their epochs, the progress bar (session/progress.py),
rank-0 printing, the user's own model, its size, a per-rank seed, the whole state dict,
contrastive gathers and metric logging (the Session class inherits these)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain.components.contrastive import Gathered, gather_embeddings
from paratrain.data.loader import shard_loader, to_device
from paratrain.debug.flight_recorder import within
from paratrain.errors import UsageError
from paratrain.parallel.base import ParallelModule, full_state_dict, uncompiled
from paratrain.session.preemption import SIGNALS
from paratrain.session.progress import progress

if TYPE_CHECKING:
    from paratrain.session.session import Session


class JobFacts:
    """Facts about the job and the model, and rank-aware helpers (mixed into `Session`)."""

    rank = property(lambda self: self.topology.rank)  # global rank
    world_size = property(lambda self: self.topology.world_size)
    device = property(lambda self: self.topology.device)  # this rank's device
    is_main = property(lambda self: self.topology.is_main)  # global rank 0

    def to_device(self: "Session", batch: Any) -> Any:
        """`batch` with every tensor moved to this rank's device."""
        return to_device(batch, self.device)

    def progress(self: "Session", loader: Iterable, desc: str | None = None) -> Iterator[Any]:
        """Iterate `loader` once, with a progress bar on rank 0 showing the loss and global samples
        per second. For the training loader setup() returned, a full pass is one epoch: its
        sampler is reshuffled for `session.epoch`, which then advances (also when the loop
        iterates that loader itself). Other loaders (validation) are iterated as they are."""
        return progress(self, loader, desc)

    def shard_loader(self: "Session", loader: DataLoader) -> DataLoader:
        """The same loader, reading this replica's share: batch_size/replicas per step (data/loader.py).
        Under Session(checkpoint_on_preempt=...) its workers leave the signals to the rank."""
        model = self._require_model()
        sharded = shard_loader(loader, replicas=model.replicas, index=model.replica_index, seed=self.seed,
                               rank=self.rank, pin_memory=self.device.type == "cuda",
                               ignored_signals=SIGNALS if self.preemption is not None else ())
        model.check_loader(sharded)
        return sharded

    def end_epoch(self: "Session") -> None:
        """A complete pass over the training loader ended (data/loader.py): the next reads the next epoch."""
        if self._on_device is not None:  # the pass's last step, checked on the device (session/step.py)
            self._on_device.raise_pending()
        self.epoch += 1

    def print(self: "Session", *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def unwrap(self: "Session", model: nn.Module | None = None) -> nn.Module:
        """The user's own model inside the strategy's wrapper (for evaluation, export). Under
        ZeRO stage 3 its parameters are gathered only inside the wrapper's forward: evaluate
        through the wrapped model, or load `full_state_dict()` into a fresh copy."""
        model = model or self._require_model()
        return uncompiled(model.module if isinstance(model, ParallelModule) else model)

    def gather_embeddings(self: "Session", x: torch.Tensor, scope: str = "world") -> Gathered:
        """Every rank's rows of `x` ("world"), this node's ranks' ("node") or this rank's own
        ("local"), differentiable: gradients go back to each row's rank. For contrastive losses
        with negatives from every rank: `pt.nt_xent_loss(z1, z2, gather=session.gather_embeddings)`.
        A collective: every rank calls it."""
        groups = self.grid.node_groups() if scope == "node" else None  # built on first use
        return gather_embeddings(x, scope=scope, groups=groups)

    def num_parameters(self: "Session", trainable_only: bool = False) -> int:
        """Parameters of the whole model given to setup() (tied weights once), whatever part of it
        this rank holds: what model-size and MFU arithmetic needs, also under ZeRO-3 and pipelines."""
        return self.given.trainable if trainable_only else self.given.parameters

    @property
    def rank_seed(self: "Session") -> int:
        """A seed that differs between ranks, for code that must draw differently on each (its own
        batch sampling); `Session(seed=...)` seeds torch alike on every rank."""
        return self.seed * 100_003 + 1 + self.rank

    @within("session.full_state_dict")
    def full_state_dict(self: "Session") -> dict[str, torch.Tensor]:
        """The whole model's state dict with its own keys, on every rank (a collective)."""
        return full_state_dict(self._require_model())

    def log(self: "Session", step: int | None = None, **metrics: Any) -> dict[str, float]:
        """Average scalar `metrics` over ranks and append them as one row of `log_dir/metrics.csv`
        on rank 0 (paratrain/components/metrics.py). `step` defaults to the optimizer steps taken. A
        collective: every rank calls it with the same names. Returns the means."""
        if self.metrics is None:
            raise UsageError("log() writes to Session(log_dir=...), and this session has none; pass "
                             "log_dir, or average without writing with paratrain.distributed.comm.mean_metrics")
        step = self.micro_step // self.accumulate if step is None else step
        return self.metrics.log(step, **metrics)
