"""A small Llama-style decoder (RMSNorm, SwiGLU, rotary positions, grouped-query attention) whose
attention infers its local heads from the shape, as transformers' Llama does: what tensor
parallelism is proved on."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PLAN = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
        "layers.*.attn.o": "rowwise", "layers.*.mlp.gate": "colwise", "layers.*.mlp.up": "colwise",
        "layers.*.mlp.down": "rowwise"}


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, positions=None):  # x: (B, H, T, D): rotary position embedding, the half-split form
    t, d = x.shape[-2], x.shape[-1]
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=x.dtype, device=x.device) / d))
    positions = torch.arange(t, dtype=x.dtype, device=x.device) if positions is None else positions.to(x.dtype)
    angles = torch.outer(positions, freqs)  # (T, D/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(self, x, positions=None):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (self.q(x), self.k(x), self.v(x)))
        q, k = rotate(q, positions), rotate(k, positions)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, width: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate, self.up = nn.Linear(width, hidden, bias=bias), nn.Linear(width, hidden, bias=bias)
        self.down = nn.Linear(hidden, width, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int, bias: bool):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(width), Attention(width, heads, kv_heads)
        self.mlp_norm, self.mlp = RMSNorm(width), SwiGLU(width, hidden, bias)

    def forward(self, x, positions=None):
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Token ids (B, T) → logits (B, T, V). `tp_plan` names the layers tensor parallelism cuts."""

    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                 hidden: int = 48, tied: bool = False, bias: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads, kv_heads, hidden, bias) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.tp_plan = dict(PLAN)

    # embed → layers → head: what a pipeline cuts at its layers (Pipeline(layers="layers"))
    def pipeline_embed(self, ids):
        return self.embed(ids)

    def pipeline_head(self, x):
        return self.lm_head(self.norm(x))

    def forward(self, ids):
        x = self.pipeline_embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.pipeline_head(x)


class PositionedLlama(Llama):
    """The same model, told its tokens' positions (`position_ids`, one row for every sequence)
    rather than counting them: what context parallelism gives a forward that takes them."""

    def forward(self, ids, position_ids=None):
        positions = None if position_ids is None else position_ids[0]
        x = self.pipeline_embed(ids)
        for layer in self.layers:
            x = layer(x, positions)
        return self.pipeline_head(x)


def llama(seed: int = 0, dtype=torch.float64, positioned: bool = False, **kwargs) -> Llama:
    torch.manual_seed(seed)
    return (PositionedLlama if positioned else Llama)(**kwargs).to(dtype)


def token_batches(steps: int, batch: int, seq: int = 8, vocab: int = 64, seed: int = 1):
    """(ids, next-token targets) for each step, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (steps, batch, seq + 1), generator=g)
    return [(x[:, :-1], x[:, 1:]) for x in ids]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
