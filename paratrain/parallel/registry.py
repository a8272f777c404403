"""Strategy names: what `Session(strategy="...")` accepts, and the default object each stands for.

Each strategy object sits in the file of the wrapper it builds (parallel/<name>.py); adding a
strategy is one new file there and one line here (README, "How it is built").
"""

from __future__ import annotations

import functools
from typing import Callable

from paratrain.errors import ConfigError
from paratrain.parallel.base import Strategy
from paratrain.parallel.ddp import DDP
from paratrain.parallel.dp import DP
from paratrain.parallel.hierarchical import Hierarchical
from paratrain.parallel.model_parallel import ModelParallel
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.single import Single
from paratrain.parallel.zero import ZeRO

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "single": Single,
    "dp": DP,
    "ddp": DDP,
    "hierarchical": Hierarchical,
    "zero1": functools.partial(ZeRO, stage=1),
    "zero2": functools.partial(ZeRO, stage=2),
    "zero3": functools.partial(ZeRO, stage=3),
    "model-parallel": ModelParallel,
    "pipeline": Pipeline,
}


def resolve(strategy: str | Strategy) -> Strategy:
    """A strategy object from a name or an object."""
    if isinstance(strategy, Strategy):
        return strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)} "
                          "or pass a strategy object such as paratrain.DDP(...)")
    return STRATEGIES[strategy]()
