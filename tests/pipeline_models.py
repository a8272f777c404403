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


def batches(steps: int = STEPS, batch: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, batch, 12, generator=g), torch.randint(0, 5, (steps, batch), generator=g)
