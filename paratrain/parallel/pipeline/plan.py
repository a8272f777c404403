"""Which parameters each pipeline stage holds, and how this rank builds its own: from an
nn.Sequential cut between its layers (partition.py), or from a model cut at named blocks
(cut.py). Every rank plans every stage, so all agree on the weights tied across stages. With
interleaving the model is cut into stages × virtual stages, and a rank builds several
(actions.py): one module holding all its chunks' parts under the model's own names, and what each
chunk runs."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.pipeline.cut import Cut, blocks_of, held, named_blocks, parts, prune, spans_at
from paratrain.parallel.pipeline.partition import boundaries, split_model


@dataclass
class StagePlan:
    holdings: list[list[nn.Parameter]]  # each (virtual) stage's parameters, before anything is cut
    build: Callable[[list[int]], tuple[nn.Module, list[Callable[[Any], Any]]]]  # stages → (module, runs)
    loss: Callable[[Any, Any], Any] | None = None  # the model's own loss on the head's outputs


def plan_sequential(model: nn.Module | Sequence[nn.Module], stages: int,
                    costs: Sequence[float] | None) -> StagePlan:
    """Slices of an nn.Sequential (or the user's own list of stage modules)."""
    pieces = split_model(model, stages, costs=costs)

    def build(mine: list[int]) -> tuple[nn.Module, list[Callable[[Any], Any]]]:
        if len(mine) == 1:
            return pieces[mine[0]], [pieces[mine[0]]]
        # the children of every chunk under their own names (`3.weight` stays `3.weight`); the
        # user's own stage modules, whose names may repeat, under their stage numbers
        children = [(n, c) for k in mine for n, c in pieces[k]._modules.items()]
        if len({n for n, _ in children}) == len(children) and all(isinstance(pieces[k], nn.Sequential) for k in mine):
            return nn.Sequential(OrderedDict(children)), [pieces[k] for k in mine]
        return nn.ModuleDict({str(k): pieces[k] for k in mine}), [pieces[k] for k in mine]

    return StagePlan([list(piece.parameters()) for piece in pieces], build)


def plan_cut(model: nn.Module, stages: int, cut: Cut, split_at: Sequence[str] | None,
             balance: str) -> StagePlan:
    """Spans of the blocks (at `split_at`, or balanced by count or parameters); the parts before
    the blocks on the first stage, after them on the last."""
    blocks = blocks_of(model, cut.layers)
    if split_at is not None:
        spans = spans_at(cut.layers, [k for k, _ in named_blocks(model, cut.layers)], stages, split_at)
    else:
        spans = _balanced(blocks, stages, balance, cut.layers)
    before, after = parts(model, cut)
    holdings = [[p for i in range(*span) for p in blocks[i].parameters()] for span in spans]
    holdings[0] += held(before)
    holdings[-1] += held(after)
    last = stages - 1
    return StagePlan(holdings, lambda mine: (model, prune(model, cut, [spans[k] for k in mine],
                                                          first=mine[0] == 0, last=mine[-1] == last)),
                     cut.loss)


def _balanced(blocks: nn.ModuleList, stages: int, balance: str, layers: str) -> list[tuple[int, int]]:
    if len(blocks) < stages:
        raise ConfigError(f"cannot cut the {len(blocks)} blocks of {layers!r} into {stages} stages: every "
                          f"stage needs at least one block; use stages <= {len(blocks)}")
    if balance not in ("layers", "params"):
        raise ConfigError(f"a model cut at named blocks is balanced by 'layers' or 'params', or cut at "
                          f"split_at=[...]; got balance={balance!r}")
    costs = [1.0 if balance == "layers" else float(sum(p.numel() for p in b.parameters())) for b in blocks]
    bounds = boundaries(costs, stages)
    return list(zip(bounds, bounds[1:]))
