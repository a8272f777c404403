"""The training session: one object that turns a single-device loop into a distributed one.

    session = pt.Session(strategy="ddp", accumulate=4)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    for epoch in range(epochs):
        for batch in session.progress(loader):
            loss = session.train_step(batch, loss_fn)

`setup` wraps the model with the strategy and rebuilds the loader so that each data-parallel
replica reads a disjoint share of every epoch: the loader's `batch_size` is the *global* batch,
and each replica gets `batch_size / replicas` of it, so changing the number of processes does not
change what one optimizer step sees.

`train_step(batch, loss_fn)` takes `batch = (inputs, targets)` and `loss_fn(outputs, targets)`.
For loops that need more control, the same step is `with session.accumulation(): loss = …;
session.backward(loss)` followed by `session.step()`.

Mixed precision: `Session(precision="bf16")` runs forward and loss (inside `accumulation()`) under
`torch.autocast`; `"fp16"` also scales the loss with `precision.GradScaler`, whose inf check spans
the ranks that hold parts of the gradients. Losses averaged over a varying number of tokens:
`train_step(batch, loss_fn, weight=num_tokens)` (see `backward`).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from paratrain import checkpoint
from paratrain.accumulation import TokenWeights
from paratrain.contrastive import Gathered, gather_embeddings
from paratrain.data import shard_loader
from paratrain.errors import ConfigError, UsageError
from paratrain.metrics import MetricsLogger
from paratrain.parallel.shard import full_state_dict
from paratrain.precision import GradScaler, autocast_dtype
from paratrain.resume import check_registrable, restore_session, session_state
from paratrain.strategy import Strategy, resolve
from paratrain.topology import NodeGroups, Topology, destroy, node_groups


class Session:
    """Strategy, accumulation, clipping, progress and rank-0 printing for one training job.

    strategy: a name ("single", "dp", "ddp", "hierarchical", "zero1", "zero2", "zero3",
        "model-parallel", "pipeline") or an object such as
        `paratrain.DDP(...)` or `paratrain.ZeRO(stage=3, wrap_policy=...)`.
    accumulate: micro-batches per optimizer step; gradients are averaged over them and
        communication happens only on the last one.
    max_grad_norm: clip the global gradient norm to this before each optimizer step.
    precision: "32" (the parameters' dtype), "bf16" or "fp16": forward and loss under
        `torch.autocast` in that dtype; parameters, gradients and optimizer state stay fp32.
        "fp16" also scales the loss (`grad_scaler`, default `paratrain.GradScaler()`): a step
        with an inf or nan gradient on any rank is skipped by every rank.
    seed: seeds torch on every rank and the data order of every epoch.
    timeout: seconds any collective may wait before the job fails (default PARATRAIN_TIMEOUT or 600).
    nan_check: raise when a micro-batch's loss is NaN or infinite, before the optimizer steps (one
        host-device sync per micro-batch on GPU, as the progress bar's loss display already costs).
    log_dir: where `log()` writes metrics.csv (and TensorBoard events when it is installed).
    debug_collectives: check that every rank issues the same collective, and fail naming both when
        they differ (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL; default PARATRAIN_DEBUG_COLLECTIVES).
    topology: where this process sits; read from the environment when not given.
    """

    def __init__(self, strategy: str | Strategy = "ddp", *, accumulate: int = 1,
                 max_grad_norm: float | None = None, seed: int = 0, timeout: float | None = None,
                 topology: Topology | None = None, progress_bar: bool = True, nan_check: bool = True,
                 log_dir: str | os.PathLike | None = None, debug_collectives: bool | None = None,
                 precision: str = "32", grad_scaler: GradScaler | None = None):
        if accumulate < 1:
            raise ConfigError(f"accumulate must be at least 1; got {accumulate}")
        self.precision, self.autocast_dtype = precision, autocast_dtype(precision)
        if grad_scaler is not None and precision != "fp16":
            raise ConfigError(f"grad_scaler is for precision='fp16'; got precision={precision!r}")
        self.scaler = (grad_scaler or GradScaler()) if precision == "fp16" else None
        self._weights = TokenWeights()  # token weights of this accumulation window
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be a positive norm to clip to; got {max_grad_norm} "
                              "(leave it None not to clip)")
        self.strategy = resolve(strategy)
        self.accumulate, self.max_grad_norm, self.seed = accumulate, max_grad_norm, seed
        self.topology = (topology or Topology.from_env()).init(timeout, debug_collectives=debug_collectives)
        self.progress_bar, self.nan_check = progress_bar, nan_check
        self.metrics = MetricsLogger(log_dir, is_main=self.is_main) if log_dir is not None else None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loader: DataLoader | None = None  # the training loader setup() returned
        self.epoch = 0
        self.micro_step = 0  # micro-batches seen; an optimizer step every `accumulate`
        self.last_loss: torch.Tensor | None = None
        self.samples_per_second = 0.0  # global throughput of the last progress() loop
        self.registered: dict[str, Any] = {}  # name → object whose state checkpoints carry
        self._node_groups: NodeGroups | None = None  # built on first use (contrastive gathers)
        torch.manual_seed(seed)

    # -- facts about the job -------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def is_main(self) -> bool:
        return self.topology.is_main

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    # -- setup -----------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              loader: DataLoader | None = None):
        """Wrap `model` with the strategy, check `optimizer` holds its parameters, and shard
        `loader`. Returns (model, optimizer, loader), leaving out what was not passed."""
        if self.model is not None:
            raise UsageError("setup() was already called on this session: keep using the model, "
                             "optimizer and loader it returned, or make a new Session for another model")
        given = optimizer
        self.model, optimizer = self.strategy.setup(model, optimizer, self.topology)
        if optimizer is not given and hasattr(given.step, "_wrapped_by_lr_sched"):
            raise ConfigError(f"a learning-rate scheduler was created on the optimizer before setup(), but "
                              f"{self.strategy.name} replaces that optimizer, so the scheduler would change "
                              "the learning rate of one that no longer steps: create the scheduler from "
                              "the optimizer setup() returns")
        self.optimizer = optimizer
        out: list[Any] = [self.model]
        if optimizer is not None:
            out.append(optimizer)
        if loader is not None:
            self.loader = self.shard_loader(loader)
            out.append(self.loader)
        return out[0] if len(out) == 1 else tuple(out)

    def shard_loader(self, loader: DataLoader) -> DataLoader:
        """The same loader, reading this replica's share: batch_size/replicas per step."""
        replicas, index = self.strategy.data_parallel(self.topology)
        sharded = shard_loader(loader, replicas=replicas, index=index, seed=self.seed, rank=self.rank,
                               pin_memory=self.device.type == "cuda")
        self.strategy.check_loader(sharded)
        return sharded

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """The user's own model inside the strategy's wrapper (for evaluation, export). Under
        ZeRO stage 3 its parameters are gathered only inside the wrapper's forward: evaluate
        through the wrapped model, or load `full_state_dict()` into a fresh copy."""
        return self.strategy.unwrap(model or self._require_model())

    def gather_embeddings(self, x: torch.Tensor, scope: str = "world") -> Gathered:
        """Every rank's rows of `x` ("world"), this node's ranks' ("node") or this rank's own
        ("local"), differentiable: gradients go back to each row's rank. For contrastive losses
        with negatives from every rank: `pt.nt_xent_loss(z1, z2, gather=session.gather_embeddings)`.
        A collective: every rank calls it."""
        if scope == "node" and self._node_groups is None:
            self._node_groups = node_groups(self.topology)  # collective, like this call
        return gather_embeddings(x, scope=scope, groups=self._node_groups)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict with its own keys, on every rank (a collective)."""
        return full_state_dict(self._require_model())

    # -- the step ----------------------------------------------------------------------------------

    def train_step(self, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                   weight: float | torch.Tensor | None = None) -> torch.Tensor:
        """Forward `inputs`, `loss_fn(outputs, targets)`, backward, and — on the last of
        `accumulate` micro-batches — clip and step. Returns the (unscaled) loss, detached.
        `weight`: what the loss is a mean over (its number of valid tokens); see `backward`."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise UsageError(f"train_step takes batch = (inputs, targets); got a {type(batch).__name__}"
                             f"{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}. For "
                             "other batches write the step: `with session.accumulation(): loss = ...; "
                             "session.backward(loss)`, then `session.step()`")
        inputs, targets = self.to_device(batch)
        model = self._require_model()
        with self.accumulation():
            scale = self._loss_factor(weight)
            loss = self.strategy.forward_backward(model, inputs, targets, loss_fn, scale)
        self._check_finite(loss)
        self.step()
        self.last_loss = loss
        return loss

    @contextlib.contextmanager
    def accumulation(self) -> Iterator[bool]:
        """Wrap forward and backward of one micro-batch: on all but the last of `accumulate`
        micro-batches, gradients accumulate locally with no communication. Under precision
        "bf16"/"fp16" the block runs under `torch.autocast`. Yields whether this micro-batch
        ends an optimizer step."""
        last = (self.micro_step + 1) % self.accumulate == 0
        sync = contextlib.nullcontext() if last else self.strategy.no_sync(self._require_model())
        with sync, self.autocast():
            yield last

    def autocast(self) -> contextlib.AbstractContextManager:
        """`torch.autocast` in the session's precision on its device (nothing for "32").
        Strategies run backward inside `forward_backward` (a pipeline interleaves the two), so it
        covers backward too: backward ops keep the dtypes their forward chose, autocast or not."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor | None = None) -> None:
        """Backward of `loss / accumulate`, so k micro-batches of the mean loss sum to the mean
        over one k-times-larger batch (times the loss scale under fp16).

        Token-weighted losses: when each micro-batch's loss is a mean over a different number of
        items (valid tokens of a padded batch), pass that number as `weight` on every micro-batch
        of every rank. The step's gradient is then the gradient of Σ weight·loss / Σ weight over
        all micro-batches of all data-parallel ranks: the mean over every token, exactly as one
        process would compute it on the whole batch.

            mask = targets != PAD
            loss = session.train_step((x, targets), lambda out, y: F.cross_entropy(
                out.flatten(0, 1), y.flatten(), ignore_index=PAD), weight=mask.sum())

        How: backward takes `weight · loss` (the micro-batch's sum), and `step()` multiplies
        the gradients this rank holds by replicas / Σ weight (replicas undoing the data-parallel
        mean), after one all-reduce of the local weight sums. Normalising afterwards, not before
        backward, because the global count is known only once the last micro-batch is read:
        scaling first would need every micro-batch in hand, or one all-reduce per micro-batch."""
        self._check_finite(loss)
        (loss * self._loss_factor(weight)).backward()

    def _loss_factor(self, weight: float | torch.Tensor | None) -> float:
        """What backward multiplies this micro-batch's loss by: 1/accumulate, or its weight
        (normalised in step()), times the fp16 loss scale."""
        if weight is not None and getattr(self._require_model(), "is_pipeline", False):
            raise UsageError("weight= is not supported with strategy 'pipeline' yet: its "
                             "micro-batches are cut inside the schedule; pass losses averaged "
                             "over equal numbers of tokens, or use a data-parallel strategy")
        factor = self._weights.add(weight, self.accumulate)
        return factor * (self.scaler.scale_value if self.scaler is not None else 1.0)

    def step(self) -> bool:
        """Count a micro-batch; at the end of each accumulation, normalise token-weighted
        gradients, unscale (fp16), clip, step and zero the gradients. Returns True when the
        optimizer stepped (under fp16 every rank skips a step whose gradients overflowed)."""
        self.micro_step += 1
        if self.micro_step % self.accumulate:
            return False
        if self.optimizer is None:
            raise UsageError("step() needs an optimizer: pass it to session.setup(model, optimizer)")
        model = self._require_model()
        factor = self._weights.normaliser(self.strategy.data_parallel(self.topology)[0])
        found_inf = False
        if self.scaler is not None or factor != 1.0:
            grads, group = self.strategy.local_grads(model)
            if self.scaler is not None:  # unscale before clipping: max_grad_norm is in true units
                found_inf = self.scaler.unscale_(grads, group, factor=factor)
            else:
                for g in grads:
                    g.mul_(factor)
        if self.max_grad_norm is not None and not found_inf:
            self.strategy.clip_grad_norm(model, self.max_grad_norm)
        if not found_inf:  # every rank agrees: the flag was reduced over the gradients' holders
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return not found_inf

    def _check_finite(self, loss: torch.Tensor) -> None:
        """Stop before a NaN or infinite loss reaches the parameters. Only the rank that sees it
        raises; the launcher then stops the others (their next collective would otherwise wait)."""
        if self.nan_check and not bool(torch.isfinite(loss.detach()).all()):
            raise UsageError(f"the loss is {loss.detach().float().mean().item()} at optimizer step "
                             f"{self.micro_step // self.accumulate} (micro-batch {self.micro_step}, epoch "
                             f"{self.epoch}) on rank {self.rank}; the optimizer did not step. Lower the "
                             "learning rate, clip gradients (Session(max_grad_norm=...)), check this batch's "
                             "inputs and targets, or pass Session(nan_check=False) to go on regardless")

    def to_device(self, batch: Any) -> Any:
        """`batch` with every tensor moved to this rank's device."""
        return tree_map(lambda t: t.to(self.device, non_blocking=True) if torch.is_tensor(t) else t, batch)

    # -- progress ----------------------------------------------------------------------------------

    def progress(self, loader: Iterable, desc: str | None = None) -> Iterator[Any]:
        """Iterate `loader` once, with a progress bar on rank 0 showing the loss and global samples
        per second. For the training loader setup() returned, a full pass is one epoch: its
        sampler is reshuffled for `session.epoch`, which then advances. Other loaders (validation)
        are iterated as they are."""
        training = loader is self.loader
        sampler = getattr(loader, "sampler", None)
        if training and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.epoch)
        replicas, _ = self.strategy.data_parallel(self.topology)
        total = len(loader) if hasattr(loader, "__len__") else None
        bar = tqdm(total=total, desc=desc or f"epoch {self.epoch}", leave=False, mininterval=0.5,
                   disable=not (self.is_main and self.progress_bar), dynamic_ncols=True)
        samples, start = 0, time.perf_counter()
        try:
            for batch in loader:
                yield batch
                samples += _batch_len(batch) * replicas
                self.samples_per_second = samples / (time.perf_counter() - start)
                if self.last_loss is not None and not bar.disable:
                    bar.set_postfix(loss=f"{self.last_loss.item():.4f}",
                                    samples_s=f"{self.samples_per_second:.0f}", refresh=False)
                bar.update()
            if training:
                self.epoch += 1
        finally:  # also when the loop breaks early
            bar.close()

    # -- metrics -----------------------------------------------------------------------------------

    def log(self, step: int | None = None, **metrics: Any) -> dict[str, float]:
        """Average scalar `metrics` over ranks and append them as one row of `log_dir/metrics.csv`
        on rank 0 (paratrain/metrics.py). `step` defaults to the optimizer steps taken. A
        collective: every rank calls it with the same names. Returns the means."""
        if self.metrics is None:
            raise UsageError("log() writes to Session(log_dir=...), and this session has none; pass "
                             "log_dir, or average without writing with paratrain.comm.mean_metrics")
        step = self.micro_step // self.accumulate if step is None else step
        return self.metrics.log(step, **metrics)

    # -- checkpoints -------------------------------------------------------------------------------

    def register(self, **objects: Any) -> None:
        """Save these objects' `state_dict()` with every checkpoint and load it back, under their
        names: `session.register(scheduler=scheduler)`. Anything with state_dict() and
        load_state_dict() whose state is JSON: LR schedulers, counters of your own."""
        for name, obj in objects.items():
            check_registrable(name, obj)
        self.registered.update(objects)

    def save(self, path: str | os.PathLike) -> Path:
        """Save model, optimizer, epoch and micro-step, the sampler's position, registered objects
        and every rank's RNG states to `path` (checkpoint.py: sharded, atomic; resume.py: what the
        session adds). A collective: every rank calls it."""
        state, rng = session_state(self)
        return checkpoint.save(path, self._require_model(), self.optimizer, state=state, rng=rng)

    def load(self, path: str | os.PathLike) -> None:
        """Load a checkpoint written by `save` under any strategy and world size; training then
        continues exactly where it stopped (RNG states too, when the world size is the same)."""
        restore_session(self, checkpoint.load(path, self._require_model(), self.optimizer), path)

    def checkpoint(self, root: str | os.PathLike, keep: int = 3) -> Path:
        """Save to `root/step-<optimizer steps>` and keep the newest `keep` checkpoints there (in
        the order they were written). The first call locks `root` for this job until close()."""
        checkpoint.lock_root(root, owner=self)
        path = self.save(Path(root) / f"step-{self.micro_step // self.accumulate:08d}")
        checkpoint.prune(root, keep)
        return path

    def resume(self, root: str | os.PathLike, *, required: bool = False) -> bool:
        """Load the newest intact checkpoint under `root` (or `root` itself, when it is one); a
        damaged one is skipped with a warning. Say whether one was loaded; `required=True` makes
        finding none a ConfigError that says where it looked."""
        return checkpoint.resume(root, self.load, required=required) is not None

    def export(self, path: str | os.PathLike) -> Path | None:
        """The whole model as one `.safetensors` file for inference (gathered from every rank,
        written by rank 0). A collective."""
        return checkpoint.export_safetensors(path, self.full_state_dict())

    # -- end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the metrics files, release the checkpoint root's lock, tear down the process group."""
        if self.metrics is not None:
            self.metrics.close()
        checkpoint.unlock_roots(owner=self)
        destroy()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise UsageError("call session.setup(model, optimizer, loader) before training")
        return self.model


def _batch_len(batch: Any) -> int:
    tensors = [t for t in tree_flatten(batch)[0] if torch.is_tensor(t) and t.dim() > 0]
    return tensors[0].shape[0] if tensors else 1
