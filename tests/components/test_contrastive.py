"""Contrastive loss with negatives from every rank: the same loss and gradients as one process
on the concatenated batch; node-wide negatives as one process per node-batch; uneven rows."""

import re
import subprocess
import sys
from functools import partial

import pytest
import torch
from torch import nn

import paratrain as pt
from paratrain.components.contrastive import gather_embeddings, nt_xent_loss
from paratrain.testing import run_on_ranks
from tests.support import ROOT_DIR

GLOBAL_BATCH, TEMPERATURE = 16, 0.3


def encoder() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 8))


def views(seed: int = 1):
    """Two noisy views of the same GLOBAL_BATCH samples: (G, 12) each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(GLOBAL_BATCH, 12, generator=g)
    return x + 0.1 * torch.randn(x.shape, generator=g), x + 0.1 * torch.randn(x.shape, generator=g)


def reference(pieces: int):
    """One process: the loss of each of `pieces` equal slices of the batch (1: the whole batch),
    averaged; its loss and parameter gradients."""
    model = encoder()
    v1, v2 = views()
    losses = [nt_xent_loss(model(a), model(b), temperature=TEMPERATURE)
              for a, b in zip(v1.chunk(pieces), v2.chunk(pieces))]
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _loss_and_grads(topo, scope, groups):
    model = pt.DistributedDataParallel(encoder())
    v1, v2 = (v.chunk(topo.world_size)[topo.rank] for v in views())
    gather = partial(gather_embeddings, scope=scope, groups=groups)
    loss = nt_xent_loss(model(v1), model(v2), temperature=TEMPERATURE, gather=gather)
    loss.backward()
    return pt.mean_metrics(loss.detach()), {n: p.grad.clone() for n, p in model.module.named_parameters()}


def _uneven_gather(topo):
    """Rank r holds r + 2 rows; each rank's loss weighs every gathered row by its own weights."""
    x = torch.arange(topo.rank + 2, dtype=torch.float64).unsqueeze(1).repeat(1, 3) + 10 * topo.rank
    x.requires_grad_(True)
    got = gather_embeddings(x)
    weights = torch.full_like(got.rows, float(topo.rank + 1))
    (got.rows * weights).sum().backward()
    return got.rows.detach(), got.start, got.count, x.grad


def on_ranks(topo):
    groups = pt.node_groups(topo)
    out = {"world": _loss_and_grads(topo, "world", groups)}
    if topo.num_nodes > 1:
        out["node"] = _loss_and_grads(topo, "node", groups)
    return out


@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 2)])
def test_global_negatives_equal_one_process_on_the_whole_batch(world, nodes):
    per_rank = run_on_ranks(on_ranks, world, nodes=nodes)
    scopes = [("world", 1)] + ([("node", nodes)] if nodes > 1 else [])
    for scope, pieces in scopes:
        ref_loss, ref_grads = reference(pieces)
        for rank in per_rank:
            loss, grads = rank[scope]
            assert loss == pytest.approx(ref_loss, abs=1e-6)  # measured: at most 8.9e-8
            for name, grad in ref_grads.items():  # measured: at most 8.9e-8
                assert (grads[name] - grad).abs().max().item() < 1e-6, (scope, name)
    local_loss, _ = reference(world)  # each rank's own batch only: a different objective
    assert abs(local_loss - reference(1)[0]) > 1e-3


@pytest.mark.parametrize("world,nodes", [(2, 1), (4, 2)])
def test_uneven_rows_are_gathered_in_rank_order_and_gradients_return(world, nodes):
    per_rank = run_on_ranks(_uneven_gather, world, nodes=nodes)
    expected = torch.cat([torch.arange(r + 2, dtype=torch.float64).unsqueeze(1).repeat(1, 3) + 10 * r
                          for r in range(world)])
    weight_sum = sum(r + 1 for r in range(world))  # every rank's loss reached every row
    for rank, (rows, start, count, grad) in enumerate(per_rank):
        assert torch.equal(rows, expected)
        assert (start, count) == (sum(r + 2 for r in range(rank)), rank + 2)
        assert torch.equal(grad, torch.full((rank + 2, 3), float(weight_sum), dtype=torch.float64))


def test_local_scope_and_bad_scope_without_a_group():
    x = torch.randn(3, 4)
    assert gather_embeddings(x, scope="local").rows is x
    with pytest.raises(pt.ConfigError, match="scope must be one of"):
        gather_embeddings(x, scope="everywhere")


def test_example_reports_both_settings_through_paratrain_run():
    root = ROOT_DIR
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "examples/contrastive.py", "--epochs", "1",
           "--batch-size", "256"]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    for setting in ("random encoder", "local negatives", "global negatives"):
        line = re.search(rf"^linear-probe accuracy \({setting}.*: (0\.\d+)", done.stdout, re.M)
        assert line and float(line.group(1)) > 0.5, done.stdout
