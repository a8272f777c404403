"""What one training step of a model costs, found by running it once on fake tensors.

The model is built on the meta device (model/source.py); its parameters and buffers are swapped
for fake CPU tensors (`torch._subclasses.fake_tensor.FakeTensorMode`: shapes, dtypes, devices
and storages, no memory, no arithmetic), and one forward and one backward of one batch run:

- FLOPs: torch's FLOP formulas (`torch.utils.flop_counter`, as FlopCounterMode applies them;
  fake_step.Flops) around the forward, and around the backward (which includes the forward of
  checkpointed modules run again). They count matmuls, convolutions and attention, 2 FLOPs per
  multiply-add; elementwise work is not counted.
- Activation bytes: every tensor autograd saves for backward, seen through
  `torch.autograd.graph.saved_tensors_hooks` during the forward, counted once per storage (a view
  and its base are one storage; a tensor saved by two ops is one), parameters and buffers
  excluded (they are model state: the strategies' layouts count them). This is what the forward
  leaves alive for the backward, the activation part of the peak at the end of the forward.
  Under activation checkpointing (components/activation_checkpointing.py, reused here as training uses it)
  the checkpointed modules save their inputs only (torch.utils.checkpoint saves them through the
  same hooks), and the rest of the model saves what it always does.
- Weight copies: under autocast (precision "bf16"/"fp16") with fp32 parameters, each weight a
  matmul uses is cast to the low precision once (autocast caches the cast), about 2 bytes per
  parameter (llama-2-70b: 128 GiB). They are counted apart from the activations, which grow
  with the batch: how long a rank holds them, and of which weights, depends on its strategy
  (memory.py). With `param_dtype` the parameters are in that dtype: nothing is copied.
- Transient bytes: the most bytes the forward and backward hold at once beyond the model's
  parameters, buffers and the parameters' gradients: saved activations, their gradients and every
  temporary, from the lifetime of each storage an op makes (fake_step.Lifetimes, a TorchDispatchMode:
  born at the op that made it, dead at the first op after its last reference went; an op's
  inputs and outputs count as alive together). The activation part of a step's peak memory
  (memory.py), where activation_bytes alone leaves out the backward's gradients of activations
  (a GPT's logits: their gradient is as large as they are) and the loss's temporaries.
- Matmul shapes: each mm / addmm / bmm of the forward and the backward as (b, m, k, n), and the
  bytes every other op reads and writes, from runs at the batch and at twice it, which mark what
  follows the batch (matmuls.py): the planner times each matmul at its shape's rate on a rank's
  share of the batch, and the rest by its bytes.
- Parameters and their bytes: counted on the meta model, a tied weight once.

Fake CPU tensors choose CPU kernels: attention goes through SDPA's flash kernel for the CPU,
which saves the log-sum-exp and not the T×T scores, as flash attention does on a GPU. (Fake CUDA
tensors cannot run autograd on a build without CUDA.) The loss: a transformers causal LM's own
cross-entropy from its labels; else `loss_fn(output)` when given; else the sum of the outputs,
which saves nothing, so a real loss adds what it saves (cross-entropy: about its logits' size).
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from paratrain.components.activation_checkpointing import Which, checkpoint_activations, select
from paratrain.components.precision import PRECISIONS
from paratrain.errors import ConfigError
from paratrain.plan.model.block_regions import BlockRegions
from paratrain.plan.model.fake_step import Flops, Lifetimes, faked, fused_attention
from paratrain.plan.model.matmuls import Matmuls, Recorder, Traffic, extend_matmuls, scaling
from paratrain.plan.model.repeated_blocks import Stack, cut, extend, extend_blocks, find_stack
from paratrain.plan.model.source import ModelSource


@dataclass(frozen=True)
class StepCount:
    """One forward and backward of one batch, counted on fake tensors (module docstring)."""

    flops_forward: int
    flops_backward: int  # with the checkpointed modules' forward run again, if any
    activation_bytes: int  # saved for backward, distinct storages, parameters and buffers excluded
    block_activation_bytes: dict[str, int]  # of those, the bytes saved while each block ran
    block_output_bytes: dict[str, int] = field(default_factory=dict)  # each block's output: what a
    # pipeline cut after it sends forward (and its gradient back), for the whole batch
    block_flops: dict[str, int] = field(default_factory=dict)  # forward FLOPs while each block ran
    lead_flops: int = 0  # forward FLOPs before the first block (block_regions.py)
    lead_activation_bytes: int = 0  # saved before the first block
    transient_bytes: int = 0  # the most held at once beyond parameters, buffers and their gradients
    checkpointed: tuple[str, ...] = ()  # the modules whose activations were checkpointed
    extended: bool = False  # counted from copies of the model cut to 1 and 2 blocks (repeated_blocks.py)
    matmuls: Matmuls = ()  # the step's matmuls by shape, at this batch (plan/model/matmuls.py)
    traffic: Traffic = Traffic()  # bytes the other ops read and write (plan/model/matmuls.py)
    attention_kv_bytes: int = 0  # the keys and values of every attention call in forward, whole batch
    attention_calls: int = 0  # F.scaled_dot_product_attention calls in forward
    weight_copy_bytes: int = 0  # autocast's low-precision copies of the weights, one each (not in
    # activation_bytes nor transient_bytes: memory.py counts them per rank, by the weights it holds)

    @property
    def activation_peak_bytes(self) -> int:
        """What the step's peak memory holds beyond the model's state (memory.py's activations):
        the transient peak, which includes the saved activations."""
        return max(self.transient_bytes, self.activation_bytes)


@dataclass(frozen=True)
class ModelFacts:
    """A model's size, and the cost of one step of one batch with and without checkpointing."""

    name: str
    batch: int
    seq: int | None  # None: the model takes no sequence (one input row per sample)
    precision: str  # autocast as Session(precision=...): "32", "bf16" or "fp16"
    params: int  # distinct parameters, a tied weight once
    trainable_params: int
    param_bytes: int  # in the dtype the parameters are held
    buffer_bytes: int
    step: StepCount  # no activation checkpointing
    checkpointed: StepCount | None = None  # the chosen modules checkpointed; None: none chosen
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def samples(self) -> int:
        return self.batch

    @property
    def tokens(self) -> int:
        """Tokens of the batch (samples when the model takes no sequence)."""
        return self.batch * (self.seq or 1)


def model_facts(source: ModelSource, batch: int, seq: int | None = None, *, precision: str = "32",
                param_dtype: torch.dtype | None = None, activation_checkpointing: Which | None = "auto",
                loss_fn=None, exact: bool = False) -> ModelFacts:
    """Count `source`'s model (module docstring). `param_dtype` casts the parameters first (as ZeRO's
    param_dtype does); `activation_checkpointing` chooses the modules to checkpoint in the second
    count (components/activation_checkpointing.py's `which`; None: no second count). A stack of identical
    blocks is counted from copies cut to one and two blocks (repeated_blocks.py) unless `exact`."""
    if batch < 1 or (seq is not None and seq < 1):
        raise ConfigError(f"batch and seq must be at least 1; got batch {batch}, seq {seq}")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision is one of {', '.join(PRECISIONS)}; got {precision!r}")
    seq = seq or source.default_seq
    model = _cast(source.build(), param_dtype)
    params = list(model.parameters())
    stack = None if exact else find_stack(model)
    count = functools.partial(_count, source, stack=stack, batch=batch, seq=seq, precision=precision,
                              loss_fn=loss_fn)
    facts = dict(name=source.name, batch=batch, seq=seq, precision=precision,
                 params=sum(p.numel() for p in params),
                 trainable_params=sum(p.numel() for p in params if p.requires_grad),
                 param_bytes=sum(p.numel() * p.element_size() for p in params),
                 buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
                 step=count(model, blocks=_blocks(model)))
    notes = [f"{stack.name}: {stack.length} identical blocks, counted from copies with 1 and 2"] \
        if facts["step"].extended else []
    if activation_checkpointing == "auto" and not facts["step"].block_activation_bytes:
        notes.append("no repeated blocks for activation checkpointing to choose")
    elif activation_checkpointing is not None:
        again = _cast(source.build(), param_dtype)
        chosen = tuple(checkpoint_activations(again, activation_checkpointing))
        facts["checkpointed"] = count(again, blocks=chosen, checkpointed=chosen)
    return ModelFacts(**facts, notes=tuple(notes))


def _cast(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    return model.to(dtype) if dtype is not None else model


def _count(source: ModelSource, model: nn.Module, *, stack: Stack | None, blocks: tuple[str, ...],
           checkpointed: tuple[str, ...] = (), **options) -> StepCount:
    """count_step, of the whole stack from its first one and two blocks when there is a stack."""
    def whole() -> StepCount:
        counted, at_batch = count_step(source, model, blocks=blocks, checkpointed=checkpointed, **options)
        matmuls, traffic = work_by_shape(source, model, at_batch, **options)
        return dataclasses.replace(counted, matmuls=matmuls, traffic=traffic)

    if stack is None:
        return whole()
    runs = []
    try:
        for keep in (1, 2):
            with cut(model, stack, keep):
                counted, at_batch = count_step(source, model, blocks=blocks, checkpointed=checkpointed, **options)
                runs.append((counted, work_by_shape(source, model, at_batch, **options)))
    except Exception:  # a forward that reaches blocks by index: count it whole (raising what it raises)
        runs = []
    if len(runs) < 2 or runs[1][0].flops_forward <= runs[0][0].flops_forward:  # the cut did not take
        return whole()
    (one, (matmuls_one, traffic_one)), (two, (matmuls_two, traffic_two)) = runs
    return StepCount(matmuls=extend_matmuls(matmuls_one, matmuls_two, stack.length),
                     traffic=Traffic(*(extend(a, b, stack) for a, b in zip(traffic_one, traffic_two))),
                     flops_forward=extend(one.flops_forward, two.flops_forward, stack),
                     flops_backward=extend(one.flops_backward, two.flops_backward, stack),
                     activation_bytes=extend(one.activation_bytes, two.activation_bytes, stack),
                     transient_bytes=extend(one.transient_bytes, two.transient_bytes, stack),
                     block_activation_bytes=extend_blocks(two.block_activation_bytes, stack),
                     block_output_bytes=extend_blocks(two.block_output_bytes, stack),
                     block_flops=extend_blocks(two.block_flops, stack), lead_flops=two.lead_flops,
                     lead_activation_bytes=two.lead_activation_bytes, checkpointed=checkpointed, extended=True,
                     attention_kv_bytes=extend(one.attention_kv_bytes, two.attention_kv_bytes, stack),
                     attention_calls=extend(one.attention_calls, two.attention_calls, stack),
                     weight_copy_bytes=extend(one.weight_copy_bytes, two.weight_copy_bytes, stack))


def count_step(source: ModelSource, model: nn.Module, *, batch: int, seq: int | None, precision: str = "32",
               loss_fn=None, blocks: tuple[str, ...] = (),
               checkpointed: tuple[str, ...] = ()) -> tuple[StepCount, tuple[dict, dict]]:
    """Run one forward and backward of `model` (built by `source` on the meta device; its tensors
    are fake while this runs, and put back after) and count them; what is saved while one of
    `blocks` runs is also counted for that block. Also returns what matmuls.Recorder saw, by
    phase: (matmul shapes in order, traffic bytes), for work_by_shape."""
    model.train()
    present = dict(model.named_modules())
    blocks = tuple(name for name in blocks if name in present)  # a cut stack holds fewer
    saved: dict[StorageWeakRef, int] = {}
    regions = BlockRegions(present, blocks)
    mode = FakeTensorMode()

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in state and ref not in saved and ref not in lifetimes.copy_storages:
            saved[ref] = t.untyped_storage().nbytes()
            regions.save(saved[ref])
        return t

    handles = regions.hooks()
    autocast = PRECISIONS[precision]
    kv: list[int] = []
    try:
        with faked(model, mode) as state, mode, fused_attention(kv):
            args, kwargs = source.inputs(model, batch, seq)
            with Lifetimes(state) as lifetimes:
                with Flops() as forward, \
                        Recorder() as forward_work, torch.autograd.graph.saved_tensors_hooks(pack, _same), \
                        (torch.autocast("cpu", dtype=autocast) if autocast else nullcontext()):
                    regions.counter = forward
                    loss = _loss(model(*args, **kwargs), loss_fn)
                regions.counter = None
                calls, kv_bytes = len(kv), sum(kv)  # forward's only
                with Flops() as backward, Recorder() as backward_work:
                    loss.backward()
            grads = {StorageWeakRef(p.grad.untyped_storage()) for p in model.parameters() if p.grad is not None}
            transient = lifetimes.peak(leaving_out=grads)
            model.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    counted = StepCount(flops_forward=forward.total, flops_backward=backward.total,
                        activation_bytes=sum(saved.values()), block_activation_bytes=regions.saved,
                        block_output_bytes=regions.outputs, block_flops=regions.flops, lead_flops=regions.lead_flops,
                        lead_activation_bytes=regions.lead_saved, checkpointed=checkpointed, transient_bytes=transient,
                        attention_kv_bytes=kv_bytes, attention_calls=calls,
                        weight_copy_bytes=sum(lifetimes.copies.values()))
    return counted, _recorded(forward_work, backward_work)


def _recorded(forward: Recorder, backward: Recorder) -> tuple[dict, dict]:
    return ({"forward": forward.shapes, "backward": backward.shapes},
            {"forward": forward.traffic, "backward": backward.traffic})


def work_by_shape(source: ModelSource, model: nn.Module, at_batch: tuple[dict, dict], *, batch: int,
                  seq: int | None, precision: str = "32", loss_fn=None) -> tuple[Matmuls, Traffic]:
    """The matmuls of one forward and backward by shape, each dimension marked as scaling with
    the batch or not, and the bytes the other ops move: `at_batch` (count_step's run) against a
    fake run at twice the batch (plan/model/matmuls.py). Where that run fails (a loss_fn made for one
    batch size), no dimension is marked and all the bytes count as per batch."""
    autocast = PRECISIONS[precision]
    mode = FakeTensorMode()
    try:
        with faked(model, mode), mode, fused_attention():
            args, kwargs = source.inputs(model, 2 * batch, seq)
            with Recorder() as forward, (torch.autocast("cpu", dtype=autocast) if autocast else nullcontext()):
                loss = _loss(model(*args, **kwargs), loss_fn)
            with Recorder() as backward:
                loss.backward()
        double = _recorded(forward, backward)
    except Exception:
        double = ({}, {})
    finally:
        model.zero_grad(set_to_none=True)
    return scaling(at_batch[0], double[0]), Traffic.of(at_batch[1], double[1])


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _blocks(model: nn.Module) -> tuple[str, ...]:
    """The repeated blocks ("auto" checkpointing's choice), or none when the model has none."""
    try:
        return tuple(name for name, _ in select(model, "auto"))
    except ConfigError:
        return ()


def _loss(output, loss_fn) -> torch.Tensor:
    if loss_fn is not None:
        return loss_fn(output)
    if getattr(output, "loss", None) is not None:  # a transformers model given labels
        return output.loss
    floats = [t for t in tree_leaves(output) if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad]
    if not floats:
        raise ConfigError("the model's output holds no floating-point tensor that needs a gradient: "
                          "give a loss_fn(output) -> loss")
    return sum(t.float().sum() for t in floats)
