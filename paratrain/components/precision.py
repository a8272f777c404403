"""Mixed precision: autocast for the forward, and a gradient scaler that works on sharded gradients.

    session = pt.Session(strategy="zero3", precision="fp16")   # or "bf16", or "32" (the default)

bf16 has fp32's exponent range, so it needs autocast only. fp16 does not: gradients smaller than
2^-24 flush to zero, so the loss is multiplied by a large scale S before backward and the
gradients divided by S before clipping and stepping (Micikevicius et al., "Mixed Precision
Training", ICLR 2018, §3.2). S is dynamic, as in `torch.amp.GradScaler`: a step whose gradients
hold an inf or a nan is skipped and S is multiplied by `backoff_factor`; after `growth_interval`
steps in a row without one, S is multiplied by `growth_factor`.

Why not `torch.amp.GradScaler`: it looks for infs only in the gradients this process holds, and
decides to skip there. Under ZeRO a rank holds 1/N of the gradients and under a pipeline one
stage's, so an overflow may be visible on one rank only: that rank would skip while the others
step, and the replicas would silently drift apart. Here the found-inf flag is all-reduced (MAX)
over the group that holds the other parts — `Strategy.local_grads` names both — so every rank
skips or steps together. Replicated strategies (DDP) need no reduction: the gradient all-reduce
has already spread any inf to every rank.

Per optimizer step (Session.step):

    scale(loss).backward()        every micro-batch: the loss times S
    unscale_(grads, group)        divide by S in place; found_inf = any non-finite, MAX over group
    clip (if found_inf is False)  on the unscaled gradients, so max_grad_norm means what it says
    optimizer.step()              only if found_inf is False
    update()                      back off or grow S

S stays a power of two (factors 2 and 0.5 by default), so scaling and unscaling are exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from paratrain.distributed.comm import group_device, max_over
from paratrain.errors import ConfigError

# the autocast dtype of each Session precision; "32" trains in the parameters' own dtype
PRECISIONS: dict[str, torch.dtype | None] = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """`tree` (a model's args and kwargs) with every floating-point tensor cast to `dtype`: the
    inputs of a model whose parameters are held in it (ZeRO's param_dtype)."""
    return tree_map(lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x, tree)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision name, or None for full precision."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {sorted(PRECISIONS)}; got {precision!r}")
    return PRECISIONS[precision]


def scaler_for(precision: str, given: "GradScaler | None") -> "GradScaler | None":
    """The loss scaler a precision needs: fp16's (`given`, or a default one), else none."""
    if given is not None and precision != "fp16":
        raise ConfigError(f"grad_scaler is for precision='fp16'; got precision={precision!r}")
    return (given or GradScaler()) if precision == "fp16" else None


class GradScaler:
    """Dynamic loss scaling over gradients that may be split between ranks (see the module doc).

    init_scale: S before the first step (torch's default, 2^16).
    growth_factor / backoff_factor: multiply S by these after `growth_interval` good steps in a
        row / after a step with a non-finite gradient.
    growth_interval: good steps in a row before S grows.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, *, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ConfigError("GradScaler needs init_scale > 0, growth_factor > 1, "
                              "0 < backoff_factor < 1 and growth_interval >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.good_steps = 0  # steps in a row without a non-finite gradient
        self.found_inf: bool | None = None  # decided by unscale_, consumed by update
        self.skipped_steps = 0  # optimizer steps skipped so far

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * S`: backpropagate this instead of the loss."""
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor], group=None, *, factor: float = 1.0) -> bool:
        """Divide `grads` (this rank's part) by S in place, also multiplying them by `factor` (the
        session's token normalisation), and return whether any gradient on any rank of `group` is
        inf or nan. `group=None`: every rank holds all the gradients, nothing to reduce.
        Once per step: a second call before `update()` returns the same answer and touches
        nothing."""
        if self.found_inf is not None:
            return self.found_inf
        device = grads[0].device if grads else group_device(group)
        found = torch.zeros((), dtype=torch.float32, device=device)
        multiplier = factor / self.scale_value
        for g in grads:
            g.mul_(multiplier)
            found = torch.maximum(found, (~torch.isfinite(g)).any().to(found.device, found.dtype))
        self.found_inf = bool(max_over(found, group).item())
        return self.found_inf

    def update(self) -> None:
        """After the step: back off if it was skipped, grow after `growth_interval` good ones."""
        if self.found_inf is None:
            raise RuntimeError("GradScaler.update() before unscale_(): nothing was checked this step")
        if self.found_inf:
            self.scale_value *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale_value *= self.growth_factor
                self.good_steps = 0
        self.found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self.scale_value, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_value, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
