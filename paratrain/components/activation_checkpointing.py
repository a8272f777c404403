"""Activation checkpointing: keep a block's inputs instead of its intermediate activations, and
run the block's forward again in backward (Chen et al. 2016, "Training Deep Nets with Sublinear
Memory Cost"; torch.utils.checkpoint).

`Session(activation_checkpointing=...)` applies it in setup, before the strategy wraps the model,
which is why it works under every strategy. Each chosen module's forward runs inside
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, which

- saves the block's inputs only, and recomputes the block in backward when autograd first needs
  one of the tensors the block saved;
- restores the RNG state for the recompute (`preserve_rng_state`), so dropout draws the masks it
  drew in the forward, and leaves the RNG where the forward left it;
- runs inside the module's own call, so hooks around that call stay where they were: ZeRO-3
  gathers a unit before its forward and again before its backward, and the recompute runs in
  that backward, with the unit gathered.

Which modules (`which`): a module class or a tuple of them; a predicate `fn(name, module) ->
bool`; or "auto": the members of every nn.ModuleList or nn.ModuleDict whose members are all of
one class (the blocks of a GPT, of transformers' models, of nn.TransformerEncoder, torchtitan's
`layers` ModuleDict). Never an nn.ModuleList or ModuleDict itself, which nobody calls; and a
module inside one already chosen is left alone, its activations not being kept anyway. Under torch.no_grad() (evaluation) the forward runs as it is,
there being nothing to save.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Union

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paratrain.errors import ConfigError

Which = Union[str, type, tuple, Callable[[str, nn.Module], bool]]
NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)  # their owners iterate them: a forward to wrap never runs


def checkpoint_activations(model: nn.Module, which: Which = "auto") -> list[str]:
    """Checkpoint the activations of `model`'s modules chosen by `which` (module docstring), in
    place; returns their names. A module is wrapped once, however often this is called."""
    chosen = select(model, which)
    for _, module in chosen:
        if not getattr(module.forward, "paratrain_checkpointed", False):
            module.forward = types.MethodType(_checkpointed_forward, module)
    return [name for name, _ in chosen]


def select(model: nn.Module, which: Which) -> list[tuple[str, nn.Module]]:
    """The outermost modules `which` chooses, by name; a ConfigError when it chooses none."""
    test = _test(model, which)
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(outer + ".") for outer, _ in chosen)
        if name and not inside and not isinstance(module, NEVER_CALLED) and test(name, module):
            chosen.append((name, module))
    if not chosen:
        raise ConfigError(f"activation_checkpointing={_describe(which)} chose no module of "
                          f"{type(model).__name__}: name its block class (activation_checkpointing=Block), "
                          "or pass a predicate fn(name, module) -> bool (an nn.ModuleList is never called: "
                          "choose its members)")
    return chosen


def _test(model: nn.Module, which: Which) -> Callable[[str, nn.Module], bool]:
    if which == "auto":
        blocks = {id(b) for m in model.modules() if isinstance(m, NEVER_CALLED) and len(m) > 1
                  and len({type(b) for b in m.children()}) == 1 for b in m.children()}
        return lambda name, module: id(module) in blocks
    if isinstance(which, type) or (isinstance(which, tuple) and all(isinstance(t, type) for t in which)):
        return lambda name, module: isinstance(module, which)
    if callable(which) and not isinstance(which, str):
        return which
    raise ConfigError(f"activation_checkpointing takes a module class, a tuple of them, a predicate "
                      f"fn(name, module) -> bool, or 'auto'; got {which!r}")


def _describe(which: Which) -> str:
    return getattr(which, "__name__", None) or repr(which)


# What a recompute must run inside, as its forward did: each, called at the forward, returns a
# context manager that re-enters the state then current (or None). The recompute runs in
# backward, where a torch function mode of the forward's is not active: context parallelism's
# routing of attention (parallel/context/routing.py) registers itself here.
RECOMPUTE_STATE: list[Callable[[], contextlib.AbstractContextManager | None]] = []


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # the class's forward, looked up at each call: a deep copy of the module (whose __dict__ holds
    # this method, rebound to the copy) runs the copy's own forward
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    states = [state for state in (capture() for capture in RECOMPUTE_STATE) if state is not None]
    if states:
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), _entered(states))
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def _entered(states: list[contextlib.AbstractContextManager]):
    with contextlib.ExitStack() as stack:
        for state in states:
            stack.enter_context(state)
        yield


_checkpointed_forward.paratrain_checkpointed = True  # type: ignore[attr-defined]
