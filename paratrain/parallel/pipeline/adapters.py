"""Which cut a model gets (`cut_for`), and cuts for known models that do not define pipeline_embed /
pipeline_head themselves (cut.py, [Note: cutting a model by names]): transformers' GPT-2 and its
Llama-shaped decoders (Llama, Mistral, Qwen2), and torchtitan's decoders. Each is the model's own
forward, split where its blocks begin and end; tests/parallel/pipeline/test_pipeline_cut.py and
tests/test_torchtitan.py check them against the model's forward."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.pipeline.cut import Cut


def _gpt2_embed(model: nn.Module, inputs: Any) -> torch.Tensor:
    """GPT2Model.forward up to its blocks: token and position embeddings, dropout. `inputs`: the
    token ids, or a batch dict holding them (its labels are for the last stage's loss)."""
    input_ids = inputs["input_ids"] if isinstance(inputs, Mapping) else inputs
    t = model.transformer
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
    return t.drop(t.wte(input_ids) + t.wpe(positions))  # (B, T, C)


def _gpt2_block(block: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    # no attention mask: the attention is causal by itself (sdpa's is_causal), which is what
    # GPT2Model passes for unpadded batches; padded batches are not supported on stages
    out = block(hidden)
    return out[0] if isinstance(out, tuple) else out


def _gpt2_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The final LayerNorm and the language-model head: logits (B, T, vocab)."""
    return model.lm_head(model.transformer.ln_f(hidden))


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: position t predicts label t+1; labels of -100 are ignored."""
    return F.cross_entropy(logits[..., :-1, :].flatten(0, -2).float(), labels[..., 1:].flatten(), ignore_index=-100)


GPT2_CUT = Cut("transformer.h", embed=_gpt2_embed, head=_gpt2_head, block=_gpt2_block, loss=causal_lm_loss)


# transformers' LlamaModel.forward (and Mistral's, Qwen2's): embed_tokens → position_ids 0 … T-1 →
# `rotary_emb(h, position_ids)`, the (cos, sin) every layer takes → each layer → norm; the
# causal mask is None under sdpa and flash attention, whose kernels are causal by themselves
def _llama_embed(model: nn.Module, inputs: Any) -> torch.Tensor:
    input_ids = inputs["input_ids"] if isinstance(inputs, Mapping) else inputs
    return model.model.embed_tokens(input_ids)  # (B, T) → (B, T, C)


def _llama_block_args(model: nn.Module, hidden: torch.Tensor) -> tuple:
    config, length = model.config, hidden.shape[1]
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and length > window:  # the model would mask beyond the window; this cut does not
        raise ConfigError(f"{type(model).__name__}'s sliding window ({window} tokens) is shorter than these "
                          f"sequences ({length}): the built-in pipeline cut gives its layers a plain causal "
                          "mask; train on sequences of at most the window, or give pt.Pipeline(cut=pt.Cut(...)) "
                          "whose block_args build the sliding-window mask")
    positions = torch.arange(length, device=hidden.device).unsqueeze(0)
    mask = None
    if getattr(config, "_attn_implementation", "sdpa") == "eager":  # it adds the mask it is given
        mask = torch.full((length, length), torch.finfo(hidden.dtype).min, device=hidden.device,
                          dtype=hidden.dtype).triu(1)[None, None]
    return model.model.rotary_emb(hidden, positions), positions, mask


def _llama_block(block: nn.Module, hidden: torch.Tensor, rotary: tuple, positions: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
    out = block(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
    return out[0] if isinstance(out, tuple) else out  # older transformers return (hidden, ...)


def _llama_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.lm_head(model.model.norm(hidden))  # logits (B, T, vocab)


LLAMA_CUT = Cut("model.layers", embed=_llama_embed, head=_llama_head, block=_llama_block,
                block_args=_llama_block_args, every=("model.rotary_emb",), loss=causal_lm_loss)


# torchtitan's decoders (models/llama3/model/model.py and its siblings): `Transformer.forward` is
# tok_embeddings → `layer(h, self.freqs_cis, ...)` for each of the ModuleDict `layers` → norm,
# output; the rotary table is a buffer of the root, which every stage keeps
def _titan_embed(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model.tok_embeddings(tokens)  # (B, T) → (B, T, C)


def _titan_block_args(model: nn.Module, hidden: torch.Tensor) -> tuple:
    return (model.freqs_cis,)


def _titan_block(block: nn.Module, hidden: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # later torchtitan blocks take attention_masks with no default: None, which is what
    # Transformer.forward passes under sdpa's causal attention
    return block(hidden, freqs_cis, **({"attention_masks": None} if _wants_masks(type(block)) else {}))


@functools.lru_cache(maxsize=None)
def _wants_masks(block_class: type) -> bool:
    parameter = inspect.signature(block_class.forward).parameters.get("attention_masks")
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _titan_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return model.output(model.norm(hidden))  # (B, T, C) → logits (B, T, vocab)


TORCHTITAN_CUT = Cut("layers", embed=_titan_embed, head=_titan_head, block=_titan_block,
                     block_args=_titan_block_args)


def _is_torchtitan_decoder(model: nn.Module) -> bool:
    """torchtitan's Transformer, recognised by its parts (its class name is a common one)."""
    return (type(model).__name__ == "Transformer" and isinstance(getattr(model, "layers", None), nn.ModuleDict)
            and all(hasattr(model, name) for name in ("tok_embeddings", "norm", "output", "freqs_cis")))


def known_cut(model: nn.Module) -> Cut | None:
    """The built-in cut for `model`'s class, or None."""
    if _is_torchtitan_decoder(model):
        return TORCHTITAN_CUT
    known: dict[str, Any] = {"GPT2LMHeadModel": GPT2_CUT, "LlamaForCausalLM": LLAMA_CUT,
                             "MistralForCausalLM": LLAMA_CUT, "Qwen2ForCausalLM": LLAMA_CUT}
    return known.get(type(model).__name__)


def cut_for(model: nn.Module, layers: str | None, cut: Cut | None) -> Cut:
    """The cut to use: the one given; else the model's own pipeline_embed / pipeline_head around
    `layers`; else a built-in adapter for a known model; else an error saying what to give."""
    if cut is not None:
        return cut
    embed, head = getattr(type(model), "pipeline_embed", None), getattr(type(model), "pipeline_head", None)
    if layers is not None and embed is not None and head is not None:
        return Cut(layers, embed=embed, head=head)
    found = known_cut(model)
    if found is not None:
        return found
    raise ConfigError(f"a pipeline cuts an nn.Sequential between its layers, or a model whose forward is "
                      f"embed → blocks → head at named blocks; {type(model).__name__} is neither. Give "
                      "Pipeline(layers='blocks') and define pipeline_embed(inputs) and pipeline_head(x) on "
                      "the model, or pass cut=pt.Cut(layers=..., embed=..., head=...) (parallel/pipeline/cut.py)")
