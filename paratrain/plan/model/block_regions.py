"""Where in the model one forward's work and saved bytes fall, for model/probe.py: in each block
of the stack, before the first block (a GPT's embeddings), or after the last (its final norm,
head and loss). A pipeline puts the blocks on stages and what comes before and after on the
first and the last (pipeline/plan.py, plan_cut), so its stages differ by these regions
(`stage_shares`): the bench GPT's vocabulary-sized head makes its last of two stages do about
40 % more forward FLOPs than its first.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves


class BlockRegions:
    """Hooks on `blocks` (module names) that follow one forward: which block is running, what
    each saves for backward and outputs, and the forward FLOPs of each and of the lead (before
    the first block), read from `counter` (the forward's fake_step.Flops, set once it exists).
    A checkpointed block runs its forward again in backward: that run adds no saved bytes (the
    probe's hooks are off by then) and no forward FLOPs (the forward's counter has stopped)."""

    def __init__(self, modules: dict[str, nn.Module], blocks: tuple[str, ...]):
        self.modules, self.blocks = modules, blocks
        self.running: list[tuple[str, int]] = []  # (block, forward FLOPs when it started)
        self.started = False  # a block has run: what is saved outside one now is the tail's
        self.saved = {name: 0 for name in blocks}
        self.flops = {name: 0 for name in blocks}
        self.outputs: dict[str, int] = {}
        self.lead_saved = self.lead_flops = 0
        self.counter: Any = None

    def _now(self) -> int:
        return self.counter.total if self.counter is not None else 0

    def save(self, nbytes: int) -> None:
        """A new storage saved for backward, while whatever is running runs."""
        if self.running:
            self.saved[self.running[-1][0]] += nbytes
        elif not self.started:
            self.lead_saved += nbytes

    def _enter(self, module: nn.Module, args: Any, name: str) -> None:
        now = self._now()
        if not self.started:
            self.started, self.lead_flops = True, now
        self.running.append((name, now))

    def _leave(self, module: nn.Module, args: Any, output: Any, name: str) -> None:
        _, entered = self.running.pop()  # a forward hook's return value would replace the output
        self.flops[name] += self._now() - entered
        self.outputs[name] = sum(t.numel() * t.element_size() for t in tree_leaves(output) if torch.is_tensor(t))

    def hooks(self) -> list:
        """The hooks (remove each after the run). They fire around the module's call, so a
        checkpointed block's saved inputs are its own."""
        handles = []
        for name in self.blocks:
            block = self.modules[name]
            handles.append(block.register_forward_pre_hook(functools.partial(self._enter, name=name)))
            handles.append(block.register_forward_hook(functools.partial(self._leave, name=name), always_call=True))
        return handles


def stage_shares(step: Any, model: nn.Module, holdings: list[list[nn.Parameter]]
                 ) -> tuple[list[float], list[float]] | None:
    """Each pipeline stage's share of one forward's FLOPs and of its saved activation bytes, from
    probe's StepCount `step` (its block_flops, block_activation_bytes and leads) and the
    stages' parameters (Pipeline.holdings): a block is on the stage holding its parameters, the
    lead on the first, the rest (after the last block) on the last. None where the count has no
    blocks or a block is on no stage (a model cut elsewhere than its stack): split evenly."""
    if not step.block_flops or not step.flops_forward or not step.activation_bytes:
        return None
    stage_of = {id(p): s for s, held in enumerate(holdings) for p in held}
    modules = dict(model.named_modules())
    flops, saved = [0] * len(holdings), [0] * len(holdings)
    flops[0], saved[0] = step.lead_flops, step.lead_activation_bytes
    for name, block_flops in step.block_flops.items():
        params = list(modules[name].parameters()) if name in modules else []
        if not params or id(params[0]) not in stage_of:
            return None
        flops[stage_of[id(params[0])]] += block_flops
        saved[stage_of[id(params[0])]] += step.block_activation_bytes.get(name, 0)
    flops[-1] += step.flops_forward - sum(flops)
    saved[-1] += step.activation_bytes - sum(saved)
    return [f / step.flops_forward for f in flops], [b / step.activation_bytes for b in saved]
