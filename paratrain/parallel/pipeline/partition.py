"""Cut a model into pipeline stages: consecutive layers, balanced by count, parameters or time.

A pipeline needs a model that is a chain: an `nn.Sequential` (cut between its children), or the
stages themselves as a list of modules, the user's own cut. Balancing (as GPipe's and torchgpipe's
`balance_by_size` / `balance_by_time`, Kim et al. 2020, "torchgpipe", section 3.2) gives each
layer a cost and picks the contiguous cut whose most expensive stage is cheapest: the pipeline
runs at the pace of its slowest stage.

    layers: every layer costs 1 (stages differ by at most one layer);
    params: a layer costs its number of parameters (memory balance);
    time:   a layer costs its measured forward + backward time on a sample batch.

Slices of an `nn.Sequential` keep the children's names, so a stage's state-dict keys are the
full model's keys (`3.weight` stays `3.weight` on whichever stage holds it).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from paratrain.errors import ConfigError

BALANCES = ("layers", "params", "time")


def split_model(model: nn.Module | Sequence[nn.Module], stages: int, *,
                costs: Sequence[float] | None = None) -> list[nn.Module]:
    """The model as `stages` stage modules: the user's own list, or slices of an nn.Sequential
    balanced by `costs`, one per layer (`layer_costs`; None: by layer count)."""
    if isinstance(model, (list, tuple, nn.ModuleList)):
        if len(model) != stages:
            raise ConfigError(f"the model was given as {len(model)} stage modules but the pipeline "
                              f"has stages={stages}; pass one module per stage")
        return list(model)
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"a pipeline cuts an nn.Sequential between its layers, or takes a list of "
                          f"stage modules; got {type(model).__name__}: wrap its layers in "
                          "nn.Sequential(...) or pass [stage0, stage1, ...]")
    if len(model) < stages:
        raise ConfigError(f"cannot cut {len(model)} layers into {stages} stages: every stage needs at "
                          f"least one layer; use stages <= {len(model)}")
    bounds = boundaries([1.0] * len(model) if costs is None else costs, stages)
    return [model[a:b] for a, b in zip(bounds, bounds[1:])]


def layer_costs(model: nn.Sequential, balance: str, sample: Any = None) -> list[float]:
    """One cost per layer of `model`, by `balance` (see the module docstring)."""
    if balance == "layers":
        return [1.0] * len(model)
    if balance == "params":
        return [float(sum(p.numel() for p in layer.parameters())) for layer in model]
    if balance == "time":
        if sample is None:
            raise ConfigError("balance='time' measures each layer on a sample batch: pass "
                              "Pipeline(sample=lambda: example_inputs)")
        return _timed(model, sample() if callable(sample) else sample)
    raise ConfigError(f"balance must be one of {BALANCES}; got {balance!r}")


def boundaries(costs: Sequence[float], stages: int) -> list[int]:
    """Cut points 0 = b0 < b1 < … < b_stages = len(costs) that minimise the largest stage cost
    (the linear partition problem, solved by dynamic programming), then, among those, the sum of
    squared stage costs (the most even cut); remaining ties go to later cuts, so the last stage,
    which also computes the loss, is the lighter one."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][j]: (largest stage cost, sum of squares) of the best cut of layers[:j] into k stages
    worst = (float("inf"), float("inf"))
    best = [[worst] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                c = prefix[j] - prefix[i]
                cost = (max(best[k - 1][i][0], c), best[k - 1][i][1] + c * c)
                if cost <= best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _timed(model: nn.Sequential, x: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median forward + backward seconds of each layer, each fed the previous layer's output."""
    costs = []
    for layer in model:
        runs = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.backward(torch.ones_like(out))
            if out.is_cuda:
                torch.cuda.synchronize(out.device)  # kernels run asynchronously: wait to time them
            runs.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(runs)[len(runs) // 2])
        x = out.detach()
    return costs
