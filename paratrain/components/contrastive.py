"""Contrastive learning across ranks: gather embeddings with gradients, and the SimCLR loss.

A contrastive loss compares each sample with every other sample of the batch (its negatives).
Under data parallelism each rank holds only its own share of the batch, so a loss computed on
the local rows sees 1/N of the negatives, and the model trains differently from one process on
the whole batch. SimCLR (Chen et al. 2020, "A simple framework for contrastive learning of
visual representations", §2.2 and appendix B.1) therefore gathers the embeddings of all devices
before the loss; CLIP does the same.

`gather_embeddings` gathers every rank's rows (world-wide, or node-wide for hierarchical jobs)
through `comm.all_gather_with_grad`, whose backward sends each rank the sum of the gradients all
ranks' losses gave its rows; DDP's averaging of parameter gradients supplies the 1/N (distributed/comm.py,
`_AllGatherWithGrad`). With every rank's loss the mean over its own rows and equal rows per rank,
the mean of the ranks' losses and the averaged gradients equal one process's on the concatenated
batch (tests/components/test_contrastive.py proves it at world 2 and 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.distributed.comm import all_gather_cat, all_gather_with_grad
from paratrain.distributed.grid import NodeGroups
from paratrain.errors import ConfigError

SCOPES = ("local", "node", "world")


@dataclass(frozen=True)
class Gathered:
    """Rows from several ranks, and where this rank's own rows sit among them."""

    rows: torch.Tensor  # (total, ...) every rank's rows in group-rank order; differentiable
    start: int  # index of this rank's first row in `rows`
    count: int  # rows this rank contributed


def gather_embeddings(x: torch.Tensor, *, scope: str = "world",
                      groups: NodeGroups | None = None) -> Gathered:
    """Every rank's rows of `x` (dim 0) with gradients flowing back to their owners.

    scope: "world" (all ranks), "node" (the ranks of this node; needs `groups`, made once with
        `session.grid.node_groups()` or `paratrain.node_groups(topology)`), or "local" (this rank's rows only, no communication).
    Collective for "world" and "node": every rank of the scope calls it at the same point. Ranks
    may hold different numbers of rows (an uneven last batch): rows are padded for the transfer
    and cut out again.
    """
    if scope not in SCOPES:
        raise ConfigError(f"scope must be one of {SCOPES}; got {scope!r}")
    if scope == "local" or not dist.is_initialized():
        return Gathered(x, 0, x.shape[0])
    if scope == "node" and groups is None:
        raise ConfigError("scope='node' needs the node groups: pass groups=paratrain.node_groups(topology) "
                          "(made once, by every rank, before training)")
    group = groups.intra_node if scope == "node" else None
    return _gather(x, group)


def _gather(x: torch.Tensor, group) -> Gathered:
    counts = all_gather_cat(torch.tensor([x.shape[0]], device=x.device), group).tolist()
    me, most = dist.get_rank(group), max(counts)
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, most - x.shape[0]))  # (most, ...); grads skip the pad
    rows = all_gather_with_grad(padded, group)  # (ranks·most, ...)
    if min(counts) != most:
        keep = torch.cat([torch.arange(r * most, r * most + c, device=x.device)
                          for r, c in enumerate(counts)])
        rows = rows.index_select(0, keep)
    return Gathered(rows, sum(counts[:me]), x.shape[0])


def nt_xent_loss(z1: torch.Tensor, z2: torch.Tensor, *, temperature: float = 0.5,
                 gather: Callable[[torch.Tensor], Gathered] | None = None) -> torch.Tensor:
    """SimCLR's NT-Xent loss (Chen et al. 2020, eq. 1) over this rank's pairs (z1[i], z2[i]).

    z1, z2: (b, d) embeddings of two augmented views of the same b samples.
    gather: how negatives are collected: None for this rank's own batch, or a function such as
        `session.gather_embeddings` / `partial(gather_embeddings, scope="node", groups=g)`.
    Each of the 2b local rows is a query; its positive is the other view of the same sample and
    its negatives are all other 2B-2 rows of the gathered batch (B rows over the scope). Returns
    the mean over the 2b queries.
    """
    gathered = (gather or (lambda z: Gathered(z, 0, z.shape[0])))(torch.cat([z1, z2], dim=1))
    b, d = z1.shape
    keys = F.normalize(torch.cat(gathered.rows.split(d, dim=1)), dim=1)  # (2B, d): view 1, view 2
    total = gathered.rows.shape[0]
    queries = F.normalize(torch.cat([z1, z2]), dim=1)  # (2b, d)
    logits = queries @ keys.T / temperature  # (2b, 2B)
    mine = torch.arange(gathered.start, gathered.start + b, device=z1.device)  # my rows of view 1
    self_index = torch.cat([mine, mine + total])  # where each query sits among the keys
    positive = torch.cat([mine + total, mine])  # the other view of the same sample
    logits = logits.index_put((torch.arange(2 * b, device=z1.device), self_index),
                              torch.tensor(float("-inf"), device=z1.device))
    return F.cross_entropy(logits, positive)
