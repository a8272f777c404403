"""The chain model and data of the pipeline and model-parallel tests: an nn.Sequential that cuts
into 2, 3 or 4 stages, and global batches divisible by 1, 2, 3, 4, 6 and 8 micro-batches."""

import torch
from torch import nn

STEPS, GLOBAL_BATCH = 3, 24


def chain(seed: int = 0) -> nn.Sequential:
    """9 layers: Linear 12→16, then (Tanh, Linear 16→16) × 3, Tanh, Linear 16→5."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(12, 16)]
    for _ in range(3):
        layers += [nn.Tanh(), nn.Linear(16, 16)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(16, 5))


def block_chain(seed: int = 0) -> nn.Sequential:
    """9 layers, each with weights, so it cuts into up to 9 (virtual) stages: (Linear, Tanh)
    blocks 12→16, 16→16 × 7, then Linear 16→5."""
    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(16 if i else 12, 16), nn.Tanh()) for i in range(8)]
    return nn.Sequential(*blocks, nn.Linear(16, 5))


def batches(steps: int = STEPS, batch: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, batch, 12, generator=g), torch.randint(0, 5, (steps, batch), generator=g)


class TinyGPT(nn.Module):
    """A GPT with its head tied to the token embedding, cut at named blocks: it defines
    pipeline_embed and pipeline_head, the protocol of paratrain/parallel/pipeline/cut.py."""

    def __init__(self, vocab=11, block=8, width=16, layers=4, heads=2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(block, width) * 0.1)  # a parameter on the path
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight

    def pipeline_embed(self, idx):  # (B, T) → (B, T, C)
        return self.tokens(idx) + self.positions[: idx.shape[1]]

    def pipeline_head(self, x):  # (B, T, C) → (B, T, V)
        return self.head(self.ln(x))

    def forward(self, idx):
        x = self.pipeline_embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.pipeline_head(x)


def tiny_gpt(seed: int = 0, layers: int = 4) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(layers=layers)


def token_batches(steps: int = STEPS, batch: int = GLOBAL_BATCH, vocab: int = 11, block: int = 8):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, (steps, batch, block + 1), generator=g)
    return tokens[..., :-1], tokens[..., 1:]


def next_token_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_gpt_strategy(name: str, stages: int = 2):
    """How the meta-device, load-weights and export tests shard a TinyGPT: zero3 with a unit per
    block, a pipeline cut at its blocks, any other strategy by name."""
    import paratrain as pt

    if name == "zero3":
        return pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(nn.TransformerEncoderLayer,)))
    if name == "pipeline":
        return pt.Pipeline(stages=stages, layers="blocks", microbatches=2)
    return name


def train_one_process(model: nn.Module, steps: int) -> dict:
    """The reference: `steps` SGD steps (momentum 0.9) on token_batches, one process; the state dict."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = token_batches()
    for step in range(steps):
        next_token_loss(model(xs[step]), ys[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()
