"""DistributedDataParallel, implemented here: one process per device, gradients averaged.

Algorithm (Li et al., "PyTorch Distributed", VLDB 2020; torch/nn/parallel/distributed.py):

- Construction: check every rank holds the same parameter shapes, broadcast rank 0's
  parameters and buffers, and lay the gradients out in buckets (buckets.py).
- Forward: broadcast rank 0's buffers (BatchNorm statistics) so all replicas agree; with
  `find_unused_parameters`, walk the autograd graph from the outputs to find the parameters
  this forward did not use; tell the gradient sync (grad_sync.py) whether the coming backward
  synchronises.
- Backward: grad_sync.py's hooks move each final gradient into its bucket and start a full
  bucket's reduction while backward goes on; when backward ends `.grad` holds the average.
- `no_sync()`: forwards and backwards inside it only accumulate, in the buckets, locally.
- `join()`: ranks with different numbers of batches; one that runs out mirrors the others'
  collectives until all have (ddp_join.py, torch's Join / Joinable protocol).

The reduction of a bucket is a component (`reduction=`): an all-reduce by default; hierarchical
data parallel and ZeRO stages 1-2 pass their own, and `register_comm_hook` swaps in one of torch's
communication hooks (comm_hooks.py). The constructor otherwise takes the arguments of
`torch.nn.parallel.DistributedDataParallel`, and the wrapped model sits at `.module`, so
state-dict keys match torch's and porting a script means changing one import.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils._pytree import tree_flatten, tree_map

from paratrain.components.materialize import MetaInit, whole
from paratrain.distributed.comm import broadcast_coalesced
from paratrain.distributed.grid import ProcessGrid
from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.base import ParallelModule, Strategy, owned
from paratrain.parallel.buckets import AllReduce, ReducedSums, Reduction, default_caps
from paratrain.parallel.comm_hooks import CommHookReduction, check_comm_hook
from paratrain.parallel.ddp_join import DDPJoinHook, training_rank_collectives
from paratrain.parallel.grad_sync import GradSync

_UNSUPPORTED = ("delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision")


class DistributedDataParallel(ParallelModule, Joinable):
    """Data parallelism across processes. Arguments as torch's DistributedDataParallel:

    module: the model, already on this rank's device.
    device_ids: `[local_rank]` for a CUDA model (inputs are moved there); None for CPU.
    broadcast_buffers / forward_sync_buffers: broadcast rank 0's buffers at every forward.
    init_sync: check shapes and broadcast rank 0's parameters and buffers at construction.
    process_group / device_mesh: the data-parallel group (default: the whole world).
    bucket_cap_mb / bucket_cap_mb_list: bucket size cap(s) in MiB (torch's defaults: the first
        bucket 1 MiB, the others 25; a given cap applies to every bucket).
    find_unused_parameters: allow parameters that get no gradient in some iterations.
    gradient_as_bucket_view: accepted; gradients are always views into the buckets here.
    Accepted and ignored as in torch, with no effect on results: output_device, dim,
    check_reduction, static_graph, skip_all_reduce_unused_params, batched_grad_copy.
    reduction (paratrain's own, keyword only): how each bucket is reduced over the group
        (buckets.Reduction; default an all-reduce).
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False, gradient_as_bucket_view=False,
                 static_graph=False, delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None, *,
                 reduction: Reduction | None = None):
        super().__init__()
        Joinable.__init__(self)  # join() off until a Join context turns it on
        _refuse_unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                            param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision)
        if not dist.is_initialized():
            raise UsageError("DistributedDataParallel needs the default process group: call "
                             "paratrain.Topology.from_env().init() (or use paratrain.Session) first")
        self.module = module
        self.process_group = device_mesh.get_group() if device_mesh is not None else process_group
        self.replicas = dist.get_world_size(self.process_group)
        self.replica_index = dist.get_rank(self.process_group)
        self.device_ids = device_ids
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = _buffer_sync_flag(broadcast_buffers, forward_sync_buffers)
        self.require_forward_param_sync = True  # broadcast buffers at the next forward (torch's name)
        self._divide_by_initial_world_size = True  # under join(): see ddp_join.py
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ConfigError("the module has no parameter that requires a gradient; "
                              "DistributedDataParallel has nothing to synchronise")
        sparse = [n or "the model" for n, m in module.named_modules()
                  if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
        if sparse:
            raise ConfigError(f"{', '.join(sparse[:3])} give{'s' * (len(sparse) == 1)} sparse gradients "
                              "(sparse=True), which paratrain's DDP and ZeRO stages 1-2 cannot reduce (their "
                              "buckets are dense): build it with sparse=False, or use ZeRO stage 3")
        self.modules_buffers = list(module.buffers())  # listed once, as torch's DDP
        if init_sync:
            self._check_same_model_everywhere()
            broadcast_coalesced(list(module.parameters()), self.process_group)
            if broadcast_buffers is not False:
                broadcast_coalesced(self.modules_buffers, self.process_group)
        self._grad_sync = GradSync(self._params, {p: n for n, p in module.named_parameters()},
                                   self.process_group, reduction=reduction or AllReduce(self.process_group),
                                   caps=bucket_caps(bucket_cap_mb, bucket_cap_mb_list),
                                   find_unused=find_unused_parameters)

    @property
    def _buckets(self):
        """The gradient buckets (their layout changes once, after the first synchronised backward)."""
        return self._grad_sync.buckets

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0]) if isinstance(self.device_ids[0], int) \
                else torch.device(self.device_ids[0])
            inputs, kwargs = tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, (inputs, kwargs))
        ranks_training = None
        if self._join_config.enable:  # inside join(): collectives that a joined rank mirrors
            ranks_training = training_rank_collectives(self, Join.notify_join_context(self),
                                                       self._divide_by_initial_world_size)
        elif self.will_sync_module_buffers():
            self.sync_module_buffers()
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():  # a no-grad forward (evaluation) builds no backward to plan
            # as torch's DDP (`_post_forward`): the forward after a no_sync() forward skips the
            # buffer broadcast, so accumulation costs no communication at all
            sync = self.require_forward_param_sync = self.require_backward_grad_sync
            unused = []
            if sync and self.find_unused_parameters:
                used = _params_reached_from(output)
                unused = [p for p in self._params if p not in used]
            self._grad_sync.prepare(sync, unused, ranks_training)
        return output

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (torch's name)."""
        return self.broadcast_buffers and self.require_forward_param_sync and bool(self.modules_buffers)

    def sync_module_buffers(self, src: int = 0) -> None:
        """Overwrite every rank's buffers with those of rank `src` of the group."""
        broadcast_coalesced(self.modules_buffers, self.process_group, src)

    def sync_buffers(self) -> None:
        if self.broadcast_buffers and self.modules_buffers:
            self.sync_module_buffers()

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """torch's: from the next backward on, each gradient bucket is reduced by `hook(state,
        bucket)`, which returns a torch.futures.Future holding the reduced bucket (torch's hooks
        in torch.distributed.algorithms.ddp_comm_hooks work as they are; comm_hooks.py). As in
        torch, the gradients reach the hook undivided, and a DDP takes one hook."""
        check_comm_hook(hook)
        reduction = self._grad_sync.reduction
        if isinstance(reduction, CommHookReduction):
            raise UsageError("register_comm_hook can only be called once on a DistributedDataParallel "
                             "(as in torch); register one hook that does all of the reduction")
        if type(reduction) is not AllReduce:
            raise ConfigError(f"{type(self).__name__} reduces its gradient buckets its own way "
                              f"({type(reduction).__name__}); a communication hook can replace only "
                              "the all-reduce of a plain paratrain.DistributedDataParallel")
        self._grad_sync.set_reduction(CommHookReduction(state, hook))

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch's: `with ddp.join(): for batch in my_share: ...` lets ranks hold different
        numbers of batches; one that runs out mirrors the others' collectives until all have, then
        every rank takes the model of the last to finish (ddp_join.py).
        divide_by_initial_world_size: average gradients over all N ranks (True; each sample
            weighs the same) or over those still training (False).
        throw_on_early_termination: instead, raise on every rank once one runs out."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The Joinable protocol: what a joined rank runs (kwargs: divide_by_initial_world_size)."""
        self._divide_by_initial_world_size = kwargs.get("divide_by_initial_world_size", True)
        return DDPJoinHook(self, self._grad_sync)

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device

    @property
    def join_process_group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def watch_reductions(self) -> None:
        """Sum each bucket as its all-reduce completes (buckets.AllReduce); a communication hook
        registered later reduces its own way, and the check then reads the buckets at the step.
        On CPU, above ReducedSums.LIMIT elements, each rank sums its 1/N of every bucket and the
        ranks' sums are all-reduced at the step: on CPU, reading the buckets of a model of tens of
        millions of parameters costs milliseconds a step, which N ranks share for the price of one
        small all-reduce (bench/session.py measures the whole check). On a GPU the read takes
        microseconds and the all-reduce would add a collective's latency."""
        if isinstance(self._grad_sync.reduction, AllReduce):
            elements = sum(p.numel() for p in self._params)
            group = self.process_group if self.process_group is not None else dist.group.WORLD
            share = ((self.replica_index, self.replicas, group)
                     if self.replicas > 1 and elements > ReducedSums.LIMIT and self._params[0].device.type == "cpu"
                     else None)
            self._grad_sync.reduction.sums = ReducedSums(share)

    def reduced_finite(self) -> torch.Tensor | None:
        sums = self._grad_sync.reduction.sums
        return sums.take() if sums is not None else None

    def local_grads(self) -> tuple[list[torch.Tensor], Any]:
        """The buckets: every gradient is a view into one, so scaling or checking a few flat
        buffers is scaling or checking every gradient, in a few kernels instead of one per
        parameter. Equal on every rank after backward: nothing to reduce."""
        return [bucket.buffer for bucket in self._buckets.buckets], None

    def _check_same_model_everywhere(self) -> None:
        shapes = [tuple(p.shape) for p in self.module.parameters()]
        signature = torch.tensor([len(shapes), sum(p.numel() for p in self.module.parameters()),
                                  hash(tuple(shapes)) % (2**31)], dtype=torch.int64)
        if self._params[0].device.type == "cuda":
            signature = signature.cuda()
        everyone = [torch.zeros_like(signature) for _ in range(self.replicas)]
        dist.all_gather(everyone, signature, group=self.process_group)
        for rank, other in enumerate(everyone):
            if not torch.equal(other, everyone[0]):
                raise ConfigError(f"rank {rank} holds a model with different parameter shapes from "
                                  "rank 0; every rank must build the same model before wrapping it")


@dataclass(frozen=True)
class DDP(Strategy):
    """Data parallel, one process per device, gradients all-reduced in buckets during backward."""

    name = "ddp"
    bucket_cap_mb: float | None = None  # size cap of every gradient bucket (None: 1 MiB first, then 25)
    find_unused_parameters: bool = False  # allow parameters that get no gradient in a step
    broadcast_buffers: bool = True  # broadcast rank 0's buffers (BatchNorm statistics) each forward

    def setup(self, model: nn.Module, optimizer, grid: ProcessGrid, *, init: MetaInit | None = None):
        wrapped = DistributedDataParallel(whole(model, init).to(grid.topology.device), **self.ddp_kwargs(grid))
        return wrapped, owned(optimizer, model)

    def ddp_kwargs(self, grid: ProcessGrid) -> dict:
        """The DistributedDataParallel arguments these settings stand for."""
        device = grid.topology.device
        return dict(device_ids=[device.index] if device.type == "cuda" else None, process_group=grid.data_group(),
                    bucket_cap_mb=self.bucket_cap_mb, find_unused_parameters=self.find_unused_parameters,
                    broadcast_buffers=self.broadcast_buffers)


def _refuse_unsupported(**given) -> None:
    for name in _UNSUPPORTED:
        if given[name] is not None:
            raise ConfigError(f"paratrain.DistributedDataParallel does not support {name}; "
                              "remove it (for mixed precision, wrap the forward in torch.autocast, "
                              "or use ZeRO stage 3's param_dtype)")


def bucket_caps(bucket_cap_mb: float | None, bucket_cap_mb_list: list[float] | None) -> list[int]:
    """Bucket caps in bytes, as torch's `BucketCapacityConfig`: a given cap applies to every
    bucket; only the default has a small (1 MiB) first bucket, so its all-reduce starts early."""
    if bucket_cap_mb_list:
        return [int(mb * 2**20) for mb in bucket_cap_mb_list]
    if bucket_cap_mb is None:
        return default_caps()
    return [int(bucket_cap_mb * 2**20)]


def _buffer_sync_flag(broadcast_buffers, forward_sync_buffers) -> bool:
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers)
    return True if broadcast_buffers is None else bool(broadcast_buffers)


def _tensors_in(output: Any) -> list[torch.Tensor]:
    """Every tensor in `output`: in its containers (pytree) and in dataclasses (as torch's DDP)."""
    found, stack = [], [output]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            found.append(item)
        elif is_dataclass(item) and not isinstance(item, type):
            stack.extend(getattr(item, field.name) for field in fields(item))
        else:
            leaves = tree_flatten(item)[0]
            if leaves != [item]:
                stack.extend(leaves)
    return found


def _params_reached_from(output: Any) -> set[torch.Tensor]:
    """Leaf tensors whose gradient the autograd graph of `output` will compute."""
    leaves, seen = set(), set()
    stack = [t.grad_fn for t in _tensors_in(output) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: the node that writes a leaf's .grad
            leaves.add(fn.variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves
