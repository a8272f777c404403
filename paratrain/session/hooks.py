"""What a Session calls around each step: one small protocol, in place of a branch per helper.

A `StepHook` may define any of these; the session calls each hook it holds, in order:

    on_setup(model)              setup(), before the strategy wraps the model (the plain nn.Module)
    on_batch(inputs)             train_step(), each micro-batch's inputs, before its forward
    on_loss(loss, weight)        each micro-batch's loss, detached, and the weight it was given
    before_step(model)           the optimizer step: gradients reduced, unscaled and clipped, the
                                 optimizer not yet stepped (the wrapped model)
    after_step(session, result)  an optimizer step ended (result: session/step.py's StepResult);
                                 the loader's count and the step boundary are noted already, so a
                                 hook may checkpoint here, and end the run (close the session,
                                 raise SystemExit)

The session's own hooks, in this order: `paratrain verify`'s recorder (debug/verify.py), the step
warnings (session/watch.py), the automatic metric rows (session/autolog.py) and preemption
(session/preemption.py), which may checkpoint and exit and so comes last; then those given as
`Session(hooks=[...])`. The idea is Lightning's callbacks, and torchtitan's train-loop hooks, cut
down to the calls a training step has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from paratrain.session.session import Session
    from paratrain.session.step import StepResult


class StepHook:
    """A base whose methods do nothing: a hook defines the ones it needs (module docstring)."""

    def on_setup(self, model: nn.Module) -> None:
        pass

    def on_batch(self, inputs: Any) -> None:
        pass

    def on_loss(self, loss: torch.Tensor, weight: float | torch.Tensor | None) -> None:
        pass

    def before_step(self, model: nn.Module) -> None:
        pass

    def after_step(self, session: "Session", result: "StepResult") -> None:
        pass


class Hooks:
    """The hooks a session holds, called in order; `before_step` is None when no hook has one,
    so that the optimizer step takes no callback."""

    def __init__(self, hooks: list[Any]):
        self.hooks = [h for h in hooks if h is not None]
        for hook in self.hooks:
            if not any(callable(getattr(hook, name, None)) for name in NAMES):
                raise ConfigError(f"{type(hook).__name__} is no step hook: it defines none of {', '.join(NAMES)} "
                                "(paratrain.StepHook, session/hooks.py)")
        self._of = {name: [getattr(h, name) for h in self.hooks if _defines(h, name)] for name in NAMES}

    def on_setup(self, model: nn.Module) -> None:
        for call in self._of["on_setup"]:
            call(model)

    def on_batch(self, inputs: Any) -> None:
        for call in self._of["on_batch"]:
            call(inputs)

    def on_loss(self, loss: torch.Tensor, weight: Any) -> None:
        for call in self._of["on_loss"]:
            call(loss, weight)

    def before_step(self, model: nn.Module) -> Callable[[], None] | None:
        calls = self._of["before_step"]
        if not calls:
            return None

        def run() -> None:
            for call in calls:
                call(model)
        return run

    def after_step(self, session: "Session", result: "StepResult") -> None:
        for call in self._of["after_step"]:
            call(session, result)


NAMES = ("on_setup", "on_batch", "on_loss", "before_step", "after_step")


def _defines(hook: Any, name: str) -> bool:
    """Whether `hook` has its own `name` (not StepHook's no-op)."""
    method = getattr(type(hook), name, None)
    return callable(getattr(hook, name, None)) and method is not getattr(StepHook, name)
