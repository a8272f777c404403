"""A torchtitan-shaped decoder, small (torchtitan/models/llama3/model/model.py): its blocks in an
nn.ModuleDict under the keys "0", "1", …, each called `layer(h, self.freqs_cis)` with the root's
complex rotary table (a buffer left out of the state dict), and an `init_weights()` on the root
that sets each block's std by its depth and recomputes the table, as torchtitan's trainer calls it
after building the model on the meta device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 11, 8


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end, device=freqs.device).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)  # (end, dim / 2), complex64


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); the table's first T rows turn each pair of channels."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(turned).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def init_weights(self, init_std: float):
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x, freqs_cis):
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def init_weights(self, init_std: float):
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, dim: int, heads: int):
        super().__init__()
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 2 * dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # torchtitan's depth_init

    def init_weights(self):
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (B, T) → logits (B, T, vocab)."""

    def __init__(self, vocab: int = VOCAB, dim: int = 16, n_layers: int = 4, heads: int = 2, max_seq_len: int = SEQ):
        super().__init__()
        self.head_dim, self.max_seq_len = dim // heads, max_seq_len
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.head_dim, max_seq_len), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, dim, heads) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def init_weights(self, buffer_device: torch.device | None = None):
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = precompute_freqs_cis(self.head_dim, self.max_seq_len)
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.output.in_features ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def titan(seed: int = 0, **kwargs) -> Transformer:
    """Built and initialised as torchtitan's trainer does on one device: init_weights() from the root."""
    torch.manual_seed(seed)
    model = Transformer(**kwargs)
    model.init_weights()
    return model
