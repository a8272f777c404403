"""The training session: one object that turns a single-device loop into a distributed one.

    session = pt.Session(strategy="ddp", accumulate=4)
    model, optimizer, loader = session.setup(model, optimizer, loader)
    for epoch in range(epochs):
        for batch in session.progress(loader):
            loss = session.train_step(batch, loss_fn)

`setup` wraps the model with the strategy (a `ParallelModule`, parallel/base.py: the session only
ever calls that protocol) and rebuilds the loader so that each data-parallel replica reads a
disjoint share of every epoch: the loader's `batch_size` is the *global* batch, so changing the
number of processes does not change what one optimizer step sees. For loops that need more
control, `train_step` is `with session.accumulation(): loss = …; session.backward(loss)` followed
by `session.step()`. What runs around each step is a list of step hooks (session/hooks.py);
what a checkpoint holds beyond the model and optimizer is session/resume.py's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain import checkpoint
from paratrain.checkpoint import files as checkpoint_files
from paratrain.checkpoint.export import export_model
from paratrain.components.accumulation import MicroBatch, TokenWeights
from paratrain.components.activation_checkpointing import Which, checkpoint_activations
from paratrain.components.contrastive import Gathered, gather_embeddings
from paratrain.components.materialize import MetaInit, has_meta
from paratrain.components.optim import Given, describe, retire_replaced
from paratrain.components.precision import GradScaler, autocast_dtype, scaler_for
from paratrain.data.batch import UnevenBatchWarning, label_shift, uneven_warning, unpack
from paratrain.data.loader import shard_loader, to_device
from paratrain.debug import flight_hooks
from paratrain.debug.flight_recorder import within
from paratrain.debug.verify import StepRecorder
from paratrain.distributed.topology import Topology, destroy
from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.base import (
    ParallelModule,
    Strategy,
    backward_no_autocast,
    check_loss,
    full_state_dict,
    scaled,
    uncompiled,
)
from paratrain.parallel.registry import resolve
from paratrain.session.autolog import Logging, open_metrics
from paratrain.session.hooks import Hooks, StepHook
from paratrain.session.preemption import SIGNALS, Preemption
from paratrain.session.progress import batch_len, progress
from paratrain.session.resume import (
    check_registrable,
    check_same_optimizer,
    check_whole_window,
    note_micro_step,
    position,
    refuse_non_finite,
    restore_session,
    session_state,
)
from paratrain.session.step import DeviceCheck, LossLog, optimizer_step
from paratrain.session.watch import StepWarnings, StepWatch


class Session:
    """Strategy, accumulation, clipping, progress and rank-0 printing for one training job.

    strategy: a name ("single", "dp", "ddp", "hierarchical", "zero1", "zero2", "zero3",
        "model-parallel", "pipeline") or an object such as
        `paratrain.DDP(...)`, `paratrain.ZeRO(stage=3, wrap_policy=...)` or, for tensor
        parallelism, `paratrain.Mesh(tp=2, dp="zero3")`.
    accumulate: micro-batches per optimizer step; gradients are averaged over them and
        communication happens only on the last one.
    max_grad_norm: clip the global gradient norm to this before each optimizer step.
    precision: "32" (the parameters' dtype), "bf16" or "fp16": forward and loss under
        `torch.autocast` in that dtype; parameters, gradients and optimizer state stay fp32.
        "fp16" also scales the loss (`grad_scaler`, default `paratrain.GradScaler()`): a step
        with an inf or nan gradient on any rank is skipped by every rank.
    seed: seeds torch on every rank and the data order of every epoch.
    timeout: seconds any collective may wait before the job fails (default PARATRAIN_TIMEOUT or 600).
    nan_check: raise when a micro-batch's loss, or a gradient, is NaN or infinite, before the
        optimizer steps: checked at each optimizer step, one wait for the device; none with a
        fused optimizer on a GPU, which skips the step there and raises one step later (session/step.py).
    log_dir: where `log()` writes metrics.csv (and TensorBoard events when it is installed).
    logging: what the session logs there by itself, and to which backends (autolog.Logging:
        every 10 optimizer steps loss, lr, grad norm, fp16 scale, samples/tokens per second, MFU).
    debug_collectives: check that every rank issues the same collective, and fail naming both when
        they differ (torch's TORCH_DISTRIBUTED_DEBUG=DETAIL; default PARATRAIN_DEBUG_COLLECTIVES).
    topology: where this process sits; read from the environment when not given.
    checkpoint_on_preempt: a checkpoint root: on SIGTERM or SIGUSR1 every rank finishes the
        optimizer step, checkpoints there and exits 0, for a requeued job to resume (session/preemption.py).
    activation_checkpointing: recompute these modules' activations in backward instead of keeping
        them: "auto" (the blocks of every ModuleList of identical blocks), a module class, or a
        predicate fn(name, module); applied in setup, under every strategy (components/activation_checkpointing.py).
    step_warnings: when an fp16 step is skipped, the loss scale keeps halving or the gradient norm
        jumps: a rank-0 `StepWarning` and a metrics row (session/watch.py); None: silent.
    hooks: `paratrain.StepHook`s called around each step (on_setup, on_batch, on_loss,
        before_step, after_step: session/hooks.py), after the session's own and before preemption's.
    """

    def __init__(self, strategy: str | Strategy = "ddp", *, accumulate: int = 1,
                 max_grad_norm: float | None = None, seed: int = 0, timeout: float | None = None,
                 topology: Topology | None = None, progress_bar: bool = True, nan_check: bool = True,
                 log_dir: str | os.PathLike | None = None, debug_collectives: bool | None = None,
                 precision: str = "32", grad_scaler: GradScaler | None = None,
                 checkpoint_on_preempt: str | os.PathLike | None = None, logging: Logging | None = None,
                 activation_checkpointing: Which | None = None, step_warnings: StepWarnings | None = StepWarnings(),
                 hooks: list[StepHook] | tuple[StepHook, ...] = ()):
        if accumulate < 1:
            raise ConfigError(f"accumulate must be at least 1; got {accumulate}")
        flight_hooks.install()  # a job starts here: record its collectives (debug/flight_hooks.py)
        self.precision, self.autocast_dtype = precision, autocast_dtype(precision)
        self.scaler = scaler_for(precision, grad_scaler)
        self._weights = TokenWeights()  # token weights of this accumulation window
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm must be a positive norm to clip to; got {max_grad_norm} "
                              "(leave it None not to clip)")
        self.strategy = resolve(StepRecorder.strategy(strategy))  # `paratrain verify` may choose it
        self.accumulate, self.max_grad_norm, self.seed = accumulate, max_grad_norm, seed
        self.topology = (topology or Topology.from_env()).init(timeout, debug_collectives=debug_collectives)
        self.grid = self.strategy.grid(self.topology)  # every process group comes from it (distributed/grid.py)
        self.progress_bar, self.nan_check = progress_bar, nan_check
        self._losses = LossLog(accumulate, self.rank)  # read at the optimizer step (nan_check)
        self._on_device: DeviceCheck | None = None  # nan_check without a wait (setup, session/step.py)
        self.metrics, self.meter = open_metrics(log_dir, logging, self.is_main)
        self.model: ParallelModule | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.loader: DataLoader | None = None  # the training loader setup() returned
        self.epoch = 0
        self.micro_step = 0  # micro-batches seen; an optimizer step every `accumulate`
        self.last_loss: torch.Tensor | None = None
        self.samples_per_second = 0.0  # global throughput of the last progress() loop
        self.registered: dict[str, Any] = {}  # name → object whose state checkpoints carry
        self.unclaimed: dict[str, Any] = {}  # loaded states of objects not registered yet (session/resume.py)
        self._in_micro_batch = False  # an accumulation() block was entered, step() not yet called
        self._label_shift: bool | None = None  # the model's own loss shifts its labels (data/batch.py)
        self._sizes_compared = False  # the first train_step compares the ranks' batch sizes (data/batch.py)
        self.given = Given(0, 0, None)  # the model and optimizer given to setup(), as given
        self.step_boundary: dict | None = None  # the loop at the last optimizer step (session/resume.py)
        self.preemption = Preemption(str(checkpoint_on_preempt)) if checkpoint_on_preempt else None
        self.activation_checkpointing = activation_checkpointing
        self.watch = StepWatch(step_warnings) if step_warnings is not None else None
        # what runs around each step, in order (session/hooks.py): `paratrain verify`'s recorder
        # (under it only: debug/verify.py), the step warnings, the metric rows, the user's, and
        # preemption, which may checkpoint and exit
        self.hooks = Hooks([StepRecorder.from_env(self.rank), self.watch, self.meter, *hooks, self.preemption])
        torch.manual_seed(seed)

    # -- setup -----------------------------------------------------------------------------------

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
              loader: DataLoader | None = None, *, init_fn: Callable[[nn.Module], None] | None = None,
              init: str | None = None):
        """Wrap `model` with the strategy, check `optimizer` holds its parameters, and shard
        `loader`. Returns (model, optimizer, loader), leaving out what was not passed.

        A model built under `torch.device("meta")` is materialised here: whole under replicated
        strategies, only this rank's shards under zero3 and its stage under a pipeline, each
        tensor by its module's reset_parameters() and then `init_fn(module)`, seeded from the
        session's seed and the module's path, so the values do not depend on the strategy or the
        world size (components/materialize.py). A model that initialises from its root
        (torchtitan's `init_weights()`) takes `init="init_weights"` instead: every rank gets the
        values of `torch.manual_seed(seed); model.to_empty(device="cpu"); model.init_weights()`
        on one process, for the part it holds (components/root_init.py)."""
        if self.model is not None:
            raise UsageError("setup() was already called on this session: keep using the model, "
                             "optimizer and loader it returned, or make a new Session for another model")
        if init is not None and isinstance(model, nn.Module) and not has_meta(uncompiled(model)):
            raise ConfigError(f"setup(..., init={init!r}) initialises a model built on the meta device; this one "
                              f"holds real tensors already: call model.{init}() yourself before setup, or build "
                              "the model under torch.device('meta')")
        if isinstance(model, nn.Module):
            refuse_sync_batchnorm_off_gpu(uncompiled(model), self.device)
        self.given = describe(model, optimizer)
        self._label_shift = label_shift(uncompiled(model))  # what weight="tokens" counts (data/batch.py)
        self.hooks.on_setup(model)
        if self.activation_checkpointing is not None:
            checkpoint_activations(uncompiled(model), self.activation_checkpointing)
        self.model, self.optimizer = self.strategy.setup(model, optimizer, self.grid,
                                                         init=MetaInit(self.seed, init_fn, init))
        retire_replaced(optimizer, self.optimizer, self.strategy.name)
        if self.nan_check and self.scaler is None and self.max_grad_norm is None:  # else the
            self.model.watch_reductions()  # unscale or the norm is the check (session/step.py)
        self._on_device = DeviceCheck() if DeviceCheck.wanted(self.optimizer, self.scaler, self.nan_check) else None
        self.loader = self.shard_loader(loader) if loader is not None else None
        if self.loader is not None:
            self.loader.count_epochs(lambda: self.epoch, self.end_epoch)  # (data/loader.py)
        self.step_boundary = position(self) if self.accumulate > 1 else None
        out = [self.model] + [x for x in (self.optimizer, self.loader) if x is not None]
        return out[0] if len(out) == 1 else tuple(out)

    # -- the step ----------------------------------------------------------------------------------

    def train_step(self, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                   weight: float | torch.Tensor | str | None = None) -> torch.Tensor:
        """Forward `inputs`, `loss_fn(outputs, targets)`, backward, and — on the last of
        `accumulate` micro-batches — clip and step. Returns the (unscaled) loss, detached.
        `batch`: (inputs, targets), or a dict of model inputs whose model computes its own loss
        when loss_fn is left out (data/batch.py). `weight`: what the loss is a mean over (its number
        of valid tokens; "tokens" counts the labels that are not -100); see `backward`."""
        inputs, targets, loss_fn, weight = unpack(to_device(batch, self.device), loss_fn, weight, self._label_shift)
        model = self._require_model()
        if not self._sizes_compared:
            self._compare_sizes(model, inputs, weight)
        self.hooks.on_batch(inputs)
        with self.accumulation():
            loss = model.forward_backward(inputs, targets, loss_fn or model.default_loss, self._loss_factor(weight))
        self._check_finite(loss)  # a NaN loss (a pipeline's: the mean of its micro-batches') is named at the step
        self.hooks.on_loss(loss, weight)
        self.last_loss = loss
        self.step()
        return loss

    def _compare_sizes(self, model: ParallelModule, inputs: Any, weight: Any) -> None:
        """Warn once when the replicas' first batches differ in size and no weight= weighs them
        (a pipeline's stages compare theirs themselves: parallel/pipeline/p2p.py)."""
        self._sizes_compared = True
        if weight is None and self.world_size > 1 and model.replicas > 1 and model.supports_token_weights:
            said = uneven_warning(batch_len(inputs))
            if said is not None and self.rank == 0:
                warnings.warn(said, UnevenBatchWarning, stacklevel=3)

    def accumulation(self) -> contextlib.AbstractContextManager[bool]:
        """Wrap forward and backward of one micro-batch: on all but the last of `accumulate`
        micro-batches, gradients accumulate locally with no communication. Under precision
        "bf16"/"fp16" the block runs under `torch.autocast`. Yields whether this micro-batch
        ends an optimizer step."""
        if self._in_micro_batch:
            raise UsageError(f"accumulation() was entered again before session.step(): call step() after "
                             f"every micro-batch's backward (it steps the optimizer on every {self.accumulate}"
                             f"th call, accumulate={self.accumulate}), not once after several blocks")
        self._in_micro_batch = True
        last = (self.micro_step + 1) % self.accumulate == 0
        micro_batch = MicroBatch(last, self._weights, self._losses, abandoned=self._abandon_micro_batch)
        if last and self.autocast_dtype is None:  # nothing to enter: the common case costs no generator
            return micro_batch
        return self._micro_batch(micro_batch)

    @contextlib.contextmanager
    def _micro_batch(self, micro_batch: MicroBatch) -> Iterator[bool]:
        sync = contextlib.nullcontext() if micro_batch.last else self._require_model().no_sync()
        with micro_batch, sync, self.autocast():
            yield micro_batch.last

    def _abandon_micro_batch(self) -> None:
        self._in_micro_batch = False  # an error inside accumulation(): the loop may go on

    def autocast(self) -> contextlib.AbstractContextManager:
        """`torch.autocast` in the session's precision on its device (nothing for "32").
        Strategies run backward inside `forward_backward` (a pipeline interleaves the two), each
        backward with autocast turned off (parallel/base.py, backward_no_autocast), as torch's recipe has it."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor | None = None) -> None:
        """Backward of `loss / accumulate`, so k micro-batches of the mean loss sum to the mean
        over one k-times-larger batch (times the loss scale under fp16).

        Token-weighted losses: when each micro-batch's loss is a mean over a different number of
        items (valid tokens of a padded batch), pass that number as `weight` on every micro-batch
        of every rank; the step's gradient is then that of the mean over every token of every
        micro-batch and rank, as one process would compute it (how: components/accumulation.py).

            mask = targets != PAD
            loss = session.train_step((x, targets), lambda out, y: F.cross_entropy(
                out.flatten(0, 1), y.flatten(), ignore_index=PAD), weight=mask.sum())"""
        self._check_finite(check_loss(loss))
        self.last_loss = loss.detach()  # the progress bar's and the automatic rows' loss
        self.hooks.on_loss(self.last_loss, weight)
        backward_no_autocast(scaled(loss, self._loss_factor(weight)))

    def _loss_factor(self, weight: float | torch.Tensor | None) -> float:
        """What backward multiplies this micro-batch's loss by: 1/accumulate, or its weight
        (normalised in step()), times the fp16 loss scale."""
        if weight is not None and not self._require_model().supports_token_weights:
            raise UsageError(f"weight= is not supported with strategy {self.strategy.name!r} yet: it cuts batches "
                             "itself (a pipeline's micro-batches, balanced DataParallel's per-device losses), so a "
                             "batch's weight cannot weigh its pieces; pass losses averaged over equal token counts")
        factor = self._weights.add(weight, self.accumulate)
        return factor * (self.scaler.scale_value if self.scaler is not None else 1.0)

    def step(self) -> bool:
        """Count a micro-batch; at the end of each accumulation, normalise token-weighted
        gradients, unscale (fp16), clip, step and zero the gradients. Returns True when the
        optimizer stepped (under fp16 every rank skips a step whose gradients overflowed; a step
        checked on the device says True, and its error comes at the next one: nan_check)."""
        self.micro_step += 1
        self._in_micro_batch = False
        if self.micro_step % self.accumulate:
            note_micro_step(self, optimizer_step=False)
            return False
        if self.optimizer is None:
            raise UsageError("step() needs an optimizer: pass it to session.setup(model, optimizer)")
        model = self._require_model()
        result = optimizer_step(model, self.optimizer, weights=self._weights, scaler=self.scaler,
                                max_grad_norm=self.max_grad_norm, check_finite=self.nan_check, losses=self._losses,
                                on_device=self._on_device, before_step=self.hooks.before_step(model))
        note_micro_step(self, optimizer_step=True)  # the loader's count, the step boundary (session/resume.py)
        self.hooks.after_step(self, result)  # may end the run (`paratrain verify`, preemption)
        return result.stepped

    def _check_finite(self, loss: torch.Tensor) -> torch.Tensor:
        if self.nan_check:  # read at the optimizer step, with the gradients: no wait per micro-batch
            self._losses.add(loss, self.micro_step, self.epoch)
        return loss

    # -- the job and the model -------------------------------------------------------------------

    rank = property(lambda self: self.topology.rank)  # global rank
    world_size = property(lambda self: self.topology.world_size)
    device = property(lambda self: self.topology.device)  # this rank's device
    is_main = property(lambda self: self.topology.is_main)  # global rank 0

    def to_device(self, batch: Any) -> Any:
        """`batch` with every tensor moved to this rank's device."""
        return to_device(batch, self.device)

    def progress(self, loader: Iterable, desc: str | None = None) -> Iterator[Any]:
        """Iterate `loader` once, with a progress bar on rank 0 showing the loss and global samples
        per second. For the training loader setup() returned, a full pass is one epoch: its
        sampler is reshuffled for `session.epoch`, which then advances (also when the loop
        iterates that loader itself). Other loaders (validation) are iterated as they are."""
        return progress(self, loader, desc)

    def shard_loader(self, loader: DataLoader) -> DataLoader:
        """The same loader, reading this replica's share: batch_size/replicas per step (data/loader.py).
        Under Session(checkpoint_on_preempt=...) its workers leave the signals to the rank."""
        model = self._require_model()
        sharded = shard_loader(loader, replicas=model.replicas, index=model.replica_index, seed=self.seed,
                               rank=self.rank, pin_memory=self.device.type == "cuda",
                               ignored_signals=SIGNALS if self.preemption is not None else ())
        model.check_loader(sharded)
        return sharded

    def end_epoch(self) -> None:
        """A complete pass over the training loader ended (data/loader.py): the next reads the next epoch."""
        if self._on_device is not None:  # the pass's last step, checked on the device (session/step.py)
            self._on_device.raise_pending()
        self.epoch += 1

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on global rank 0 only."""
        if self.is_main:
            print(*args, **kwargs, flush=True)

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """The user's own model inside the strategy's wrapper (for evaluation, export). Under
        ZeRO stage 3 its parameters are gathered only inside the wrapper's forward: evaluate
        through the wrapped model, or load `full_state_dict()` into a fresh copy."""
        model = model or self._require_model()
        return uncompiled(model.module if isinstance(model, ParallelModule) else model)

    def gather_embeddings(self, x: torch.Tensor, scope: str = "world") -> Gathered:
        """Every rank's rows of `x` ("world"), this node's ranks' ("node") or this rank's own
        ("local"), differentiable: gradients go back to each row's rank. For contrastive losses
        with negatives from every rank: `pt.nt_xent_loss(z1, z2, gather=session.gather_embeddings)`.
        A collective: every rank calls it."""
        groups = self.grid.node_groups() if scope == "node" else None  # built on first use
        return gather_embeddings(x, scope=scope, groups=groups)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Parameters of the whole model given to setup() (tied weights once), whatever part of it
        this rank holds: what model-size and MFU arithmetic needs, also under ZeRO-3 and pipelines."""
        return self.given.trainable if trainable_only else self.given.parameters

    @property
    def rank_seed(self) -> int:
        """A seed that differs between ranks, for code that must draw differently on each (its own
        batch sampling); `Session(seed=...)` seeds torch alike on every rank."""
        return self.seed * 100_003 + 1 + self.rank

    @within("session.full_state_dict")
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict with its own keys, on every rank (a collective)."""
        return full_state_dict(self._require_model())

    def log(self, step: int | None = None, **metrics: Any) -> dict[str, float]:
        """Average scalar `metrics` over ranks and append them as one row of `log_dir/metrics.csv`
        on rank 0 (paratrain/components/metrics.py). `step` defaults to the optimizer steps taken. A
        collective: every rank calls it with the same names. Returns the means."""
        if self.metrics is None:
            raise UsageError("log() writes to Session(log_dir=...), and this session has none; pass "
                             "log_dir, or average without writing with paratrain.distributed.comm.mean_metrics")
        step = self.micro_step // self.accumulate if step is None else step
        return self.metrics.log(step, **metrics)

    # -- checkpoints (what a session adds to one: session/resume.py) ----------------------------


    def register(self, **objects: Any) -> None:
        """Save these objects' `state_dict()` with every checkpoint and load it back, under their
        names: `session.register(scheduler=scheduler)`. Anything with state_dict() and
        load_state_dict() whose state is JSON: LR schedulers, counters of your own. An object
        registered after a load or resume gets the state the checkpoint holds under its name."""
        for name, obj in objects.items():
            check_registrable(name, obj)
        self.registered.update(objects)
        for name, obj in objects.items():
            if name in self.unclaimed:
                obj.load_state_dict(self.unclaimed.pop(name))

    @within("session.save")
    def save(self, path: str | os.PathLike) -> Path:
        """Save model, optimizer, epoch and micro-step, the sampler's position, registered objects
        and every rank's RNG states to `path` (checkpoint/save_load.py: sharded, atomic). A collective:
        every rank calls it."""
        if self._on_device is not None:  # the last step's check, if still in flight (session/step.py)
            self._on_device.raise_pending()
        refuse_non_finite(self._require_model(), path)
        state, rng = session_state(self)
        return checkpoint.save(path, self._require_model(), self.optimizer, state=state, rng=rng)

    @within("session.load")
    def load(self, path: str | os.PathLike, *, weights_only: bool = False,
             hyperparameters: str = "checkpoint") -> None:
        """Load a checkpoint written by `save` under any strategy and world size; training then
        continues exactly where it stopped (RNG states too, when the world size is the same).

        weights_only: load the model's parameters and buffers only (fine-tuning from it, or
            another optimizer): the optimizer, step, data position and RNG stay as they are.
        hyperparameters: "checkpoint" (the default: learning rates and the like come back as they
            were saved, so a schedule goes on where it stopped; a value that differs from yours is
            named in a warning) or "current" (keep this optimizer's own)."""
        if hyperparameters not in ("checkpoint", "current"):
            raise ConfigError(f"hyperparameters must be 'checkpoint' or 'current'; got {hyperparameters!r}")
        optimizer = None if weights_only else self.optimizer
        if self._on_device is not None:  # a skipped step's error is not lost to a reload (session/step.py)
            self._on_device.raise_pending()
        if optimizer is not None:
            path = Path(path)
            marker = checkpoint_files.read_marker(path) if (path / checkpoint_files.MARKER).is_file() else {}
            check_same_optimizer(self, path, marker, keep_current=hyperparameters == "current")
            check_whole_window(self, path, marker)
        loaded = checkpoint.load(path, self._require_model(), optimizer,
                                 hyperparameters=hyperparameters == "checkpoint")
        if not weights_only:
            restore_session(self, loaded, path)

    @within("session.checkpoint")
    def checkpoint(self, root: str | os.PathLike, keep: int = 3) -> Path:
        """Save to `root/step-<optimizer steps>` and keep the newest `keep` checkpoints there (in
        the order they were written). The first call locks `root` for this job until close()."""
        checkpoint.lock_root(root, owner=self)
        path = self.save(Path(root) / f"step-{self.micro_step // self.accumulate:08d}")
        checkpoint.prune(root, keep)
        return path

    @within("session.resume")
    def resume(self, root: str | os.PathLike, *, required: bool = False,
               weights_only: bool = False, hyperparameters: str = "checkpoint") -> bool:
        """Load the newest intact checkpoint under `root` (or `root` itself, when it is one); a
        damaged one is skipped with a warning. Say whether one was loaded; `required=True` makes
        finding none a ConfigError that says where it looked. The other arguments are load()'s."""
        load = functools.partial(self.load, weights_only=weights_only, hyperparameters=hyperparameters)
        return checkpoint.resume(root, load, required=required) is not None

    @within("session.export")
    def export(self, path: str | os.PathLike) -> Path | None:
        """The whole model as one `.safetensors` file for inference, with the plain model's
        state-dict keys, written by rank 0 as it gathers the model a piece at a time (a ZeRO-3
        unit, a pipeline stage: checkpoint/export.py). A collective; returns the path on rank 0."""
        return export_model(path, self._require_model())

    # -- end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the metrics files, release the checkpoint root's lock, tear down the process group;
        then raise the last step's error if its check was still on its way (session/step.py, DeviceCheck)."""
        pending, self._on_device = self._on_device, None
        if self.metrics is not None:
            self.metrics.close()
        if self.preemption is not None:
            self.preemption.restore()
        checkpoint.unlock_roots(owner=self)
        destroy()
        if pending is not None:
            pending.raise_pending()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None and not issubclass(exc[0], SystemExit):  # that error stands alone
            self._on_device = None
        self.close()

    def _require_model(self) -> nn.Module:
        if self.model is None:
            raise UsageError("call session.setup(model, optimizer, loader) before training")
        return self.model


def refuse_sync_batchnorm_off_gpu(model: nn.Module, device: torch.device) -> None:
    """torch's nn.SyncBatchNorm raises at its first training forward on a CPU tensor whenever a
    process group exists ("expected input tensor to be on GPU", torch/nn/modules/batchnorm.py):
    refused at setup instead, with what to use (docs/strategies/ddp.md, "BatchNorm")."""
    if device.type not in ("cpu", "mps"):
        return
    synced = [name or type(model).__name__ for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if synced:
        raise ConfigError(f"{', '.join(synced[:3])}{' …' if len(synced) > 3 else ''} "
                          f"{'is a' if len(synced) == 1 else 'are'} torch.nn.SyncBatchNorm, which runs on GPUs only "
                          f"(this job's device is {device.type}): keep nn.BatchNorm on the CPU (each rank normalises "
                          "with its own batch's statistics; the running statistics are rank 0's, broadcast as DDP "
                          "does), or train on GPUs with the nccl backend")
