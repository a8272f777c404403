"""paratrain.distributed.comm on real gloo ranks: the helpers against values derived from rank numbers, the
ring all-reduce against dist.all_reduce, and the differentiable all-gather against one process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.components.metrics import mean_metrics
from paratrain.distributed import comm
from paratrain.distributed.ring import ring_all_reduce
from paratrain.errors import ConfigError, UsageError
from paratrain.testing import run_on_ranks

# (shape, dtype, transposed): sizes not divisible by the world, both float widths, 2-D, strided
RING_CASES = [((1,), torch.float32, False), ((7,), torch.float32, False), ((7,), torch.float64, False),
              ((1001,), torch.float32, False), ((1001,), torch.float64, False),
              ((5, 3), torch.float64, False), ((5, 3), torch.float32, True)]


def _ring_job(topo):
    results = []
    for i, (shape, dtype, transposed) in enumerate(RING_CASES):
        g = torch.Generator().manual_seed(1000 * topo.rank + i)
        # integer values: every summation order gives the same floats, so equality is exact
        x = torch.randint(-100, 100, shape, generator=g).to(dtype)
        x = x.t() if transposed else x
        expected, modelled, counter = x.clone(), comm.ByteCounter(), comm.ByteCounter()
        comm.all_reduce(expected, counter=modelled)
        sent = ring_all_reduce(x, counter=counter)
        results.append((x, expected, sent, counter.sent, modelled.sent))
    noisy = torch.randn(1001, generator=torch.Generator().manual_seed(topo.rank))
    reference = noisy.clone()
    dist.all_reduce(reference)
    ring_all_reduce(noisy)
    return results, (noisy, reference), _subgroup_checks(topo)


def _subgroup_checks(topo):
    """Ring and peers inside the group of global ranks 1…N-1, where group rank ≠ global rank."""
    if topo.world_size < 3:
        return None
    group = comm.new_group(list(range(1, topo.world_size)))  # collective: rank 0 creates it too
    if topo.rank == 0:
        return None
    x = torch.arange(10, dtype=torch.float64) * topo.rank
    ring_all_reduce(x, group=group)
    owner = comm.broadcast_object(topo.rank, src=1, group=group)  # group rank 1 = global rank 2
    return x, owner


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_all_reduce_equals_all_reduce_and_sends_the_bandwidth_bound(world):
    per_rank = run_on_ranks(_ring_job, world)
    for rank, (results, (noisy, reference), sub) in enumerate(per_rank):
        for (shape, dtype, _), (x, expected, sent, counted, modelled) in zip(RING_CASES, results):
            assert x.dtype == dtype and torch.equal(x, expected), (rank, shape, dtype)
            chunk_bytes = -(-x.numel() // world) * x.element_size()
            padded_bytes = world * chunk_bytes
            assert sent * world == 2 * (world - 1) * padded_bytes, (rank, shape, dtype, sent)
            assert counted == sent == modelled
        # another summation order than gloo's: measured 4.8e-7 on sums up to 7.2 (one ulp there)
        torch.testing.assert_close(noisy, reference, rtol=1e-6, atol=1e-6)
        if world >= 3 and rank > 0:
            x, owner = sub
            members = range(1, world)
            assert torch.equal(x, torch.arange(10, dtype=torch.float64) * sum(members))
            assert owner == 2


# ---- the differentiable all-gather -----------------------------------------------------------

ROWS, DIM, SEED = 3, 4, 7


def _contrastive(local, everyone, offset):
    """InfoNCE-style: each local row against every gathered row, its own copy the positive."""
    logits = local @ everyone.T / 0.5  # (ROWS, N·ROWS)
    labels = torch.arange(local.shape[0]) + offset
    return F.cross_entropy(logits, labels)  # mean over the local rows


def _wide(local, everyone):
    """A loss over the gather along dim 1: columns of every rank mixed with local ones."""
    return (everyone.tanh().sum(1) * local.sin().sum(1)).mean()


def _inputs(world):
    g = torch.Generator().manual_seed(SEED)
    rows = torch.randn(world * ROWS, DIM, generator=g, dtype=torch.float64)  # (N·ROWS, DIM)
    cols = torch.randn(ROWS, world * DIM, generator=g, dtype=torch.float64)  # (ROWS, N·DIM)
    return rows, cols


def _grad_job(topo):
    rows, cols = _inputs(topo.world_size)
    r = topo.rank
    local_rows = rows[r * ROWS:(r + 1) * ROWS].clone().requires_grad_()
    local_cols = cols[:, r * DIM:(r + 1) * DIM].clone().requires_grad_()
    everyone_rows = comm.all_gather_with_grad(local_rows)
    everyone_cols = comm.all_gather_with_grad(local_cols, dim=1)
    loss = _contrastive(local_rows, everyone_rows, r * ROWS) + _wide(local_cols, everyone_cols)
    loss.backward()
    return everyone_rows.detach(), everyone_cols.detach(), local_rows.grad, local_cols.grad


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_with_grad_matches_one_process_on_the_concatenated_batch(world):
    rows, cols = _inputs(world)
    rows.requires_grad_()
    cols.requires_grad_()
    # One process: the sum over ranks of each rank's loss. Each rank's local gradient must be the
    # slice of this (DDP's averaging of parameter gradients then turns the sum into the mean).
    total = sum(_contrastive(rows[r * ROWS:(r + 1) * ROWS], rows, r * ROWS)
                + _wide(cols[:, r * DIM:(r + 1) * DIM], cols) for r in range(world))
    grad_rows, grad_cols = torch.autograd.grad(total, (rows, cols))
    for r, (everyone_rows, everyone_cols, g_rows, g_cols) in enumerate(run_on_ranks(_grad_job, world)):
        assert torch.equal(everyone_rows, rows.detach()) and torch.equal(everyone_cols, cols.detach())
        # float64: measured 4.4e-16
        torch.testing.assert_close(g_rows, grad_rows[r * ROWS:(r + 1) * ROWS], rtol=0, atol=1e-12)
        torch.testing.assert_close(g_cols, grad_cols[:, r * DIM:(r + 1) * DIM], rtol=0, atol=1e-12)


# ---- every helper on two ranks -----------------------------------------------------------------

def _helpers_job(topo):
    r, out = topo.rank, {}
    out["broadcast"] = comm.broadcast(torch.full((3,), r + 1.0), src=1)
    out["sum"] = comm.all_reduce(torch.tensor([r + 1.0, 10.0 * r]))
    out["mean"] = comm.all_reduce(torch.tensor([r + 1.0, 10.0 * r]), average=True)
    out["max"] = comm.all_reduce(torch.tensor([r]), op=dist.ReduceOp.MAX)
    out["reduce"] = comm.reduce(torch.tensor([r + 1.0]), dst=1)
    out["all_gather"] = comm.all_gather(torch.tensor([r, r + 0.5]))
    out["all_gather_0d"] = comm.all_gather(torch.tensor(float(r)))
    out["all_gather_cat"] = comm.all_gather_cat(torch.tensor([[r], [10.0 + r]]), dim=1)
    out["gather"] = comm.gather(torch.tensor([r * 2.0]), dst=0)
    chunks = [torch.tensor([100.0, 101.0]), torch.tensor([200.0, 201.0])] if r == 1 else None
    out["scatter"] = comm.scatter(torch.empty(2), chunks, src=1)
    out["reduce_scatter"] = comm.reduce_scatter(torch.arange(4.0) + 10 * r)
    out["reduce_scatter_mean"] = comm.reduce_scatter(torch.arange(4.0) + 10 * r, average=True)
    metrics = {"loss": float(r), "acc": torch.tensor(r * 0.5)}
    out["metrics"] = mean_metrics(metrics if r == 0 else dict(reversed(metrics.items())))
    out["metric"] = mean_metrics(r + 1.0)
    for theirs in ({"loss": 1.0, "grad_norm": 2.0}, {"loss": 1.0}):  # as many names as rank 0's, or fewer
        try:
            mean_metrics({"loss": 3.0, "acc": 0.5} if r == 0 else theirs)
        except UsageError as e:
            out.setdefault("other_names", []).append(str(e))
    out["object"] = comm.broadcast_object({"from": r, "items": [r] * 3}, src=1)
    out.update(_p2p(r))
    out["counters"] = _counters()
    comm.barrier()
    try:
        comm.new_group([0, 0])
    except ConfigError as e:
        out["bad_group"] = str(e)
    return out


def _p2p(r):
    """Rank 0 sends with send, rank 1 answers (doubled) with isend; irecv/recv take them."""
    if r == 0:
        sent = comm.send(torch.tensor([3.0, 4.0]), dst=1)
        reply = torch.empty(2)
        comm.irecv(reply, src=1).wait()
        return {"sent": sent, "got": reply}
    got = comm.recv(torch.empty(2), src=0)
    comm.isend(got * 2, dst=0).wait()
    return {"got": got}


def _counters():
    counters = {name: comm.ByteCounter() for name in ("all_reduce", "reduce_scatter", "all_gather")}
    comm.all_reduce(torch.zeros(1001), counter=counters["all_reduce"])
    comm.reduce_scatter(torch.zeros(6, 5), counter=counters["reduce_scatter"])
    comm.all_gather(torch.zeros(3, 5), counter=counters["all_gather"])
    return {name: c.sent for name, c in counters.items()}


def test_helpers_on_two_ranks():
    r0, r1 = run_on_ranks(_helpers_job, 2)
    for rank, out in enumerate((r0, r1)):
        assert out["broadcast"].tolist() == [2.0, 2.0, 2.0]
        assert out["sum"].tolist() == [3.0, 10.0] and out["mean"].tolist() == [1.5, 5.0]
        assert out["max"].tolist() == [1]
        assert [t.tolist() for t in out["all_gather"]] == [[0.0, 0.5], [1.0, 1.5]]
        assert [t.tolist() for t in out["all_gather_0d"]] == [0.0, 1.0]
        assert out["all_gather_cat"].tolist() == [[0.0, 1.0], [10.0, 11.0]]
        assert out["scatter"].tolist() == [[100.0, 101.0], [200.0, 201.0]][rank]
        assert out["reduce_scatter"].tolist() == [[10.0, 12.0], [14.0, 16.0]][rank]
        assert out["reduce_scatter_mean"].tolist() == [[5.0, 6.0], [7.0, 8.0]][rank]
        assert out["metrics"] == {"loss": 0.5, "acc": 0.25} and out["metric"] == 1.5
        assert len(out["other_names"]) == 2  # averaged by position before: acc mixed with grad_norm
        assert "rank 0: acc, loss; rank 1: grad_norm, loss" in out["other_names"][0]
        assert "rank 0: acc, loss; rank 1: loss" in out["other_names"][1]
        assert out["object"] == {"from": 1, "items": [1, 1, 1]}
        # ring bytes with N = 2: all-reduce 2·(N-1)/N·size, reduce-scatter and all-gather (N-1)/N
        assert out["counters"] == {"all_reduce": 2 * 501 * 4, "reduce_scatter": 15 * 4,
                                   "all_gather": 15 * 4}
        assert "distinct ranks" in out["bad_group"]
    assert r1["reduce"].tolist() == [3.0]
    assert [t.tolist() for t in r0["gather"]] == [[0.0], [2.0]] and r1["gather"] is None
    assert r0["sent"] == 8 and r1["got"].tolist() == [3.0, 4.0] and r0["got"].tolist() == [6.0, 8.0]


def test_average_needs_a_float_sum():
    # checked before any communication, so no process group is needed
    with pytest.raises(UsageError, match="floating-point"):
        comm.all_reduce(torch.tensor([1, 2]), average=True)
    with pytest.raises(UsageError, match="averages a SUM"):
        comm.all_reduce(torch.tensor([1.0]), op=dist.ReduceOp.MAX, average=True)


def _broadcast_job(topo):
    """Rank 0's values of tensors of two dtypes, broadcast in buckets of 64 bytes: each message's
    elements, and nothing sent on a group of this rank alone."""
    from tests.support.collectives import counting_collectives

    topo.init(timeout=60)
    me = dist.get_rank()
    tensors = [torch.full((n,), float(me), dtype=torch.float32) for n in (4, 4, 8, 40, 2)]
    tensors += [torch.full((3,), me, dtype=torch.int64), torch.full((10,), me, dtype=torch.int64)]
    with counting_collectives() as calls:
        comm.broadcast_coalesced(tensors, bucket_bytes=64)
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    with counting_collectives() as none:
        comm.broadcast_coalesced([torch.ones(3)], groups[me])
    return [t.tolist() for t in tensors], calls, none


def test_broadcast_coalesced_sends_rank_0s_values_in_bounded_buckets():
    for values, calls, none in run_on_ranks(_broadcast_job, 2):
        assert all(v == 0 for t in values for v in t)
        # float32: 4 + 4 + 8 (64 bytes), then 40 alone (larger than a bucket), then 2; int64: 3, then 10
        assert calls == [("broadcast", 16), ("broadcast", 40), ("broadcast", 2), ("broadcast", 3), ("broadcast", 10)]
        assert none == []
