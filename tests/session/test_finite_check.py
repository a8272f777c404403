"""The step's finite check (session/step.py): a NaN or inf gradient on any rank, with a finite
loss, stops every rank before the optimizer steps, under each strategy, and costs no collective
where nothing is checked; non-finite parameters are never saved; a loop that catches the error
goes on as if the step had not been there."""

import math

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.parallel.buckets import ReducedSums
from paratrain.testing import max_param_diff, run_on_ranks
from tests.support.models import make_batches, make_model, resumed_mlp_state

XS, YS = make_batches(2, 8, seed=1)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- a NaN gradient with a finite loss ----------------------------------------------------------

def _nan_gradient(topo, strategy, tmp, limit=None):
    """Rank 1's gradient of one weight turns NaN in the second step; the loss stays finite.
    `limit`: ReducedSums.LIMIT for ZeRO (0: each rank sums its slice of each reduction, and the
    slices' sums are all-reduced, whatever the size)."""
    if limit is not None:
        ReducedSums.LIMIT = limit
    hook = strategy.endswith("-fp16-hook")  # DDP's check then reads the buckets at the step
    session = pt.Session(strategy.removesuffix("-fp16-hook"), topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, opt = session.setup(model, _sgd(model))
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        model.register_comm_hook(None, fp16_compress_hook)
    poison = {"on": False}
    if topo.rank == 1:  # NaN enters the first layer's gradients through its output's gradient
        def poisoned(module, args, out):
            if poison["on"]:
                out.register_hook(lambda g: g * float("nan"))
        session.unwrap(model).net[0].register_forward_hook(poisoned)
    return _two_steps_the_second_poisoned(session, topo, poison, checkpoint=tmp)


def _two_steps_the_second_poisoned(session, topo, poison, checkpoint=None):
    """One good step (then a checkpoint, if given), then one with `poison` on: the second step's
    UsageError (or None) and how far the parameters moved in it."""
    x, y = XS[0].chunk(topo.world_size)[topo.rank], YS[0].chunk(topo.world_size)[topo.rank]
    session.train_step((x, y), F.cross_entropy)
    if checkpoint is not None:
        session.checkpoint(checkpoint)  # the good state
    before = {k: v.clone() for k, v in session.full_state_dict().items()}
    poison["on"] = True
    try:
        session.train_step((x, y), F.cross_entropy)
        error = None
    except pt.UsageError as e:
        error = str(e)
    return error, max_param_diff(before, session.full_state_dict())


@pytest.mark.parametrize("strategy, limit", [("ddp", None), ("ddp-fp16-hook", None), ("zero1", None), ("zero2", None),
                                             ("zero3", None), ("zero2", 0), ("zero3", 0)])
def test_a_nan_gradient_stops_every_rank_before_the_step(strategy, limit, tmp_path):
    """ZeRO's small models: each rank sums the whole reductions it saw (ReducedSums); limit 0:
    each its slice of them, the slices' sums all-reduced."""
    for error, moved in run_on_ranks(_nan_gradient, 2, strategy, str(tmp_path), limit, timeout=120):
        assert error is not None and "gradient is NaN or infinite although the loss was finite" in error
        assert moved == 0  # no parameter changed
    restored = run_on_ranks(resumed_mlp_state, 1, str(tmp_path))[0]
    assert all(torch.isfinite(v).all() for v in restored.values())


def _one_nan_element(topo, param, index, limit):
    """Rank 1's gradient of one element (parameter `param`, flat `index`) turns NaN in the
    second step. After DDP's all-reduce the NaN sits at that element on every rank; with a
    model above `limit` (ReducedSums.LIMIT) elements each rank sums only its share of each
    bucket, so exactly one rank sees it, and the others learn it from the flag."""
    ReducedSums.LIMIT = limit
    session = pt.Session("ddp", topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, opt = session.setup(model, _sgd(model))
    poison = {"on": False}
    if topo.rank == 1:
        def poisoned(g):
            if not poison["on"]:
                return g
            g = g.clone()
            g.view(-1)[index] = float("nan")
            return g
        dict(session.unwrap(model).named_parameters())[param].register_hook(poisoned)
    return _two_steps_the_second_poisoned(session, topo, poison)


@pytest.mark.parametrize("world, param, index", [(2, "net.0.weight", 0), (2, "net.4.bias", -1),
                                                 (3, "net.0.weight", 0), (3, "net.2.weight", 500),
                                                 (3, "net.4.bias", -1)])
def test_ddp_sharing_its_check_stops_every_rank_for_a_nan_in_any_ranks_share(world, param, index):
    """Limit 0: each rank sums 1/N of every bucket and one flag is all-reduced: whichever rank's
    share holds the NaN, every rank stops and no parameter moves."""
    for error, moved in run_on_ranks(_one_nan_element, world, param, index, 0, timeout=120):
        assert error is not None and "gradient is NaN or infinite although the loss was finite" in error
        assert moved == 0


def _flag_all_reduces(topo, strategy, limit, nan_check=True):
    """All-reduces of one element (the finite check's flag) in one train_step."""
    ReducedSums.LIMIT = limit
    session = pt.Session(strategy, topology=topo, progress_bar=False, nan_check=nan_check)
    model = make_model("mlp")
    model, _ = session.setup(model, _sgd(model))
    x, y = XS[0].chunk(2)[topo.rank], YS[0].chunk(2)[topo.rank]
    real, flags = torch.distributed.all_reduce, []

    def counting(tensor, *args, **kwargs):
        flags.append(tensor.numel() == 1)
        return real(tensor, *args, **kwargs)

    torch.distributed.all_reduce = counting
    try:
        session.train_step((x, y), F.cross_entropy)
    finally:
        torch.distributed.all_reduce = real
    return sum(flags)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_a_small_zero_model_checks_its_gradients_without_a_collective(strategy):
    """On gloo every rank holds each reduction whole: a model under ReducedSums.LIMIT elements sums
    them instead of all-reducing a sum (bench/session.py's tiny model: that collective was most of
    what the session added); above it, one all-reduce of this rank's sum."""
    assert run_on_ranks(_flag_all_reduces, 2, strategy, ReducedSums.LIMIT) == [0, 0]
    assert run_on_ranks(_flag_all_reduces, 2, strategy, 0) == [1, 1]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_without_the_check_no_reduction_is_summed_and_no_flag_is_sent(strategy):
    """The sums are the session's check's: Session(nan_check=False) and the plain wrappers read no
    reduced gradient and all-reduce no flag (ZeRO summed every reduction for any user, and the
    session without its check all-reduced the sum each step: about 2 ms a step each on the
    bench MLP's zero3)."""
    assert run_on_ranks(_flag_all_reduces, 2, strategy, 0, False) == [0, 0]
    assert run_on_ranks(_plain_wrapper_sums, 2, strategy) == [(0, None)] * 2


def _plain_wrapper_sums(topo, strategy):
    """(ReducedSums.add calls, reduced_finite()) after one backward of the plain wrapper."""
    ReducedSums.LIMIT = 0
    model = make_model("mlp")
    if strategy == "ddp":
        model = pt.DistributedDataParallel(model)
    else:
        model, _ = pt.shard(model, _sgd(model), stage=int(strategy[-1]))
    real, added = ReducedSums.add, []
    ReducedSums.add = lambda self, flat: added.append(flat.numel())
    try:
        x, y = XS[0].chunk(2)[topo.rank], YS[0].chunk(2)[topo.rank]
        F.cross_entropy(model(x), y).backward()
    finally:
        ReducedSums.add = real
    return len(added), model.reduced_finite()


def test_shared_sums_read_only_this_ranks_share_of_each_buffer():
    """tensor_split's slices of 10 over 3 ranks: [0, 4), [4, 7), [7, 10)."""
    flat = torch.zeros(10)
    flat[4] = float("inf")
    for rank, finite in [(0, True), (1, False), (2, True)]:
        sums = ReducedSums(share=(rank, 3, None))
        sums.add(flat)
        sums.add(torch.ones(3))  # a second bucket adds its own share
        assert bool(torch.isfinite(sums.total)) is finite
        assert sums.total.item() == (1.0 if finite else float("inf"))
        sums.reset()
        assert sums.total is None


def test_ddp_checks_a_large_model_by_shares_and_one_all_reduced_sum():
    """DDP under ReducedSums.LIMIT elements sums every bucket whole, with no collective; above it,
    each rank sums its share and the shares' sums are all-reduced once per step."""
    assert run_on_ranks(_flag_all_reduces, 2, "ddp", ReducedSums.LIMIT) == [0, 0]
    assert run_on_ranks(_flag_all_reduces, 2, "ddp", 0) == [1, 1]


def _ddp_check_answer(topo, nan_check, hook, clip=None, limit=None):
    """What DDP's reduced_finite() says after one synchronised backward, checked to be the sum of
    every averaged gradient (None: the step's check would read the buckets again); `hook`: fp16
    compression registered after setup; `limit` 0: each rank sums its share of every bucket and
    the shares' sums are all-reduced."""
    if limit is not None:
        ReducedSums.LIMIT = limit
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
    session = pt.Session("ddp", topology=topo, progress_bar=False, nan_check=nan_check, max_grad_norm=clip)
    model = make_model("mlp")
    model, _ = session.setup(model, _sgd(model))
    if hook:
        model.register_comm_hook(None, fp16_compress_hook)
    x, y = XS[0].chunk(topo.world_size)[topo.rank], YS[0].chunk(topo.world_size)[topo.rank]
    session.backward(F.cross_entropy(model(x), y))
    answer = model.reduced_finite()
    if answer is None:
        return None
    whole = sum(p.grad.double().sum() for p in model.parameters()).item()  # every averaged gradient
    assert math.isclose(answer.item(), whole, rel_tol=1e-4, abs_tol=1e-6), (answer.item(), whole)
    return math.isfinite(answer.item())


def _zero_check_answer(topo, strategy, limit):
    """What ZeRO's reduced_finite() says after one backward: the sum of every averaged gradient
    (the gradients each rank holds, local_grads, summed over their holders); `limit` 0: each rank
    sums its slice of each reduction as it completes, and the slices' sums are all-reduced."""
    ReducedSums.LIMIT = limit
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, _sgd(model))
    x, y = XS[0].chunk(topo.world_size)[topo.rank], YS[0].chunk(topo.world_size)[topo.rank]
    session.backward(F.cross_entropy(model(x), y))
    answer = model.reduced_finite()
    grads, group = model.local_grads()
    held = torch.tensor(sum(g.double().sum().item() for g in grads), dtype=torch.float64)
    if group is not None:
        torch.distributed.all_reduce(held, group=group)
    assert math.isclose(answer.item(), held.item(), rel_tol=1e-4, abs_tol=1e-6), (answer.item(), held.item())
    return model._sums.share is not None if strategy == "zero3" else model._reduction.sums.share is not None


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_zero_sums_its_reductions_whole_or_by_slices_for_the_check(strategy):
    """Under ReducedSums.LIMIT elements every rank sums each reduction whole; above it (limit 0)
    its slice, the slices' sums all-reduced at the step: either way the sum of every gradient."""
    assert run_on_ranks(_zero_check_answer, 3, strategy, ReducedSums.LIMIT) == [False] * 3
    assert run_on_ranks(_zero_check_answer, 3, strategy, 0) == [True] * 3


def test_ddp_sums_its_buckets_for_the_check_only_when_the_session_checks():
    """Session(nan_check=True) has DDP sum each bucket as its all-reduce completes, so the step's
    check reads no gradient again; a plain session (or a plain pt.DDP) pays for no sum, and a
    communication hook reduces its own way (the step's check then reads the buckets: the NaN test
    above covers both paths); with clipping the global norm is the check, so nothing is summed."""
    assert run_on_ranks(_ddp_check_answer, 2, True, False) == [True, True]
    assert run_on_ranks(_ddp_check_answer, 3, True, False, None, 0) == [True, True, True]  # shares
    assert run_on_ranks(_ddp_check_answer, 2, False, False) == [None, None]
    assert run_on_ranks(_ddp_check_answer, 2, True, True) == [None, None]
    assert run_on_ranks(_ddp_check_answer, 2, True, False, 1.0) == [None, None]  # the norm checks


def test_non_finite_parameters_are_never_saved(tmp_path):
    with pt.Session("single", progress_bar=False, nan_check=False) as session:
        model = make_model("mlp")
        model, _ = session.setup(model, _sgd(model))
        session.train_step((XS[0], YS[0]), lambda out, y: F.cross_entropy(out, y) * float("nan"))
        with pytest.raises(pt.CheckpointError, match="not saving .*NaN or infinite values"):
            session.checkpoint(tmp_path)
        assert not list(tmp_path.glob("step-*"))  # (the root's lock is there)


def _nan_backward_dropped(topo, stage):
    """A backward whose gradients turn NaN on rank 1, dropped by optimizer.zero_grad(); then a
    clean backward and the step's checks: the dropped gradients' sums must not stop it."""
    from paratrain.components.accumulation import TokenWeights
    from paratrain.session.step import optimizer_step

    model = make_model("mlp")
    model, opt = pt.shard(model, _sgd(model), stage=stage)
    x, y = XS[0].chunk(2)[topo.rank], YS[0].chunk(2)[topo.rank]
    poison = {"on": topo.rank == 1}

    def poisoned(module, args, out):
        if poison["on"]:
            out.register_hook(lambda g: g * float("nan"))

    model.module.net[0].register_forward_hook(poisoned)
    F.cross_entropy(model(x), y).backward()
    opt.zero_grad()
    poison["on"] = False
    F.cross_entropy(model(x), y).backward()
    result = optimizer_step(model, opt, weights=TokenWeights(), scaler=None, max_grad_norm=None, check_finite=True)
    return result.stepped


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_dropped_by_zero_grad_leave_nothing_for_the_finite_check(stage):
    assert run_on_ranks(_nan_backward_dropped, 2, stage) == [True, True]


# -- a loop that catches an error and goes on --------------------------------------------------------

def _catch_and_go_on(topo, strategy):
    """Four optimizer steps of two micro-batches. Before step 1's first micro-batch, a batch of
    the wrong width raises in the forward; in step 2 rank 1's second micro-batch is NaN, so
    every rank's check stops that step. The loop catches both and goes on: the session must
    train as if step 2 (its gradients dropped) and the bad batch had never been there."""
    session = pt.Session(strategy, topology=topo, accumulate=2, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, _sgd(model))
    xs, ys = make_batches(4, 8, seed=1)
    caught = []
    for step in range(4):
        if step == 1:
            try:
                session.train_step((torch.randn(2, 7), torch.zeros(2, dtype=torch.long)), F.cross_entropy)
            except RuntimeError as error:
                caught.append(type(error).__name__)
        for micro in range(2):
            index = topo.rank * 2 + micro
            x, y = xs[step].chunk(4)[index].clone(), ys[step].chunk(4)[index]
            if step == 2 and micro == 1 and topo.rank == 1:
                x[0, 0] = float("nan")
            try:
                session.train_step((x, y), F.cross_entropy)
            except pt.UsageError as error:
                caught.append(str(error)[:40])
    state = session.full_state_dict()
    session.close()
    return caught, state


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_loop_that_catches_a_bad_batch_goes_on_as_if_it_were_not_there(strategy):
    ranks = run_on_ranks(_catch_and_go_on, 2, strategy)
    model = make_model("mlp")
    opt = _sgd(model)
    xs, ys = make_batches(4, 8, seed=1)
    for step in (0, 1, 3):
        F.cross_entropy(model(xs[step]), ys[step]).backward()
        opt.step()
        opt.zero_grad()
    expected = {k: v.detach() for k, v in model.named_parameters()}
    for rank, (caught, state) in enumerate(ranks):
        assert caught[0] == "RuntimeError" and len(caught) == 2
        assert caught[1].startswith("the loss is nan" if rank == 1 else "a gradient is NaN")
        assert max_param_diff({k.removeprefix("module."): v for k, v in state.items()}, expected) < 1e-6
