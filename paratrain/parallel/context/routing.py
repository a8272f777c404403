"""How a model written for whole sequences runs on this rank's cut of one, unchanged: inside
the training step (model.py), a torch function mode routes the calls that would otherwise see
only the local tokens.

    F.scaled_dot_product_attention(q, k, v, is_causal=...)
                    → ring attention over the cp group (ring.py), all-to-all (ulysses.py) or
                      all-gather (all_gather.py);
                      the same arguments: causal or full, `scale`, `enable_gqa`
    torch.arange(n), n the local sequence length
                    → the global positions of this rank's tokens (sharding.positions), so rotary
                      angles or learned position embeddings computed from torch.arange(seq)
                      stay right (Mesh(cp_positions=False) turns this off; a forward that takes
                      `position_ids` gets them instead, and this is off)
    positions(n)    the same, asked for by name: a model of one's own may call
                    paratrain.positions(seq) where it would call torch.arange(seq)

torch's own `context_parallel` routes SDPA the same way (a function mode or a patch of
F.scaled_dot_product_attention, torch/distributed/tensor/experimental/_context_parallel). What
cannot be routed is refused by name: an `attn_mask` (a padding or document mask is not causal
or full: pack without padding, labels -100 where the loss must not look), dropout inside
attention (its random mask would differ from one process's), and queries of another length
than the cut sequence's (cross-attention).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paratrain.components.activation_checkpointing import RECOMPUTE_STATE
from paratrain.distributed.comm import ByteCounter
from paratrain.errors import UsageError
from paratrain.parallel.context import sharding
from paratrain.parallel.context.all_gather import all_gather_attention
from paratrain.parallel.context.ring import ring_attention
from paratrain.parallel.context.ulysses import all_to_all_attention


@dataclass
class Cut:
    """The sequence being trained on: this rank's place in the cp group and the lengths."""

    group: Any
    rank: int
    cp: int
    length: int  # the whole sequence's tokens
    mode: str = "ring"  # or "all-to-all", "all-gather"
    arange: bool = True  # torch.arange(local length) gives the global positions
    counter: ByteCounter | None = None  # bytes of K and V sent, when counted

    @property
    def local(self) -> int:
        return self.length // self.cp

    def positions(self, device=None) -> torch.Tensor:
        return sharding.positions(self.length, self.rank, self.cp, device)


_CURRENT: list[Cut] = []  # the cut being trained on (innermost last); empty outside a cp step


def positions(length: int, device=None, dtype=None) -> torch.Tensor:
    """torch.arange(length), or inside a context-parallel step, where `length` is this rank's
    share of the sequence, the global positions of its tokens."""
    cut = _CURRENT[-1] if _CURRENT else None
    if cut is None or length != cut.local:
        return torch.arange(length, device=device, dtype=dtype)
    return cut.positions(device).to(dtype or torch.int64)


@contextlib.contextmanager
def routed(cut: Cut) -> Iterator[None]:
    """Run the block (a forward and its backward) on `cut`: attention and positions routed."""
    _CURRENT.append(cut)
    try:
        with _Router(cut):
            yield
    finally:
        _CURRENT.pop()


def _recompute_state() -> contextlib.AbstractContextManager | None:
    """The routing a checkpointed block's recompute in backward must run under: this one's."""
    return routed(_CURRENT[-1]) if _CURRENT else None


RECOMPUTE_STATE.append(_recompute_state)


class _Router(TorchFunctionMode):
    def __init__(self, cut: Cut):
        super().__init__()
        self.cut = cut

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        if func is torch.arange and self.cut.arange and _plain_arange(args, kwargs) == self.cut.local:
            return self.cut.positions(kwargs.get("device")).to(kwargs.get("dtype") or torch.int64)
        return func(*args, **kwargs)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        cut = self.cut
        where = f"Mesh(cp={cut.cp}) routes F.scaled_dot_product_attention to {cut.mode} attention over the sequence"
        if attn_mask is not None:
            raise UsageError(f"{where}, causal (is_causal=True) or full; this call passed an attn_mask of shape "
                             f"{tuple(attn_mask.shape)}, which it cannot cut: leave padding out (pack sequences, "
                             "labels -100 where the loss must not look) and pass is_causal=True, or train "
                             "without cp")
        if dropout_p:
            raise UsageError(f"{where}; this call asked for dropout_p={dropout_p} inside attention, whose random "
                             "mask would not be one process's: set the attention dropout to 0 under cp")
        if query.shape[-2] != cut.local or key.shape[-2] != cut.local:
            raise UsageError(f"{where}: its queries and keys must be this rank's {cut.local} tokens of the "
                             f"{cut.length} cut; this call has {query.shape[-2]} queries and {key.shape[-2]} keys "
                             "(cross-attention, or a sequence of another length, is not routed)")
        if key.shape[-3] != query.shape[-3] and not enable_gqa:
            raise UsageError(f"scaled_dot_product_attention got {query.shape[-3]} query heads and {key.shape[-3]} "
                             "key heads without enable_gqa=True (torch refuses it too)")
        if cut.mode == "all-to-all":
            return all_to_all_attention(query, key, value, cut.group, causal=is_causal, scale=scale)
        if cut.mode == "all-gather":
            return all_gather_attention(query, key, value, cut.group, causal=is_causal, scale=scale, counter=cut.counter)
        return ring_attention(query, key, value, cut.group, causal=is_causal,
                              scale=1 / math.sqrt(query.shape[-1]) if scale is None else scale, counter=cut.counter)


def _plain_arange(args: tuple, kwargs: dict) -> int | None:
    """n for torch.arange(n) or torch.arange(0, n) (step 1, no out=); None for any other call."""
    if "out" in kwargs or kwargs.get("step", 1) != 1 or kwargs.get("start", 0) != 0:
        return None
    values = list(args) + ([kwargs["end"]] if "end" in kwargs else [])
    if len(values) == 1:
        end = values[0]
    elif len(values) in (2, 3) and values[0] == 0 and (len(values) == 2 or values[2] == 1):
        end = values[1]
    else:
        return None
    return end if isinstance(end, int) else None
