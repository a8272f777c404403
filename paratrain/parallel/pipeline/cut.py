"""Cut a model that is not an nn.Sequential into pipeline stages, at named blocks.

[Note: cutting a model by names]
The mechanism is a documented protocol, not a tracer. torch's tracer
(torch.distributed.pipelining.pipeline, through torch.export) must capture the whole forward as
one graph: data-dependent branches, hooks and many transformers models stop it, its stages are
generated graph modules, and what a stage runs can no longer be read in the model's source. Most
models worth pipelining have one shape instead: embed → a ModuleList of identical blocks → head.
So, as torchtitan's manual split does, each rank keeps the model object itself with only its
stage's parts: the blocks of its span under their own indices (`blocks.4` stays `blocks.4`), the
parts before the blocks on the first stage, those after them on the last, nothing else. Every
name in a stage's state dict is the model's own, a stage holds (and could materialise) only its
parts, and a stage runs the model's own code:

    first stage:  x = cut.embed(model, inputs)        the parts before the blocks
    every stage:  x = cut.block(block, x)              for each block of its span
    last stage:   outputs = cut.head(model, x)         the parts after the blocks

A `Cut` names the blocks and those three steps. A model may define `pipeline_embed(inputs)` and
`pipeline_head(x)` methods instead (examples/gpt.py does); transformers' GPT-2 has one in
adapters.py. Which parts are "before" and "after": walking the path to the blocks, the children
registered before each step of the path belong to the first stage, those after it to the last
(GPT-2: transformer.{wte, wpe, drop} | transformer.h | transformer.ln_f, lm_head), parameters
registered directly on the path to the first; `first=` / `last=` name others. Buffers of the
modules on the path stay on every stage (a causal mask). A parameter kept by two stages (the
token embedding tied to the head) is a weight tied across stages: each keeps a copy, and
stage.py sums their gradients over the stages holding it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from paratrain.errors import ConfigError


def call_block(block: nn.Module, x: Any) -> Any:
    """The default block step: the block called on the activation."""
    return block(x)


@dataclass(frozen=True)
class Cut:
    """How to run a model's parts stage by stage (see [Note: cutting a model by names])."""

    layers: str  # dotted path of the nn.ModuleList of blocks, e.g. "blocks" or "transformer.h"
    embed: Callable[[nn.Module, Any], Any]  # (model, inputs) → the first block's input
    head: Callable[[nn.Module, Any], Any]  # (model, the last block's output) → outputs
    block: Callable[[nn.Module, Any], Any] = call_block  # (block, activation) → activation
    first: tuple[str, ...] = ()  # more parts (dotted names) only the first stage keeps
    last: tuple[str, ...] = ()  # more parts only the last stage keeps
    loss: Callable[[Any, Any], Any] | None = None  # (head's outputs, targets) → the model's own loss


class StageRun:
    """What one stage of a cut model computes: embed (first stage), its blocks, head (last)."""

    def __init__(self, model: nn.Module, cut: Cut, blocks: list[nn.Module], first: bool, last: bool):
        self.model, self.cut, self.blocks, self.first, self.last = model, cut, blocks, first, last

    def __call__(self, x: Any) -> Any:
        if self.first:
            x = self.cut.embed(self.model, x)
        for block in self.blocks:
            x = self.cut.block(block, x)
        return self.cut.head(self.model, x) if self.last else x


def blocks_of(model: nn.Module, layers: str) -> nn.ModuleList:
    try:
        blocks = model.get_submodule(layers)
    except AttributeError:
        raise ConfigError(f"the model has no submodule {layers!r} to cut into stages; name its "
                          "nn.ModuleList of blocks, e.g. layers='blocks'") from None
    if not isinstance(blocks, nn.ModuleList):
        raise ConfigError(f"{layers!r} is a {type(blocks).__name__}; a pipeline cuts an nn.ModuleList of blocks")
    return blocks


def spans_at(layers: str, count: int, stages: int, split_at: Sequence[str]) -> list[tuple[int, int]]:
    """Each stage's blocks [start, end) from the names of the blocks that begin stages 1 … S-1."""
    if len(split_at) != stages - 1:
        raise ConfigError(f"{stages} stages need {stages - 1} split points (the block each later stage "
                          f"begins with); got {len(split_at)}: {list(split_at)}")
    starts = []
    for name in split_at:
        prefix, _, index = name.rpartition(".")
        if prefix != layers or not index.isdigit() or not 0 < int(index) < count:
            raise ConfigError(f"split point {name!r} is not a block of {layers!r} after the first: "
                              f"name one of {layers}.1 … {layers}.{count - 1}")
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ConfigError(f"split points must be in order, each once: got {list(split_at)}")
    bounds = [0, *starts, count]
    return list(zip(bounds, bounds[1:]))


def parts(model: nn.Module, cut: Cut) -> tuple[list[tuple[nn.Module, str, str]], list[tuple[nn.Module, str, str]]]:
    """(the parts before the blocks, the parts after): (owning module, attribute, "module" or
    "param") by registration order along the path to the blocks, then `first` / `last`."""
    before, after, node = [], [], model
    for step in cut.layers.split("."):
        names = list(node._modules)
        at = names.index(step)
        before += [(node, n, "module") for n in names[:at] if node._modules[n] is not None]
        after += [(node, n, "module") for n in names[at + 1:] if node._modules[n] is not None]
        before += [(node, n, "param") for n, p in node._parameters.items() if p is not None]
        node = node._modules[step]
    forced_first, forced_last = [_entry(model, n) for n in cut.first], [_entry(model, n) for n in cut.last]
    before = [e for e in before if e not in forced_last] + forced_first
    after = [e for e in after if e not in forced_first] + forced_last
    return before, after


def _entry(model: nn.Module, name: str) -> tuple[nn.Module, str, str]:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if attr in owner._modules:
        return owner, attr, "module"
    if attr in owner._parameters:
        return owner, attr, "param"
    raise ConfigError(f"Cut(first=/last=) names {name!r}, which is no module or parameter of the model")


def held(entries: list[tuple[nn.Module, str, str]]) -> list[nn.Parameter]:
    """The parameters these parts hold."""
    out = []
    for owner, attr, kind in entries:
        out += [owner._parameters[attr]] if kind == "param" else list(owner._modules[attr].parameters())
    return out


def prune(model: nn.Module, cut: Cut, span: tuple[int, int], first: bool, last: bool) -> StageRun:
    """Keep in `model` only this stage's parts (in place) and return how the stage runs."""
    before, after = parts(model, cut)
    blocks = blocks_of(model, cut.layers)
    kept = nn.ModuleDict({str(i): blocks[i] for i in range(*span)})  # the model's own indices
    owner_name, _, attr = cut.layers.rpartition(".")
    (model.get_submodule(owner_name) if owner_name else model)._modules[attr] = kept
    for owner, name, kind in (before if not first else []) + (after if not last else []):
        (owner._modules if kind == "module" else owner._parameters)[name] = None
    return StageRun(model, cut, list(kept.values()), first, last)
