"""DistributedDataParallel, implemented here: one process per device, gradients averaged.

Algorithm (Li et al., "PyTorch Distributed", VLDB 2020; torch/nn/parallel/distributed.py):

- Construction: check every rank holds the same parameter shapes, broadcast rank 0's
  parameters and buffers, and lay the gradients out in buckets (see buckets.py).
- Forward: broadcast rank 0's buffers (BatchNorm statistics) so all replicas agree; with
  `find_unused_parameters`, walk the autograd graph from the outputs to find the parameters
  this forward did not use.
- Backward: a post-accumulate-grad hook fires on each parameter once its gradient is final;
  it moves the gradient into its bucket and marks it ready. A full bucket starts an async
  all-reduce while backward goes on. A callback queued on the autograd engine runs when backward
  ends: it waits for every all-reduce, so `.grad` holds the average when `backward()` returns.
- `no_sync()`: forwards and backwards inside it only accumulate, in the buckets, locally.

The constructor takes the arguments of `torch.nn.parallel.DistributedDataParallel`, and the
wrapped model sits at `.module`, so state-dict keys match torch's and porting a script means
changing one import.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from paratrain.comm import broadcast_coalesced
from paratrain.errors import ConfigError, UsageError
from paratrain.parallel.buckets import DEFAULT_BUCKET_MB, FIRST_BUCKET_BYTES, GradBuckets

_UNSUPPORTED = ("delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision")


class DistributedDataParallel(nn.Module):
    """Data parallelism across processes. Arguments as torch's DistributedDataParallel:

    module: the model, already on this rank's device.
    device_ids: `[local_rank]` for a CUDA model (inputs are moved there); None for CPU.
    broadcast_buffers / forward_sync_buffers: broadcast rank 0's buffers at every forward.
    init_sync: check shapes and broadcast rank 0's parameters and buffers at construction.
    process_group / device_mesh: the data-parallel group (default: the whole world).
    bucket_cap_mb / bucket_cap_mb_list: bucket size cap(s) in MiB.
    find_unused_parameters: allow parameters that get no gradient in some iterations.
    gradient_as_bucket_view: accepted; gradients are always views into the buckets here.
    Accepted and ignored as in torch, with no effect on results: output_device, dim,
    check_reduction, static_graph, skip_all_reduce_unused_params, batched_grad_copy.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0,
                 broadcast_buffers=None, init_sync=True, process_group=None, bucket_cap_mb=None,
                 find_unused_parameters=False, check_reduction=False, gradient_as_bucket_view=False,
                 static_graph=False, delay_all_reduce_named_params=None, param_to_hook_all_reduce=None,
                 mixed_precision=None, device_mesh=None, skip_all_reduce_unused_params=False,
                 bucket_cap_mb_list=None, batched_grad_copy=False, forward_sync_buffers=None):
        super().__init__()
        given = dict(delay_all_reduce_named_params=delay_all_reduce_named_params,
                     param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision)
        for name in _UNSUPPORTED:
            if given[name] is not None:
                raise ConfigError(f"paratrain.DistributedDataParallel does not support {name}; "
                                  "remove it (for mixed precision, wrap the forward in torch.autocast, "
                                  "or use ZeRO stage 3's param_dtype)")
        if not dist.is_initialized():
            raise UsageError("DistributedDataParallel needs the default process group: call "
                             "paratrain.Topology.from_env().init() (or use paratrain.Session) first")
        self.module = module
        self.process_group = device_mesh.get_group() if device_mesh is not None else process_group
        self.device_ids = device_ids
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = _buffer_sync_flag(broadcast_buffers, forward_sync_buffers)
        self.require_backward_grad_sync = True  # False inside no_sync(), read at forward time
        self._require_forward_param_sync = True  # broadcast buffers at the next forward
        self._params = [p for p in module.parameters() if p.requires_grad]
        if not self._params:
            raise ConfigError("the module has no parameter that requires a gradient; "
                              "DistributedDataParallel has nothing to synchronise")
        self._names = {p: n for n, p in module.named_parameters()}
        if init_sync:
            self._check_same_model_everywhere()
            broadcast_coalesced(list(module.parameters()), self.process_group)
            if broadcast_buffers is not False:
                broadcast_coalesced(list(module.buffers()), self.process_group)
        caps = [FIRST_BUCKET_BYTES] + [int((bucket_cap_mb or DEFAULT_BUCKET_MB) * 2**20)]
        if bucket_cap_mb_list:
            caps = [int(mb * 2**20) for mb in bucket_cap_mb_list]
        self._buckets = self._build_buckets(list(reversed(self._params)), caps)
        self._sync_this_backward = False  # decided by the forward that built the graph
        self._in_backward = False
        self._unused: list[nn.Parameter] = []
        # Hooks are the mechanism: each fires once per backward, after autograd has summed
        # all contributions into p.grad (tied weights included), so p.grad is final.
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._params]

    def _build_buckets(self, params: list[nn.Parameter], caps: list[int]) -> GradBuckets:
        """The bucket layout and reduction; sharded data parallel (zero.py) overrides it."""
        return GradBuckets.build(params, caps, self.process_group)

    # -- forward -------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.device_ids:
            device = torch.device("cuda", self.device_ids[0]) if isinstance(self.device_ids[0], int) \
                else torch.device(self.device_ids[0])
            inputs, kwargs = tree_map(lambda t: t.to(device) if torch.is_tensor(t) else t, (inputs, kwargs))
        if self.broadcast_buffers and self._require_forward_param_sync:
            broadcast_coalesced(list(self.module.buffers()), self.process_group)
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled():  # a no-grad forward (evaluation) builds no backward to plan
            # as torch's DDP (`_post_forward`): the forward after a no_sync() forward skips the
            # buffer broadcast, so accumulation costs no communication at all
            self._require_forward_param_sync = self.require_backward_grad_sync
            self._sync_this_backward = self.require_backward_grad_sync
            self._in_backward = False
            self._unused = []
            if self._sync_this_backward and self.find_unused_parameters:
                used = _params_reached_from(output)
                self._unused = [p for p in self._params if p not in used]
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, with no communication, for the forwards and backwards
        inside; the first backward after it averages everything accumulated."""
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # -- backward ------------------------------------------------------------------------------

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        # fires on the autograd thread, in the middle of backward
        if not self._sync_this_backward:
            self._buckets.adopt_grad(p)
            return
        if not self._in_backward:
            self._start_backward()
        self._buckets.adopt_grad(p, average=True)
        self._buckets.mark_ready(p)

    def _start_backward(self) -> None:
        self._in_backward = True
        self._buckets.reset()
        # runs once, when the whole backward pass has finished
        Variable._execution_engine.queue_callback(self._finish_backward)
        for p in self._unused:  # contribute what they hold (zero if nothing) to the average
            self._buckets.adopt_grad(p, average=True, zero_if_missing=True)
            self._buckets.mark_ready(p)

    def _finish_backward(self) -> None:
        self._in_backward = False
        missing = self._buckets.missing()
        self._buckets.finish_grad_sync()
        if missing:
            names = ", ".join(self._names.get(p, "?") for p in missing[:10])
            advice = ("they were reached from the model's outputs but not from the loss: use every "
                      "output in the loss" if self.find_unused_parameters else
                      "pass find_unused_parameters=True to DistributedDataParallel (or pt.DDP)")
            raise UsageError(f"{len(missing)} parameter(s) got no gradient in this backward: {names}; "
                             f"{advice}, or remove them from the model (or set requires_grad=False)")
        if self.find_unused_parameters:  # on every rank: which parameters are unused differs
            self._settle_unused()

    def _settle_unused(self) -> None:
        """A parameter that this rank did not use but another did (in any micro-batch since the
        last sync: then it holds a gradient) gets the average as its gradient; one that no rank
        used keeps None, as in torch, so optimizers skip it exactly as single-process training
        would. Collective: one small all-reduce of a used-bitmap."""
        used = torch.tensor([p.grad is not None for p in self._params], dtype=torch.int32,
                            device=self._params[0].device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group)
        for p, anywhere in zip(self._params, used.tolist()):
            if anywhere and p.grad is None:
                bucket, slot = self._buckets.slot_of[p]
                p.grad = bucket.view(slot)

    def _check_same_model_everywhere(self) -> None:
        shapes = [tuple(p.shape) for p in self.module.parameters()]
        signature = torch.tensor([len(shapes), sum(p.numel() for p in self.module.parameters()),
                                  hash(tuple(shapes)) % (2**31)], dtype=torch.int64)
        if self._params[0].device.type == "cuda":
            signature = signature.cuda()
        everyone = [torch.zeros_like(signature) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(everyone, signature, group=self.process_group)
        for rank, other in enumerate(everyone):
            if not torch.equal(other, everyone[0]):
                raise ConfigError(f"rank {rank} holds a model with different parameter shapes from "
                                  "rank 0; every rank must build the same model before wrapping it")


def _buffer_sync_flag(broadcast_buffers, forward_sync_buffers) -> bool:
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers)
    return True if broadcast_buffers is None else bool(broadcast_buffers)


def _params_reached_from(output: Any) -> set[torch.Tensor]:
    """Leaf tensors whose gradient the autograd graph of `output` will compute."""
    leaves, seen = set(), set()
    stack = [t.grad_fn for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: the node that writes a leaf's .grad
            leaves.add(fn.variable)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return leaves
