"""The model named on `paratrain plan`'s command line, built on the meta device (no memory, no
download) as often as the probe needs a fresh one, with the inputs of one batch.

A MODEL is one of:

- `package.module:factory`: a callable returning an nn.Module, called under
  `torch.device("meta")` (the current directory is importable, as under `python -m`);
- a transformers config: a JSON file (a `config.json` with its `model_type`), or a preset below
  with the published dimensions; built with `AutoModelForCausalLM.from_config`, never downloaded.

The batch a model is fed (`ModelSource.inputs`), in this order:

1. the model's own `example_inputs(batch, seq)` method, returning a tuple of positional inputs
   or a dict of keyword inputs;
2. a transformers causal LM: `input_ids` and `labels` of (batch, seq) tokens, so that the model
   computes its own cross-entropy loss, as in training;
3. a model whose first parameterised module is an nn.Embedding: token ids (batch, seq); an
   nn.Linear: floats (batch, in_features), or (batch, seq, in_features) when a seq is given.

Anything else is refused with what to add (`example_inputs`).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from paratrain.errors import ConfigError

# Published dimensions: the config.json of each model's Hugging Face repository
# (openai-community/gpt2{,-medium,-large,-xl}; meta-llama/Llama-2-{7b,13b,70b}-hf;
# meta-llama/Meta-Llama-3-{8B,70B}) and the papers (Radford et al. 2019, Table 2; Touvron et
# al. 2023, Table 1 and §2.2 for grouped-query attention in 70B; Meta's Llama 3 model card).
LLAMA2 = dict(model_type="llama", vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
LLAMA3 = dict(model_type="llama", vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
              rope_theta=500000.0, num_key_value_heads=8)
PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": dict(model_type="gpt2", n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": dict(model_type="gpt2", n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": dict(model_type="gpt2", n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": dict(model_type="gpt2", n_layer=48, n_embd=1600, n_head=25),
    "llama-2-7b": dict(LLAMA2, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32),
    "llama-2-13b": dict(LLAMA2, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b": dict(LLAMA2, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
    "llama-3-8b": dict(LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32),
    "llama-3-70b": dict(LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64),
}

Inputs = tuple[tuple, dict]  # positional and keyword inputs of one forward


@dataclass(frozen=True)
class ModelSource:
    """A model the planner can build again and again on the meta device, and feed."""

    name: str
    build: Callable[[], nn.Module]  # a fresh model, its tensors on the meta device
    default_seq: int | None = None  # the context length a transformers config states

    @functools.cached_property
    def shared(self) -> nn.Module:
        """One model built once, for what only reads it: the layouts that memory.predict and
        traffic.py count, for every strategy of a plan (the probe casts, so it builds its own).
        llama-2-70b takes 0.19 s to build on meta, and a plan of 8 devices built it 40 times."""
        return self.build()

    def inputs(self, model: nn.Module, batch: int, seq: int | None) -> Inputs:
        """One batch for `model` (module docstring), made on the current default device and mode."""
        if callable(getattr(model, "example_inputs", None)):
            made = model.example_inputs(batch, seq)
            return ((), made) if isinstance(made, dict) else (tuple(made), {})
        seq = seq or self.default_seq
        if is_causal_lm(model):
            tokens = torch.zeros(batch, _need_seq(seq, self.name), dtype=torch.long)
            return (), {"input_ids": tokens, "labels": tokens}
        first = next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)
        if isinstance(first, nn.Embedding):
            return (torch.zeros(batch, _need_seq(seq, self.name), dtype=torch.long),), {}
        if isinstance(first, nn.Linear):
            shape = (batch, seq, first.in_features) if seq else (batch, first.in_features)
            return (torch.zeros(shape, dtype=first.weight.dtype),), {}
        raise ConfigError(f"cannot tell what {self.name} takes as input (its first module is "
                          f"{type(first).__name__}): give the model a method example_inputs(batch, seq) "
                          "returning a tuple of positional inputs or a dict of keyword inputs")


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers model that computes its own loss from `labels` (transformers imported only
    if the user's code already did)."""
    transformers = sys.modules.get("transformers")
    return (transformers is not None and isinstance(model, transformers.PreTrainedModel)
            and "labels" in inspect.signature(model.forward).parameters)


def _need_seq(seq: int | None, name: str) -> int:
    if not seq:
        raise ConfigError(f"{name} takes token ids: give a sequence length (--seq S)")
    return seq


def resolve(spec: str) -> ModelSource:
    """The ModelSource a MODEL argument names (module docstring)."""
    if spec in PRESETS:
        return from_config(spec, PRESETS[spec])
    if spec.endswith(".json") or Path(spec).is_file():
        return from_config(spec, _read_config(spec))
    if ":" in spec:
        return _from_factory(spec)
    raise ConfigError(f"no model {spec!r}: give package.module:factory, a transformers config.json, "
                      f"or a preset ({', '.join(PRESETS)})")


def _read_config(path: str) -> dict:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read model config {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {path} is not JSON: {e}") from None
    if "model_type" not in raw:
        raise ConfigError(f"model config {path} has no model_type: is it a transformers config.json?")
    return raw


def from_config(name: str, raw: dict) -> ModelSource:
    """A transformers model of config `raw` (a config.json's fields, `model_type` among them)."""
    raw = dict(raw)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigError(f"{name} is a transformers model: install transformers "
                          "(pip install 'paratrain[examples]')") from None
    try:
        config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"transformers cannot read the config of {name}: {e}") from None
    config.use_cache = False  # training: no key/value cache

    def build() -> nn.Module:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        if getattr(model, "loss_type", "") is None:  # the default it falls back to, with a warning
            model.loss_type = "ForCausalLM"
        return model

    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return ModelSource(name=name, build=build, default_seq=context)


def _from_factory(spec: str) -> ModelSource:
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's own package, from here
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as e:
        raise ConfigError(f"cannot import {module_name} for the model {spec}: {e}") from None
    except AttributeError:
        raise ConfigError(f"{module_name} has no {attr!r} (the model factory {spec})") from None
    if not callable(factory):
        raise ConfigError(f"{spec} is not callable: name a function or class that returns an nn.Module")

    def build() -> nn.Module:
        try:
            with torch.device("meta"):
                model = factory()
        except Exception as e:
            raise ConfigError(f"the model factory {spec} raised {type(e).__name__}: {e}") from e
        if not isinstance(model, nn.Module):
            raise ConfigError(f"the model factory {spec} returned a {type(model).__name__}, not an nn.Module")
        return model

    return ModelSource(name=spec, build=build)
