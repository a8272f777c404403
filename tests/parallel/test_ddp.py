"""Our DDP on real ranks against single-process training and against torch's DDP."""

import copy
import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import paratrain as pt
from paratrain.distributed.grid import new_group
from paratrain.parallel.buckets import AllReduce
from paratrain.testing import RankFailure, assert_same_params, run_on_ranks
from tests.support.models import make_batches, make_model, make_optimizer, reference, train_on_rank

STEPS, GLOBAL_BATCH = 4, 16
FIND_UNUSED = {"unused", "sometimes"}


def _train_on_rank(topo, name, impl, accumulate, optim):
    """Train `impl` ("ours" or "torch") for STEPS steps on this rank's share of each batch."""
    wrap = pt.DistributedDataParallel if impl == "ours" else torch.nn.parallel.DistributedDataParallel
    # tiny buckets: many all-reduces, filled out of order, must still match torch's DDP
    ddp = wrap(make_model(name), find_unused_parameters=name in FIND_UNUSED, bucket_cap_mb=0.0005)
    train_on_rank(topo, ddp, make_optimizer(optim, ddp.parameters()), steps=STEPS,
                  global_batch=GLOBAL_BATCH, accumulate=accumulate)
    return ddp.module.state_dict()


def _both(topo, name, accumulate, optim):
    return (_train_on_rank(topo, name, "ours", accumulate, optim),
            _train_on_rank(topo, name, "torch", accumulate, optim))


CASES = [(name, world, 1, "sgd") for name in ("mlp", "bn", "dropout", "tied", "unused")
         for world in (1, 2, 4)]
CASES += [("mlp", 2, 4, "sgd"), ("bn", 2, 2, "sgd"), ("mlp", 2, 1, "adam"), ("tied", 4, 2, "adam"),
          ("sometimes", 2, 1, "sgd"), ("sometimes", 4, 1, "sgd"), ("sometimes", 2, 4, "sgd")]


@pytest.mark.parametrize("name,world,accumulate,optim", CASES)
def test_ddp_matches_single_process_and_torch_ddp(name, world, accumulate, optim):
    if GLOBAL_BATCH % (world * accumulate):
        pytest.fail("test setup: global batch must split evenly")
    ref = reference(name, optim, world=world, accumulate=accumulate, steps=STEPS, global_batch=GLOBAL_BATCH)
    for ours, theirs in run_on_ranks(_both, world, name, accumulate, optim):  # every rank
        assert_same_params({k: ours[k] for k in ref}, ref, atol=1e-6)  # measured: at most 1.2e-7
        # bitwise: torch's bucket layout and 1/N scaling give the same sums (buffers included)
        assert_same_params(ours, theirs, atol=0)


def _replicas_agree(topo):
    model = make_model("bn", seed=topo.rank)  # every rank starts different
    ddp = pt.DistributedDataParallel(model)
    state = copy.deepcopy(ddp.state_dict())
    xs, ys = make_batches(1, 8, seed=topo.rank)  # and sees different data
    own = make_model("bn", seed=0)  # rank 0's model, which DDP broadcast, unwrapped
    F.cross_entropy(own(xs[0]), ys[0]).backward()
    F.cross_entropy(ddp(xs[0]), ys[0]).backward()
    return (state, {n: p.grad.clone() for n, p in ddp.module.named_parameters()},
            {n: p.grad for n, p in own.named_parameters()})


def test_rank_zero_state_is_broadcast_and_gradients_averaged():
    (s0, g0, own0), (s1, g1, own1) = run_on_ranks(_replicas_agree, 2)
    assert_same_params(s0, s1, atol=0)  # parameters and BatchNorm buffers from rank 0
    for k in g0:
        # the mean of the ranks' own gradients, bit for bit (each is multiplied by 1/2, then the
        # two are summed): a sum, or one rank's gradient, would differ
        assert torch.equal(g0[k], g1[k]) and torch.equal(g0[k], own0[k] * 0.5 + own1[k] * 0.5), k
        assert not torch.equal(own0[k], own1[k])  # so the average is not any one rank's


def _keys_and_views(topo):
    model = make_model("mlp")
    ours = pt.DistributedDataParallel(model)
    theirs = torch.nn.parallel.DistributedDataParallel(make_model("mlp"))
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    x, y = make_batches(1, 4)
    for _ in range(2):  # zero_grad(set_to_none=True) between steps drops the views; they return
        F.cross_entropy(ours(x[0]), y[0]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    F.cross_entropy(ours(x[0]), y[0]).backward()
    views = []
    for bucket in ours._buckets.buckets:
        lo = bucket.buffer.data_ptr()
        hi = lo + bucket.buffer.numel() * bucket.buffer.element_size()
        views += [lo <= p.grad.data_ptr() < hi for p in bucket.params]
    return list(ours.state_dict()), list(theirs.state_dict()), views


def test_state_dict_keys_match_torch_and_grads_are_bucket_views():
    ours, theirs, views = run_on_ranks(_keys_and_views, 2)[0]
    assert ours == theirs and ours[0].startswith("module.")
    assert views and all(views)


def _unused_without_flag(topo):
    ddp = pt.DistributedDataParallel(make_model("unused"))
    x, y = make_batches(1, 4)
    F.cross_entropy(ddp(x[0]), y[0]).backward()


def test_unused_parameter_without_find_unused_names_it():
    with pytest.raises(RankFailure, match=r"spare\.weight(.|\n)*find_unused_parameters=True"):
        run_on_ranks(_unused_without_flag, 2, timeout=60, collective_timeout=10)


def _different_models(topo):
    pt.DistributedDataParallel(make_model("mlp" if topo.rank == 0 else "tied"))


def test_different_models_on_ranks_is_a_config_error():
    with pytest.raises(RankFailure, match="different parameter shapes"):
        run_on_ranks(_different_models, 2, timeout=60)


def _torch_arguments(topo):
    model = make_model("mlp")
    ddp = pt.DistributedDataParallel(
        model, device_ids=None, output_device=None, dim=0, broadcast_buffers=True, init_sync=True,
        process_group=dist.group.WORLD, bucket_cap_mb=1, find_unused_parameters=False,
        check_reduction=False, gradient_as_bucket_view=True, static_graph=False)
    return ddp.module is model


def test_accepts_torch_constructor_arguments():
    assert run_on_ranks(_torch_arguments, 2) == [True, True]


def test_needs_an_initialised_group():
    with pytest.raises(pt.UsageError, match="Topology.from_env"):
        pt.DistributedDataParallel(make_model("mlp"))


def _no_grad_forward_between(topo):
    ddp = pt.DistributedDataParallel(make_model("mlp"))
    xs, ys = make_batches(1, 8)
    x, y = xs[0].chunk(2)[topo.rank], ys[0].chunk(2)[topo.rank]
    loss = F.cross_entropy(ddp(x), y)
    with torch.no_grad():
        ddp(x)  # evaluation between forward and backward must not change how backward syncs
    loss.backward()
    return [p.grad.clone() for p in ddp.parameters()]


def test_a_no_grad_forward_does_not_disturb_the_pending_backward():
    g0, g1 = run_on_ranks(_no_grad_forward_between, 2)
    model = make_model("mlp")
    xs, ys = make_batches(1, 8)
    F.cross_entropy(model(xs[0]), ys[0]).backward()
    for a, b, ref in zip(g0, g1, model.parameters()):
        assert torch.equal(a, b) and torch.allclose(a, ref.grad, rtol=0, atol=1e-6)  # measured: 1.5e-8


def _odd_world(topo, impl, find_unused, bucket_cap_mb):
    """Five steps of a plain MLP, with the bucket caps given (None: torch's defaults)."""
    wrap = pt.DistributedDataParallel if impl == "ours" else torch.nn.parallel.DistributedDataParallel
    ddp = wrap(make_model("mlp"), find_unused_parameters=find_unused, bucket_cap_mb=bucket_cap_mb)
    train_on_rank(topo, ddp, make_optimizer("sgd", ddp.parameters()), steps=5, global_batch=30)
    return ddp.module.state_dict()


def _odd_world_both(topo, find_unused, bucket_cap_mb):
    return [_odd_world(topo, impl, find_unused, bucket_cap_mb) for impl in ("ours", "torch")]


@pytest.mark.parametrize("world", [3, 5])
@pytest.mark.parametrize("find_unused,bucket_cap_mb", [(False, None), (False, 0.0005), (True, 0.0005)])
def test_bitwise_equal_to_torch_ddp_at_world_sizes_that_are_not_powers_of_two(world, find_unused, bucket_cap_mb):
    # 1/N is inexact at N = 3 and 5: only the same scaling (a multiplication by 1/N) and the same
    # bucket layout (torch's first layout, then rebuilt in arrival order after the first step,
    # which decides the ring chunk and so the summation order of every element) give equal bits
    for ours, theirs in run_on_ranks(_odd_world_both, world, find_unused, bucket_cap_mb):
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), f"{key}: {(ours[key] - theirs[key]).abs().max()}"


# -- a data-parallel group smaller than the world ---------------------------------------------------

def _on_two_groups(topo):
    """World 4 as two data-parallel groups, {0, 1} and {2, 3}, each on its own data: DDP and every
    ZeRO stage given `process_group=` this rank's group. SGD: Adam would hide a wrong scale."""
    groups = [new_group([0, 1]), new_group([2, 3])]  # collective: every rank creates both
    index, member = divmod(topo.rank, 2)
    xs, ys = make_batches(STEPS, GLOBAL_BATCH, seed=10 + index)
    states = {}
    for kind in ("ddp", 1, 2, 3):
        model = make_model("mlp")
        opt = make_optimizer("sgd", model.parameters())
        if kind == "ddp":
            model = pt.DistributedDataParallel(model, process_group=groups[index], bucket_cap_mb=0.0005)
        else:
            model, opt = pt.shard(model, opt, stage=kind, process_group=groups[index], bucket_cap_mb=0.0005)
        for x, y in zip(xs, ys):
            F.cross_entropy(model(x.chunk(2)[member]), y.chunk(2)[member]).backward()
            opt.step()
            opt.zero_grad()
        states[kind] = pt.full_state_dict(model)
    return index, states


def test_a_process_group_smaller_than_the_world_averages_over_that_group():
    """Each group equals one process on that group's data; averaging over the world's 4 ranks
    instead of the group's 2 would halve every gradient."""
    for index, states in run_on_ranks(_on_two_groups, 4):
        ref = reference("mlp", "sgd", world=2, accumulate=1, steps=STEPS, global_batch=GLOBAL_BATCH,
                        data_seed=10 + index)
        for kind, state in states.items():
            assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)  # measured: at most 3.0e-8


# -- overlap: a full bucket's all-reduce starts while backward still runs --------------------------

class _Logged(AllReduce):
    """DDP's all-reduce, noting in `log` when each bucket's reduction starts."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def start(self, bucket):
        self.log.append(f"start bucket {bucket.index}")
        super().start(bucket)


def _launch_order(topo):
    log: list[str] = []
    ddp = pt.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=0.0005, reduction=_Logged(log))
    # the gradient of the first layer's output is computed after the later layers' parameter
    # gradients and before the first layer's own: a point in the middle of backward
    def note_middle(module, args, out):
        out.register_hook(lambda grad: log.append("first layer's output gradient"))

    ddp.module.net[0].register_forward_hook(note_middle)
    xs, ys = make_batches(2, 8)
    for x, y in zip(xs, ys):  # the second backward runs on the buckets rebuilt in arrival order
        log.clear()
        F.cross_entropy(ddp(x.chunk(2)[topo.rank]), y.chunk(2)[topo.rank]).backward()
        log.append("backward returned")
    return log, len(ddp._buckets.buckets)


def test_a_full_bucket_starts_its_all_reduce_while_backward_continues():
    for log, buckets in run_on_ranks(_launch_order, 2):
        middle = log.index("first layer's output gradient")
        # the buckets of the two later layers have launched by then; the first layer's bucket
        # launches once its gradients exist, still inside backward
        assert log[:middle] == ["start bucket 0", "start bucket 1"], log
        assert log[middle + 1:] == [f"start bucket {i}" for i in range(2, buckets)] + ["backward returned"]


def _rebuilt_in_rank_0s_order(topo):
    model = make_model("branches")
    model.swap = topo.rank == 1  # rank 1's gradients arrive in another order than rank 0's
    ddp = pt.DistributedDataParallel(model, bucket_cap_mb=0.0002)  # one bucket per weight or bias
    train_on_rank(topo, ddp, make_optimizer("sgd", ddp.parameters()), steps=STEPS, global_batch=GLOBAL_BATCH)
    names = {p: n for n, p in model.named_parameters()}
    return [[names[p] for p in bucket.params] for bucket in ddp._buckets.buckets], model.state_dict()


def test_buckets_are_rebuilt_in_rank_0s_arrival_order_on_every_rank():
    """Ranks must launch the same buckets: a rank laying them out in its own arrival order would
    add its `a` gradients to rank 0's `b` gradients."""
    (layout0, state0), (layout1, state1) = run_on_ranks(_rebuilt_in_rank_0s_order, 2)
    assert layout0 == layout1 and len(layout0) > 1
    assert layout0[0][0].startswith("b.")  # rank 0 computed `b` last: its gradients came first
    ref = reference("branches", "sgd", world=2, accumulate=1, steps=STEPS, global_batch=GLOBAL_BATCH)
    for state in (state0, state1):
        assert_same_params(state, ref, atol=1e-6)  # measured: 3.0e-8


def _rebuild_memory(topo, zero_grad: bool):
    """The first backward's single bucket (torch's layout before its rebuild), then the rebuild
    at the next forward: the old layout's memory is freed before the new one is allocated when
    no gradient needs carrying over; with gradients kept, they move into the new layout."""
    import weakref

    ddp = pt.DistributedDataParallel(make_model("mlp"), bucket_cap_mb=0.0005)
    xs, ys = make_batches(2, 8)
    F.cross_entropy(ddp(xs[0]), ys[0]).backward()
    kept = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
    if zero_grad:
        ddp.zero_grad(set_to_none=True)
    # gloo's worker thread keeps the finished all-reduce's Work, and with it the bucket, until it
    # takes its next job: let it go first, or the weakref below sees gloo's hold, not the rebuild's
    time.sleep(0.5)
    old = ddp._buckets.buckets[0].buffer
    first = (len(ddp._buckets.buckets), old.numel())
    old, freed = weakref.ref(old), []
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):  # each new bucket buffer: was the old layout freed by then?
        freed.append(old() is None)
        return real_zeros(*args, **kwargs)

    torch.zeros = zeros
    try:
        with ddp.no_sync():
            out = ddp(xs[1])  # the forward that rebuilds
    finally:
        torch.zeros = real_zeros
    sizes = [b.buffer.numel() for b in ddp._buckets.buckets]
    carried = all(torch.equal(p.grad, kept[n]) for n, p in ddp.module.named_parameters()) if not zero_grad else None
    return first, len(sizes), freed, carried, out.shape


@pytest.mark.parametrize("zero_grad", [True, False])
def test_the_rebuild_frees_the_first_layout_before_building_when_no_gradient_is_held(zero_grad):
    (first, rebuilt, freed, carried, _), = run_on_ranks(_rebuild_memory, 1, zero_grad)
    params = sum(p.numel() for p in make_model("mlp").parameters())
    assert first == (1, params) and rebuilt > 1  # one bucket for all, then caps of 0.0005 MiB
    if zero_grad:
        assert freed and all(freed)  # never both layouts at once
    else:
        assert carried  # the accumulated gradients moved into the new buckets


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor


class _Returns(torch.nn.Module):
    """The unused model, its logits returned in a dataclass (`dataclass`), or with an auxiliary
    loss kept on the module that the training loop adds (`aux`): the output does not reach it."""

    def __init__(self, how):
        super().__init__()
        self.how, self.inner, self.aux_head = how, make_model("unused"), torch.nn.Linear(12, 1)

    def forward(self, x):
        if self.how == "aux":
            self.aux = self.aux_head(x).pow(2).mean()
            return self.inner(x)
        return _Output(self.inner(x))


def _find_unused_output(topo, how):
    torch.manual_seed(0)
    ddp = pt.DistributedDataParallel(_Returns(how), find_unused_parameters=True)
    opt = make_optimizer("sgd", ddp.parameters())
    xs, ys = make_batches(STEPS, 12)
    for x, y in zip(xs, ys):
        out = ddp(x.chunk(topo.world_size)[topo.rank])
        loss = F.cross_entropy(out.logits if how == "dataclass" else out, y.chunk(topo.world_size)[topo.rank])
        (loss + ddp.module.aux if how == "aux" else loss).backward()
        opt.step()
        opt.zero_grad()
    return ddp.module.state_dict()


def test_find_unused_follows_a_dataclass_output_and_names_a_parameter_reached_another_way():
    """A dataclass's tensors count as the output (torch's DDP looks inside them too); a parameter
    the loss reaches other than through the output got a zero gradient sent for it before: the
    rank stops, naming it, where it trained on with the ranks' models drifting apart."""
    torch.manual_seed(0)
    model = _Returns("dataclass")
    opt = make_optimizer("sgd", model.parameters())
    for x, y in zip(*make_batches(STEPS, 12)):
        F.cross_entropy(model(x).logits, y).backward()
        opt.step()
        opt.zero_grad()
    for state in run_on_ranks(_find_unused_output, 3, "dataclass"):
        assert_same_params(state, model.state_dict(), atol=1e-6)
    with pytest.raises(RankFailure, match=r"aux_head\.(weight|bias) got a gradient in a backward for which "
                                          r"find_unused_parameters=True had counted it as unused"):
        run_on_ranks(_find_unused_output, 2, "aux", timeout=60, collective_timeout=10)


def _sparse_embedding(topo, how):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    if how == "ddp":
        pt.DistributedDataParallel(model)
    else:
        pt.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2)


@pytest.mark.parametrize("how", ["ddp", "zero2"])
def test_a_sparse_embedding_is_named_before_training(how):
    """Its sparse gradient cannot enter a dense bucket: a raw RuntimeError in the middle of the
    first backward before, now an error at wrapping that names the module and what to do."""
    with pytest.raises(RankFailure, match=r"0 gives sparse gradients \(sparse=True\).*sparse=False, or use ZeRO stage 3"):
        run_on_ranks(_sparse_embedding, 1, how, timeout=60)
