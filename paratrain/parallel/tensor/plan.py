"""Which modules tensor parallelism cuts, and how: the plan, resolved, matched and checked.

A plan maps module-name patterns to styles, as torch's `parallelize_module` and transformers'
`base_model_tp_plan` write them ("layers.*.attn.q": "colwise"; `*` is one path component). It is
taken from, in order:

    1. Mesh(tp_plan={...})
    2. the model's `tp_plan` attribute (a dict; transformers 5 resolves a model's whole plan there)
    3. a transformers model's `config.base_model_tp_plan`, its names under the base model
       (`model.` for LlamaForCausalLM), with the model class's own `_tp_plan` ({"lm_head": ...})

Styles: "colwise" (ColwiseLinear), "colwise_rep" / "colwise_gather_output" (the same, its output
gathered whole: an LM head), "rowwise" / "rowwise_rep" (RowwiseLinear; on an nn.Embedding,
VocabEmbedding) and "embedding_rowwise". Modules the plan does not name are replicated over tp.

Refused, by name, before anything is cut: a plan that names no module (an entry of a plan given
by hand or by the model that matches nothing; a transformers plan of which nothing matches), a
style that does not fit its module, and a size tp does not divide: a layer's sharded features,
an embedding's vocabulary, or a count of attention heads (`num_heads`, `n_kv_heads`, … on a
module the plan cuts inside, or the transformers config's).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from paratrain.errors import ConfigError

COLWISE, GATHERED, ROWWISE = "colwise", "colwise_gathered", "rowwise"
STYLES = {  # the names accepted → what they build
    "colwise": COLWISE, "colwise_rep": GATHERED, "colwise_gather_output": GATHERED,
    "rowwise": ROWWISE, "rowwise_rep": ROWWISE, "embedding_rowwise": ROWWISE,
}
FITS = {COLWISE: (nn.Linear,), GATHERED: (nn.Linear,), ROWWISE: (nn.Linear, nn.Embedding)}
HEAD_COUNTS = ("num_heads", "n_heads", "n_head", "heads", "num_attention_heads", "num_key_value_heads",
               "num_kv_heads", "n_kv_heads", "n_kv_head")


@dataclass(frozen=True)
class Plan:
    """A resolved plan: each module name → the style that cuts it, and where the plan came from."""

    styles: dict[str, str]
    source: str


def resolve(model: nn.Module, given: Mapping[str, str] | None) -> tuple[dict[str, str], str, bool]:
    """(the plan's entries, where they came from, whether every entry must match a module)."""
    if given is not None:
        return dict(given), "Mesh(tp_plan=...)", True
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None)  # a transformers model
    own = getattr(model, "tp_plan", None)
    if isinstance(own, Mapping) and own:  # transformers >= 5 resolves its whole plan there
        return dict(own), f"{type(model).__name__}.tp_plan", base is None
    if isinstance(base, Mapping) and base:
        prefix = getattr(model, "base_model_prefix", "")
        under = f"{prefix}." if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
        entries = {f"{under}{k}": v for k, v in base.items()}
        entries.update(getattr(type(model), "_tp_plan", None) or {})
        return entries, f"{type(config).__name__}.base_model_tp_plan", False
    raise ConfigError(f"tensor parallelism needs a plan saying which layers to cut, and {type(model).__name__} "
                      "has none: pass Mesh(tp_plan={'layers.*.attn.q': 'colwise', 'layers.*.attn.o': "
                      "'rowwise', ...}), or give the model a tp_plan attribute")


def matches(pattern: str, name: str) -> bool:
    """`pattern` names module `name`: the same number of dotted parts, each matching (`*` one part)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names))


def plan_for(model: nn.Module, given: Mapping[str, str] | None, tp: int) -> Plan:
    """The checked plan of `model` at `tp` ranks (the model may be on the meta device)."""
    entries, source, strict = resolve(model, given)
    unknown = {k: v for k, v in entries.items() if v not in STYLES}
    if unknown:
        raise ConfigError(f"{source} has style(s) paratrain does not know: {unknown}; use one of {sorted(STYLES)}")
    styles: dict[str, str] = {}
    used = set()
    for name, _ in model.named_modules():
        for pattern, style in entries.items():
            if name and matches(pattern, name):
                styles.setdefault(name, STYLES[style])
                used.add(pattern)
    missing = [p for p in entries if p not in used]
    if (strict and missing) or not styles:
        raise ConfigError(f"{source} names no module for {missing or list(entries)}: patterns are module names from "
                          f"model.named_modules(), `*` standing for one part (e.g. 'layers.*.attn.q'); "
                          f"this model's first modules are {[n for n, _ in model.named_modules()][1:6]}")
    modules = dict(model.named_modules())
    for name, style in styles.items():
        _check_fits(name, modules[name], style, tp)
    _check_heads(model, styles, tp)
    return Plan(styles, source)


def _check_fits(name: str, module: nn.Module, style: str, tp: int) -> None:
    if not isinstance(module, FITS[style]):
        raise ConfigError(f"the plan cuts {name} ({type(module).__name__}) {style}, which fits "
                          f"{' or '.join(t.__name__ for t in FITS[style])} only: leave it out of the plan "
                          "(it is then replicated), or name the linear layers inside it")
    if isinstance(module, nn.Embedding):
        size, what = module.num_embeddings, "vocabulary (num_embeddings)"
    elif style == ROWWISE:
        size, what = module.in_features, "in_features"
    else:
        size, what = module.out_features, "out_features"
    if size % tp:
        raise ConfigError(f"tp={tp} does not divide {name}'s {what}, {size}: choose tp among "
                          f"{[d for d in range(1, size + 1) if size % d == 0 and d <= 64]}, or pad the layer")


def _check_heads(model: nn.Module, styles: dict[str, str], tp: int) -> None:
    """Counts of attention heads tp must divide: on each module the plan cuts inside of, and the
    transformers config's."""
    holders: list[tuple[str, Any]] = [("config", getattr(model, "config", None))]
    holders += [(name or "the model", m) for name, m in model.named_modules()
                if any(s.startswith(f"{name}.") or not name for s in styles)]
    for where, holder in holders:
        for attr in HEAD_COUNTS:
            count = getattr(holder, attr, None) if holder is not None else None
            if isinstance(count, int) and not isinstance(count, bool) and count % tp:
                raise ConfigError(f"tp={tp} does not divide {where}.{attr} = {count}: each rank must hold whole "
                                  f"attention heads; choose tp among {[d for d in range(1, count + 1) if count % d == 0]}")
