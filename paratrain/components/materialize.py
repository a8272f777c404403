"""Models built on the meta device: real memory and values for exactly the tensors a rank holds.

    with torch.device("meta"):
        model = GPT(config)                       # no memory: shapes only
    model, optimizer = session.setup(model, optimizer)   # zero3: each rank builds its shard

[Note: the initialisation rule]
Every tensor (parameter or buffer) is initialised by its owner: the module under which the whole
model first lists it (`named_modules()` order; a weight tied to another belongs to the first of
them). The owner's `reset_parameters()` runs (or nn.MultiheadAttention's `_reset_parameters()`),
then the user's `init_fn(owner)` if one was given, on the CPU, with torch's generator seeded from
(seed, the owner's path in the whole model) for that call alone. While the call runs, every
tensor the owner holds directly is real, so it draws the same random numbers whatever else
exists yet; what it writes to tensors it does not own is put back. So a value depends on the
seed, the model and its path only: not on the strategy, the world size, which part a rank builds
or in what order, nor the device. The reference for a sharded run is the same model
materialised whole by the same rule (`Materializer(model).materialize()`).

A module that owns a meta tensor, has no reset_parameters() and is given no init_fn is refused,
naming it: its values would be whatever the memory held. So is a floating-point tensor that its
owner's reset_parameters() and init_fn leave unset, wholly or in part (a causal mask built in
`__init__`, which on the meta device holds no values, is the common case): each is filled with NaN
before the calls and checked after them. Integer and boolean tensors cannot be marked that way;
their owner's calls must set them.

An init_fn that writes tensors of other modules (a root's `init_weights()` called from init_fn)
is refused, naming them: each tensor is set by its owner alone, so those writes would be lost
and torch's default init would stand. A model that initialises from its root takes
`MetaInit(root="init_weights")` instead (`setup(..., init="init_weights")`): the root's method runs
in place of every owner's calls ([Note: an init from the root], components/root_init.py).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from paratrain.components.root_init import RootInit
from paratrain.errors import ConfigError


@dataclass(frozen=True)
class MetaInit:
    """How a meta-built model gets its values ([Note: the initialisation rule])."""

    seed: int = 0  # the session's seed
    init_fn: Callable[[nn.Module], None] | None = None  # runs after each owner's reset_parameters()
    # the root's method that initialises the whole model (torchtitan's "init_weights"), called
    # seeded with `seed` instead of every owner's calls (components/root_init.py)
    root: str | None = None


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def direct_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers `module` holds itself (not its children's)."""
    return [t for t in itertools.chain(module._parameters.values(), module._buffers.values()) if t is not None]


class Materializer:
    """The owners of a whole model's tensors, read while the model is whole, to materialise any
    part of it later (a ZeRO-3 unit, a pipeline stage) by the rule."""

    def __init__(self, model: nn.Module, init: MetaInit | None = None):
        self.model, self.init = model, init or MetaInit()
        if self.init.root is not None and self.init.init_fn is not None:
            raise ConfigError(f"setup(..., init={self.init.root!r}) initialises the whole model from its root; "
                              "init_fn=... sets each module's tensors instead: pass one of them")
        self._root = RootInit(model, self.init.root) if self.init.root is not None else None
        self._owner: dict[int, tuple[int, str, nn.Module]] = {}  # id(tensor) → (order, path, owner)
        for order, (path, module) in enumerate(model.named_modules(remove_duplicate=False)):
            for t in direct_tensors(module):
                self._owner.setdefault(id(t), (order, path, module))

    def materialize(self, tensors: Iterable[torch.Tensor] | None = None,
                    device: torch.device | None = None) -> None:
        """Give `tensors` (default: every meta tensor of the model) memory on `device` (default
        the CPU) and their values by the rule; tensors already real are left alone."""
        todo = [t for t in (tensors if tensors is not None else self._all()) if t.is_meta]
        for t in todo:
            _swap(t, "cpu")
            if _holds_nan(t):
                t.detach().fill_(float("nan"))  # unset: whatever is still NaN after the owners ran
        untouched = {id(t): (t._version, t.data_ptr()) for t in todo}  # integers: never written is unset
        mine = {id(t) for t in todo}
        if self._root is not None:
            self._root.run(self.init.seed, todo)
        else:
            owners = {self._owner[i][0]: self._owner[i][1:] for i in mine}  # whole-model order → (path, owner)
            for order in sorted(owners):
                self._initialise(*owners[order], mine)
        self._check_set(todo, untouched)
        if device is not None and torch.device(device).type != "cpu":
            for t in todo:
                _swap(t, device)

    def _check_set(self, tensors: list[torch.Tensor], untouched: dict[int, tuple[int, int]]) -> None:
        """Refuse, by name, tensors that no owner's call set: a floating-point or complex one
        still NaN somewhere, an integer or boolean one never written (torchtitan's RoPE table
        `freqs_cis` is a complex buffer)."""
        unset = [t for t in tensors if (bool(torch.isnan(t.detach()).any()) if _holds_nan(t)
                                        else (t._version, t.data_ptr()) == untouched[id(t)])]
        if unset:
            names = {id(t): f"{path + '.' if path else ''}{name}" for path, module in self.model.named_modules()
                     for name, t in itertools.chain(module._parameters.items(), module._buffers.items())
                     if t is not None}
            raise ConfigError(f"{', '.join(names[id(t)] for t in unset)} of the meta-built model "
                              f"{'was' if len(unset) == 1 else 'were'} not set (wholly or in part) by the owning "
                              "module's reset_parameters() nor by init_fn: a tensor made in __init__ on the meta "
                              "device has no values. Set it in reset_parameters() or in "
                              "setup(..., init_fn=fn), where fn(module) sets the values of what a module holds")

    def _all(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for t in itertools.chain(self.model.parameters(), self.model.buffers()):
            seen.setdefault(id(t), t)
        return list(seen.values())

    def _initialise(self, path: str, owner: nn.Module, mine: set[int]) -> None:
        reset = getattr(owner, "reset_parameters", None) or getattr(owner, "_reset_parameters", None)
        if not callable(reset) and self.init.init_fn is None:
            held = [n for n, t in itertools.chain(owner._parameters.items(), owner._buffers.items())
                    if t is not None and id(t) in mine]
            raise ConfigError(f"{path or 'the model'} ({type(owner).__name__}) holds {', '.join(held)} on the "
                              "meta device but has no reset_parameters() to initialise them: pass "
                              "setup(..., init_fn=fn), where fn(module) sets the values of what a module holds")
        # what it holds but does not own now (another module's, a weight tied to it; or built
        # before, or to be built later) is written by its reset too, and put back after
        others = [t for t in direct_tensors(owner) if id(t) not in mine or self._owner[id(t)][2] is not owner]
        kept = [t.detach().clone() if not t.is_meta else None for t in others]
        for t in others:
            if t.is_meta:  # real while the owner draws, so it draws what it draws on a whole model
                _swap(t, "cpu")
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(owner_seed(self.init.seed, path))
            if callable(reset):
                reset()
            if self.init.init_fn is not None:
                with _Writes() as writes:
                    self.init.init_fn(owner)
                self._refuse_others(path, owner, writes.targets)
        for t, value in zip(others, kept):
            if value is None:
                _swap(t, "meta")
            else:
                t.detach().copy_(value)


    def _refuse_others(self, path: str, owner: nn.Module, written: list[torch.Tensor]) -> None:
        """An init_fn that wrote tensors its module does not hold: lost, so refused by name."""
        direct = {id(t) for t in direct_tensors(owner)}
        others = {id(t): t for t in written if id(t) in self._owner and id(t) not in direct}
        if others:
            names = {id(t): f"{p + '.' if p else ''}{n}" for p, m in self.model.named_modules()
                     for n, t in itertools.chain(m._parameters.items(), m._buffers.items()) if t is not None}
            listed = ", ".join(sorted(names[i] for i in others)[:4]) + (" …" if len(others) > 4 else "")
            raise ConfigError(f"init_fn({path or 'the model'}) wrote {listed}, which {type(owner).__name__} does "
                              "not hold: each tensor of a meta-built model is set by its own module's "
                              "reset_parameters() and init_fn(module), so these writes would be lost. Set only "
                              "what the module holds, or, for a model that initialises from its root "
                              "(torchtitan's init_weights()), pass setup(..., init='init_weights')")


class _Writes(TorchFunctionMode):
    """The tensors written in place while it is on: the first argument of every call whose name
    ends in "_" (Tensor.normal_, nn.init.trunc_normal_, which returns early on a meta tensor)."""

    def __init__(self):
        super().__init__()
        self.targets: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args and isinstance(args[0], torch.Tensor):
            self.targets.append(args[0])
        return func(*args, **(kwargs or {}))


def owner_seed(seed: int, path: str) -> int:
    """The generator seed of the module at `path`: a stable hash, the same in every process."""
    digest = hashlib.sha256(f"{seed}:{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**63)


def _swap(t: torch.Tensor, device: torch.device | str) -> None:
    """Move `t` to `device` in place, every module holding that tensor object (a tied weight too)
    seeing the new one; to or from the meta device the new memory is uninitialised."""
    keep_values = not t.is_meta and torch.device(device).type != "meta"
    new = t.detach().to(device) if keep_values else torch.empty_like(t, device=device)
    if isinstance(t, nn.Parameter):
        new = nn.Parameter(new, requires_grad=t.requires_grad)
    torch.utils.swap_tensors(t, new)


def whole(model: nn.Module, init: MetaInit | None = None) -> nn.Module:
    """`model` with every meta tensor materialised by the rule, on the CPU: what strategies that
    hold the whole model on every rank do first (`.to(device)` follows)."""
    if has_meta(model):
        Materializer(model, init).materialize()
    return model


def materialize(model: nn.Module, *, seed: int = 0, init_fn: Callable[[nn.Module], None] | None = None,
                init: str | None = None) -> nn.Module:
    """`model`, built on the meta device, materialised whole on the CPU by the rule: the reference
    a sharded run of the same model with the same seed and init_fn (or `init`, the root's method
    that initialises the whole model) equals."""
    return whole(model, MetaInit(seed, init_fn, init))


def _holds_nan(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()
