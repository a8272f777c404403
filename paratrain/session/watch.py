"""Steps that go strangely without stopping the run are never silent.

After each optimizer step (Session.step) three things are checked, each a rank-0 warning
(`paratrain.StepWarning`, a UserWarning: `warnings.filterwarnings("ignore", category=
pt.StepWarning)` silences them) and, with a log_dir, a row of metrics.csv (and the other
backends) at that step:

    skipped step        fp16 skipped it: a gradient held inf or NaN on some rank
                        (row: skipped_step=1, loss_scale)
    loss scale falling  the scale was halved on `halvings` optimizer steps in a row: the
                        gradients overflow at every scale, so those steps train nothing
                        (row: loss_scale_halvings, loss_scale)
    gradient norm jump  the global norm is over `grad_norm_factor` times the median of the last
                        `window` steps (row: grad_norm_spike, grad_norm_median)

Every rank agrees on all three (the skip is decided on a reduced flag, the norm is global), so
every rank reaches the same verdict; only rank 0 speaks, and the row is written without a
collective (MetricsLogger.record). Cost: the skip and the scale are already on the host (the
scaler read its flag to decide). The norm exists only when the step computed it (max_grad_norm,
which may be float("inf") to watch without clipping); on the CPU it is read at once, on a GPU it
is copied to the host without waiting and checked one optimizer step later, so the check adds no
device synchronisation (reading it at once would stall the host until the step's kernels end).
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paratrain.errors import ConfigError
from paratrain.session.step import host_copy

if TYPE_CHECKING:
    from paratrain.session.session import Session
    from paratrain.session.step import StepResult

_PARATRAIN = os.path.dirname(os.path.abspath(__file__)) + os.sep
MIN_HISTORY = 5  # steps of gradient norms before a jump can be judged


class StepWarning(UserWarning):
    """An optimizer step went strangely: skipped, a loss scale that keeps falling, a norm jump."""


@dataclass(frozen=True)
class StepWarnings:
    """When a Session warns about a step (session/watch.py)."""

    halvings: int = 3  # warn when fp16's loss scale was halved on this many optimizer steps in a row
    grad_norm_factor: float = 10.0  # warn when the gradient norm exceeds this x its recent median
    window: int = 20  # optimizer steps of gradient norms the median is taken over

    def __post_init__(self):
        if self.halvings < 1 or not self.grad_norm_factor > 1 or self.window < MIN_HISTORY:
            raise ConfigError(f"StepWarnings needs halvings >= 1, grad_norm_factor > 1 and window >= {MIN_HISTORY}; "
                              f"got {self.halvings}, {self.grad_norm_factor}, {self.window}")


class StepWatch:
    """The checks' memory: skips in a row, recent norms, a norm on its way to the host."""

    def __init__(self, config: StepWarnings):
        self.config = config
        self.skipped_in_a_row = 0
        self.norms: collections.deque[float] = collections.deque(maxlen=config.window)
        self._in_flight: tuple[int, torch.Tensor, object] | None = None  # (step, host copy, CUDA event)

    def after_step(self, session: "Session", result: "StepResult") -> None:
        step = session.micro_step // session.accumulate
        row, said = {}, []
        if session.scaler is not None:
            self._scale(step, result.stepped, session.scaler.scale_value, row, said)
        checked = self._host_norm(step, result.grad_norm)
        if checked is not None:
            self._norm(*checked, session.max_grad_norm, row, said)
        if said and session.is_main:
            for message in said:
                warnings.warn(message, StepWarning, stacklevel=_user_stacklevel())
        if row and session.metrics is not None:
            session.metrics.record(step, **row)

    def _scale(self, step: int, stepped: bool, scale: float, row: dict, said: list) -> None:
        if stepped:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        row.update(skipped_step=1, loss_scale=scale)
        said.append(f"optimizer step {step} was skipped: an fp16 gradient held inf or NaN on some rank; the "
                    f"loss scale is now {scale:g}. A few skips while the scale settles are normal")
        if self.skipped_in_a_row == self.config.halvings:
            row["loss_scale_halvings"] = self.skipped_in_a_row
            said.append(f"the fp16 loss scale was halved on {self.skipped_in_a_row} optimizer steps in a row "
                        f"(now {scale:g}, at step {step}): the gradients overflow whatever the scale, so these "
                        "steps train nothing. Look for an inf or NaN made in the forward (a log of 0, a division "
                        "by zero, an fp16 overflow in a large activation), lower the learning rate, or use bf16")

    def _norm(self, step: int, norm: float, clip: float | None, row: dict, said: list) -> None:
        if len(self.norms) >= MIN_HISTORY:
            median = statistics.median(self.norms)
            if median > 0 and norm > self.config.grad_norm_factor * median:
                row.update(grad_norm_spike=norm, grad_norm_median=median)
                clipped = f", with the gradients clipped to norm {clip:g}" if clip and clip != float("inf") else ""
                said.append(f"the gradient norm at optimizer step {step} is {norm:.4g}, {norm / median:.0f}x the "
                            f"median of the last {len(self.norms)} steps ({median:.4g}): a bad batch, a learning "
                            f"rate too high, or the start of a divergence; the step was taken{clipped}")
        if norm == norm and norm != float("inf"):  # a NaN or inf norm says nothing about the scale
            self.norms.append(norm)

    def _host_norm(self, step: int, norm: torch.Tensor | None) -> tuple[int, float] | None:
        """(step, value) to check now: this step's on the CPU; on a GPU the previous step's,
        whose copy to the host was started then (module docstring)."""
        if norm is None:
            return None
        if norm.device.type != "cuda":
            return step, float(norm)
        ready, self._in_flight = self._in_flight, (step, *host_copy(norm))
        if ready is None:
            return None
        earlier, host, event = ready
        event.synchronize()  # long done: the whole step since then was queued behind it
        return earlier, float(host)


def _user_stacklevel() -> int:
    """warnings.warn's stacklevel for the first frame outside paratrain: the user's line."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PARATRAIN):
        frame, level = frame.f_back, level + 1
    return level
