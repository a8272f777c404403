"""join(): ranks with different numbers of batches, against torch DDP's join() on the same data."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.testing import RankFailure, assert_same_params, run_on_ranks
from tests.parallel.test_ddp_comm_hooks import _hook
from tests.support.models import make_batches, make_model, make_optimizer, piece_seed

GLOBAL_BATCH = 24


def _train_joined(topo, impl, name, counts, divide, hook=None, accumulate=1, throw=False, wrap=None):
    """Rank r trains on its share of the first counts[r] global batches inside join(); returns
    the final state, and what join raised on this rank (throw_on_early_termination) if anything."""
    wrap = wrap or (pt.DistributedDataParallel if impl == "ours" else torch.nn.parallel.DistributedDataParallel)
    ddp = wrap(make_model(name), bucket_cap_mb=0.0005 if hook != "powersgd" else None,
               find_unused_parameters=name == "sometimes")
    if hook:
        ddp.register_comm_hook(*_hook(hook, impl))
    opt = make_optimizer("sgd", ddp.parameters())
    xs, ys = make_batches(max(counts), GLOBAL_BATCH)
    pieces, raised = topo.world_size * accumulate, None
    try:
        with ddp.join(divide_by_initial_world_size=divide, throw_on_early_termination=throw):
            for step in range(counts[topo.rank]):
                for micro in range(accumulate):
                    index = topo.rank * accumulate + micro
                    torch.manual_seed(piece_seed(step, index))
                    with ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                        out = ddp(xs[step].chunk(pieces)[index])
                        (F.cross_entropy(out, ys[step].chunk(pieces)[index]) / accumulate).backward()
                opt.step()
                opt.zero_grad()
    except RuntimeError as error:
        if not throw:
            raise
        raised = str(error)
    return {k: v.clone() for k, v in ddp.module.state_dict().items()}, raised


def _both(topo, *setting, **kwargs):
    return _train_joined(topo, "ours", *setting, **kwargs), _train_joined(topo, "torch", *setting, **kwargs)


def _assert_bitwise(ours, theirs):
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), f"{key}: {(ours[key] - theirs[key]).abs().max()}"


# (model, batches per rank, divide_by_initial_world_size, comm hook, micro-batches per step).
# A rank with 0 batches joins before the first synchronised backward: it must still take part in
# the bucket rebuild (rank 0 with 0 batches: the rebuilt layout is its registration order). "bn"
# broadcasts its buffers from the highest rank still training; "sometimes" all-reduces the
# used-bitmap; the last rank to finish is not always the highest (2, 4, 3).
CASES = [("mlp", (3, 5), True, None, 1), ("mlp", (3, 5), False, None, 1),
         ("mlp", (0, 3), True, None, 1), ("bn", (4, 1), True, None, 1),
         ("mlp", (2, 4, 3), True, None, 1), ("mlp", (2, 4, 3), False, None, 1),
         ("bn", (3, 0, 2), False, None, 1), ("sometimes", (2, 4, 3), True, None, 1),
         ("mlp", (2, 4, 3), True, None, 2), ("mlp", (2, 4, 3), False, "allreduce", 1),
         ("mlp", (3, 1, 4), True, "fp16", 1), ("mlp", (1, 4, 3), True, "powersgd", 1)]


@pytest.mark.parametrize("name,counts,divide,hook,accumulate", CASES)
def test_join_gives_torch_ddp_parameters_bitwise_with_uneven_inputs(name, counts, divide, hook, accumulate):
    results = run_on_ranks(_both, len(counts), name, counts, divide, hook, accumulate)
    for (ours, _), (theirs, _) in results:
        _assert_bitwise(ours, theirs)
    for (ours, _), _ in results[1:]:  # post_hook: every rank ends with the last joiner's model
        _assert_bitwise(ours, results[0][0][0])


def _uneven_changes_the_result(topo):
    """Without join the ranks would hang; with it, divide_by_initial_world_size changes the result."""
    return [_train_joined(topo, "ours", "mlp", (2, 4), divide)[0] for divide in (True, False)]


def test_both_divisions_differ_once_a_rank_has_joined():
    by_n, by_training = run_on_ranks(_uneven_changes_the_result, 2)[0]
    assert any(not torch.equal(by_n[k], by_training[k]) for k in by_n)


def test_throw_on_early_termination_raises_on_every_rank_as_torch_does():
    results = run_on_ranks(_both, 3, "mlp", (2, 4, 3), True, throw=True)
    for rank, ((ours, our_error), (theirs, their_error)) in enumerate(results):
        _assert_bitwise(ours, theirs)
        assert our_error == their_error
        assert our_error == ("Rank 0 exhausted all inputs." if rank == 0 else
                             "Detected at least one rank that exhausted inputs. Throwing across all ranks.")


def _hierarchical(topo, counts):
    def wrap(model, **kwargs):
        return pt.HierarchicalDataParallel(model, groups=pt.node_groups(topo), **kwargs)
    return (_train_joined(topo, "ours", "mlp", counts, True, wrap=wrap)[0],
            _train_joined(topo, "ours", "mlp", counts, True)[0])


def test_join_with_hierarchical_reduction_matches_plain_ddp():
    # the joined rank runs each bucket's three phases on zeros; the sums are the same, their order not
    for hierarchical, flat in run_on_ranks(_hierarchical, 4, (2, 3, 1, 3), nodes=2):
        assert_same_params(hierarchical, flat, atol=1e-6)


def _zero_join(topo):
    model = make_model("mlp")
    model, _ = pt.shard(model, make_optimizer("sgd", model.parameters()), stage=2)
    model.join()


def test_zero_refuses_join():
    with pytest.raises(RankFailure, match="join\\(\\) cannot mirror ZeRO's optimizer step"):
        run_on_ranks(_zero_join, 2, timeout=60)
