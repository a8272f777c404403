"""Which submodules of a model ZeRO stage 3 gathers and frees as units of their own."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# Containers whose forward nobody calls (their owner iterates them, as nn.TransformerEncoder does
# its `layers`): a unit's gather runs in its forward hooks, which would never fire. Their members
# may be units; their owner is chosen in their place.
NEVER_CALLED = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class WrapPolicy:
    """Which submodules become units of their own (gathered and freed on their own)."""

    module_classes: tuple[type, ...] = ()  # every submodule of these classes (e.g. the blocks)
    min_params: int = 0  # also any submodule holding at least this many not-yet-wrapped parameters

    def select(self, root: nn.Module) -> list[str]:
        """Names of the submodules to wrap, innermost first."""
        chosen: dict[str, None] = {}  # in the order chosen; looked up by _big_enough
        for name, module in reversed(list(root.named_modules())):
            if not name or isinstance(module, NEVER_CALLED):
                continue
            if isinstance(module, self.module_classes) or self._big_enough(name, module, chosen):
                chosen[name] = None
        return list(chosen)

    def _big_enough(self, name: str, module: nn.Module, chosen: dict[str, None]) -> bool:
        """Whether `module` holds min_params parameters outside the units chosen inside it: a
        parameter is inside one when a module enclosing it under `module` is a chosen unit
        (looked up by path: a scan of the chosen units for each parameter took 3.7 s of
        `paratrain plan llama-2-70b`)."""
        if self.min_params <= 0:
            return False
        free = sum(p.numel() for n, p in module.named_parameters()
                   if not any(f"{name}.{m}" in chosen for m in enclosing_modules(n)))
        return free >= self.min_params


def enclosing_modules(path: str) -> list[str]:
    """The module paths enclosing a dotted parameter path, outermost first: "a.b.w" → a, a.b."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


DEFAULT_WRAP_POLICY = WrapPolicy(min_params=1_000_000)  # units of about 4 MB of fp32 parameters
