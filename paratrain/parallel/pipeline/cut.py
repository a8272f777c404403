"""Cut a model that is not an nn.Sequential into pipeline stages, at named blocks.

[Note: cutting a model by names]
The mechanism is a documented protocol, not a tracer. torch's tracer
(torch.distributed.pipelining.pipeline, through torch.export) must capture the whole forward as
one graph: data-dependent branches, hooks and many transformers models stop it, its stages are
generated graph modules, and what a stage runs can no longer be read in the model's source. Most
models worth pipelining have one shape instead: embed → a ModuleList of identical blocks → head
(or a ModuleDict of them, taken in its order: torchtitan keeps its blocks in `layers["0"]` …).
So, as torchtitan's manual split does, each rank keeps the model object itself with only its
stage's parts: the blocks of its span under their own indices (`blocks.4` stays `blocks.4`), the
parts before the blocks on the first stage, those after them on the last, nothing else. Every
name in a stage's state dict is the model's own, a stage holds (and could materialise) only its
parts, and a stage runs the model's own code:

    first stage:  x = cut.embed(model, inputs)        the parts before the blocks
    every stage:  args = cut.block_args(model, x)      once per forward (default: none)
                  x = cut.block(block, x, *args)       for each block of its span
    last stage:   outputs = cut.head(model, x)         the parts after the blocks

`block_args` gives every block the inputs it takes besides the activation, which each stage can
compute for itself (torchtitan's blocks are called `layer(h, self.freqs_cis)`, the rotary table
being a buffer of the root, which every stage keeps); what only the first stage can compute from
the batch travels with the activation instead, as a tuple.

A `Cut` names the blocks and those three steps. A model may define `pipeline_embed(inputs)` and
`pipeline_head(x)` methods instead (examples/gpt.py does); transformers' GPT-2 has one in
adapters.py. Which parts are "before" and "after": walking the path to the blocks, the children
registered before each step of the path belong to the first stage, those after it to the last
(GPT-2: transformer.{wte, wpe, drop} | transformer.h | transformer.ln_f, lm_head), parameters
registered directly on the path to the first; `first=` / `last=` name others, and `every=`
parts that all stages keep (transformers' Llama registers its rotary embedding after its
layers, and each stage's blocks need it). Buffers of the modules on the path stay on every
stage (a causal mask). A parameter kept by two stages (the
token embedding tied to the head) is a weight tied across stages: each keeps a copy, and
stage.py sums their gradients over the stages holding it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from paratrain.errors import ConfigError


def call_block(block: nn.Module, x: Any, *args: Any) -> Any:
    """The default block step: the block called on the activation and the block_args."""
    return block(x, *args)


@dataclass(frozen=True)
class Cut:
    """How to run a model's parts stage by stage (see [Note: cutting a model by names])."""

    layers: str  # dotted path of the blocks, an nn.ModuleList or an nn.ModuleDict: "blocks", "transformer.h"
    embed: Callable[[nn.Module, Any], Any]  # (model, inputs) → the first block's input
    head: Callable[[nn.Module, Any], Any]  # (model, the last block's output) → outputs
    block: Callable[..., Any] = call_block  # (block, activation, *block_args) → activation
    # (model, the stage's first block's input) → the more inputs every block of the stage takes
    # after the activation, computed once per forward on each stage: torchtitan's rotary table,
    # `block_args=lambda model, x: (model.freqs_cis,)`; default: none
    block_args: Callable[[nn.Module, Any], tuple] | None = None
    first: tuple[str, ...] = ()  # more parts (dotted names) only the first stage keeps
    last: tuple[str, ...] = ()  # more parts only the last stage keeps
    every: tuple[str, ...] = ()  # parts before or after the blocks that every stage keeps, for
    # its block_args (transformers' Llama: the rotary embedding, registered after its layers)
    loss: Callable[[Any, Any], Any] | None = None  # (head's outputs, targets) → the model's own loss


class StageRun:
    """What one stage of a cut model computes: embed (first stage), its blocks, head (last)."""

    def __init__(self, model: nn.Module, cut: Cut, blocks: list[nn.Module], first: bool, last: bool):
        self.model, self.cut, self.blocks, self.first, self.last = model, cut, blocks, first, last

    def __call__(self, x: Any) -> Any:
        if self.first:
            x = self.cut.embed(self.model, x)
        args = tuple(self.cut.block_args(self.model, x)) if self.cut.block_args is not None else ()
        for block in self.blocks:
            x = self.cut.block(block, x, *args)
        return self.cut.head(self.model, x) if self.last else x


def blocks_of(model: nn.Module, layers: str) -> list[nn.Module]:
    """The blocks at `layers`, in order: an nn.ModuleList's, or an nn.ModuleDict's values."""
    return [block for _, block in named_blocks(model, layers)]


def named_blocks(model: nn.Module, layers: str) -> list[tuple[str, nn.Module]]:
    """(key, block) at `layers` in order: "0", "1", … for an nn.ModuleList, an nn.ModuleDict's own
    keys (torchtitan's are "0", "1", … too)."""
    try:
        blocks = model.get_submodule(layers)
    except AttributeError:
        raise ConfigError(f"the model has no submodule {layers!r} to cut into stages; name its "
                          "nn.ModuleList (or nn.ModuleDict) of blocks, e.g. layers='blocks'") from None
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        raise ConfigError(f"{layers!r} is a {type(blocks).__name__}; a pipeline cuts an nn.ModuleList or "
                          "nn.ModuleDict of blocks: name the container that holds them")
    if any(block is None for block in blocks._modules.values()):
        raise ConfigError(f"{layers!r} holds None in place of a block; a pipeline cuts the whole model, "
                          "built with every block")
    return list(blocks._modules.items())


def spans_at(layers: str, blocks: int | Sequence[str], stages: int, split_at: Sequence[str]) -> list[tuple[int, int]]:
    """Each stage's blocks [start, end) from the names of the blocks that begin stages 1 … S-1.
    `blocks`: the blocks' keys in order (an int N: "0" … "N-1", an nn.ModuleList's)."""
    if len(split_at) != stages - 1:
        raise ConfigError(f"{stages} stages need {stages - 1} split points (the block each later stage "
                          f"begins with); got {len(split_at)}: {list(split_at)}")
    keys = [str(i) for i in range(blocks)] if isinstance(blocks, int) else list(blocks)
    starts = []
    for name in split_at:
        prefix, _, key = name.rpartition(".")
        if prefix != layers or key not in keys[1:]:
            raise ConfigError(f"split point {name!r} is not a block of {layers!r} after the first: "
                              f"name one of {layers}.{keys[1] if len(keys) > 1 else '?'} … {layers}.{keys[-1]}")
        starts.append(keys.index(key))
    if starts != sorted(set(starts)):
        raise ConfigError(f"split points must be in order, each once: got {list(split_at)}")
    bounds = [0, *starts, len(keys)]
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
    everywhere = [_entry(model, n) for n in cut.every]
    before = [e for e in before if e not in forced_last and e not in everywhere] + forced_first
    after = [e for e in after if e not in forced_first and e not in everywhere] + forced_last
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


def prune(model: nn.Module, cut: Cut, spans: Sequence[tuple[int, int]], first: bool, last: bool) -> list[StageRun]:
    """Keep in `model` only this rank's parts (in place): the blocks of its chunks' `spans`, the
    parts before the blocks if its first chunk is the first stage, those after them if its last
    chunk is the last; return how each chunk runs."""
    before, after = parts(model, cut)
    blocks = named_blocks(model, cut.layers)
    kept = nn.ModuleDict([b for a, z in spans for b in blocks[a:z]])  # under the model's own keys
    owner_name, _, attr = cut.layers.rpartition(".")
    (model.get_submodule(owner_name) if owner_name else model)._modules[attr] = kept
    for owner, name, kind in (before if not first else []) + (after if not last else []):
        (owner._modules if kind == "module" else owner._parameters)[name] = None
    return [StageRun(model, cut, [b for _, b in blocks[a:z]], first and c == 0, last and c == len(spans) - 1)
            for c, (a, z) in enumerate(spans)]
