"""Mistakes and faults that could pass silently: each case either works or stops with a paratrain
error naming the cause."""

import functools
import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.parallel.buckets import ReducedSums
from paratrain.testing import RankFailure, max_param_diff, run_on_ranks
from tests.support.models import make_batches, make_model
from tests.support.pipeline_models import chain

XS, YS = make_batches(2, 8, seed=1)


def _dataset(n=48):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g))


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# -- 9: a NaN gradient with a finite loss ----------------------------------------------------------

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
    restored = run_on_ranks(_load_newest, 1, str(tmp_path))[0]
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


def _load_newest(topo, tmp):
    session = pt.Session("single", topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, _sgd(model))
    assert session.resume(tmp)
    return session.full_state_dict()


def test_non_finite_parameters_are_never_saved(tmp_path):
    with pt.Session("single", progress_bar=False, nan_check=False) as session:
        model = make_model("mlp")
        model, _ = session.setup(model, _sgd(model))
        session.train_step((XS[0], YS[0]), lambda out, y: F.cross_entropy(out, y) * float("nan"))
        with pytest.raises(pt.CheckpointError, match="not saving .*NaN or infinite values"):
            session.checkpoint(tmp_path)
        assert not list(tmp_path.glob("step-*"))  # (the root's lock is there)


# -- 10: stepping the optimizer given to setup, not the one it returned -------------------------------

def _old_optimizer(topo, strategy):
    session = pt.Session(pt.Pipeline(stages=2, microbatches=2) if strategy == "pipeline" else strategy,
                         topology=topo, progress_bar=False)
    model = make_model("mlp").net if strategy == "pipeline" else make_model("mlp")
    old = _sgd(model)
    model, new = session.setup(model, old)
    for group in old.param_groups:  # an lr change through the old one reaches the new one
        group["lr"] = 0.05
    lrs = [g["lr"] for g in new.param_groups]
    session.train_step((XS[0], YS[0]) if strategy == "pipeline" else (XS[0][:4], YS[0][:4]), F.cross_entropy)
    try:
        old.step()
        return lrs, None
    except pt.UsageError as e:
        return lrs, str(e)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "pipeline"])
def test_stepping_the_replaced_optimizer_is_refused(strategy):
    for lrs, error in run_on_ranks(_old_optimizer, 2, strategy):
        assert lrs and set(lrs) == {0.05}
        assert error is not None and ("step the optimizer setup() returned" in error
                                      or "use the optimizer that" in error)


# -- 11, 12: the step's contract ---------------------------------------------------------------------

def test_several_accumulation_blocks_before_one_step_are_refused():
    with pt.Session("single", accumulate=2, progress_bar=False) as session:
        model = make_model("mlp")
        model, _ = session.setup(model, _sgd(model))
        with session.accumulation():
            session.backward(F.cross_entropy(model(XS[0]), YS[0]))
        with pytest.raises(pt.UsageError, match="entered again before session.step"):
            with session.accumulation():
                pass


@pytest.mark.parametrize("loss_fn,message", [
    (lambda out, y: None, "returned None: a model called without labels"),
    (lambda out, y: F.cross_entropy(out, y, reduction="none"), r"returned \(8,\), not a scalar"),
])
def test_a_loss_function_that_returns_no_scalar_is_named(loss_fn, message):
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, _ = session.setup(model, _sgd(model))
        with pytest.raises(pt.UsageError, match=message):
            session.train_step((XS[0], YS[0]), loss_fn)


# -- 14, 15: per-rank randomness, the size of a sharded model ------------------------------------------

def _seeds_and_sizes(topo):
    session = pt.Session("zero3", topology=topo, progress_bar=False)
    model = make_model("mlp")
    expected = sum(p.numel() for p in model.parameters())
    model, _ = session.setup(model, _sgd(model))
    session.train_step((XS[0][:4], YS[0][:4]), F.cross_entropy)
    return session.rank_seed, session.num_parameters(), session.num_parameters(trainable_only=True), expected


def test_rank_seeds_differ_and_parameter_counts_are_whole_under_zero3():
    results = run_on_ranks(_seeds_and_sizes, 2)
    assert results[0][0] != results[1][0]
    for _, total, trainable, expected in results:
        assert total == trainable == expected


# -- 8: the data position counts batches trained on ---------------------------------------------------

def _prefetching_loop(topo, tmp, stop_after, accumulate, workers):
    """nanoGPT's habit: the next batch is fetched before this one's step. Checkpoint after
    `stop_after` micro-batches (None: run through), then resume from `tmp` in a new session."""
    states = []
    for attempt in ("first", "resumed") if stop_after is not None else ("only",):
        session = pt.Session("ddp", topology=topo, progress_bar=False, accumulate=accumulate, seed=5)
        model = make_model("dropout")
        loader = DataLoader(_dataset(), batch_size=4, shuffle=True, num_workers=workers)
        model, opt, loader = session.setup(model, _sgd(model), loader)
        if attempt == "resumed":
            assert session.resume(tmp)
        for epoch in range(session.epoch, 2):
            batches = iter(session.progress(loader))
            batch = next(batches, None)
            while batch is not None:
                upcoming = next(batches, None)  # fetched ahead of the step
                session.train_step(batch, F.cross_entropy)
                if attempt == "first" and session.micro_step == stop_after:
                    session.checkpoint(tmp)
                    break
                batch = upcoming
            else:
                continue
            break
        states.append(session.full_state_dict())  # (both sessions share the process group)
    return states[-1]


@pytest.mark.parametrize("stop_after,accumulate,workers", [(5, 1, 0), (5, 2, 0), (7, 3, 0)])
def test_a_prefetching_loop_resumes_on_the_batch_after_the_last_trained(tmp_path, stop_after, accumulate, workers):
    """(5, 2) and (7, 3): checkpointed mid-accumulation, the window is trained again from its
    start. (Loader workers cannot start inside run_on_ranks' daemonic ranks.)"""
    whole = run_on_ranks(_prefetching_loop, 2, str(tmp_path / "a"), None, accumulate, workers)
    resumed = run_on_ranks(_prefetching_loop, 2, str(tmp_path / "b"), stop_after, accumulate, workers)
    for a, b in itertools.product(whole, resumed):
        assert max_param_diff(a, b) == 0


# -- 13: torch.compile ------------------------------------------------------------------------------

def _compiled(topo, strategy, when, tmp, backend):
    """Train 3 steps with the model compiled before or after setup (dynamo's "eager" backend: the
    tracing is real, no C++ compiler needed; "inductor" also generates and compiles C++ kernels),
    checkpoint and export, and return what a user sees, and whether setup warned of an eager forward."""
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    if when == "before":
        model = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = session.setup(model, _sgd(model))
    warned = any("trains a torch.compile'd model correctly but uncompiled" in str(w.message) for w in caught)
    if when == "after":
        model = torch.compile(model, backend=backend)
    xs, ys = make_batches(3, 8)
    for x, y in zip(xs, ys):
        x, y = x.chunk(topo.world_size)[topo.rank], y.chunk(topo.world_size)[topo.rank]
        session.train_step((x, y), lambda out, t: F.cross_entropy(out, t)) if when != "after" else \
            _manual_step(session, model, x, y)
    session.checkpoint(tmp)
    session.export(f"{tmp}/model.safetensors")
    return session.full_state_dict(), sorted(session.unwrap().state_dict()), warned


def _manual_step(session, compiled, x, y):
    with session.accumulation():
        session.backward(F.cross_entropy(compiled(x), y))
    session.step()


def _reference_mlp(steps=3):
    model = make_model("mlp")
    opt = _sgd(model)
    for x, y in zip(*make_batches(steps, 8)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("strategy,when,backend", [("ddp", "before", "eager"), ("ddp", "before", "inductor"),
                                                    ("zero3", "before", "eager"), ("zero3", "after", "eager")])
def test_compiled_models_train_checkpoint_and_export_with_the_models_own_keys(strategy, when, backend, tmp_path):
    from safetensors.torch import load_file

    reference = _reference_mlp()
    expected = sorted(reference.state_dict())
    ranks = run_on_ranks(_compiled, 2, strategy, when, str(tmp_path), backend, timeout=300)
    for state, unwrapped_keys, warned in ranks:
        # measured: 1.5e-8, with either backend
        assert sorted(state) == expected and max_param_diff(state, reference.state_dict()) < 1e-6
        assert warned == (strategy == "zero3" and when == "before")  # an eager zero3 forward is said at setup
        if strategy == "ddp":
            assert unwrapped_keys == expected  # session.unwrap() is the model itself, not the compiled wrapper
    plain = make_model("mlp")
    plain.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)  # no _orig_mod. keys
    restored = run_on_ranks(_load_newest, 1, str(tmp_path))[0]  # resumed without compile
    assert max_param_diff(restored, reference.state_dict()) < 1e-6


def test_a_compiled_model_cannot_be_cut_into_pipeline_stages():
    topo = pt.Topology.from_env({}, rank=0, world_size=2)
    with pytest.raises(pt.ConfigError, match="compile the layers in place"):
        pt.Pipeline(stages=2).setup(torch.compile(make_model("mlp").net), None, pt.ProcessGrid(topo))


# -- 7: resuming with another optimizer, or another learning rate ------------------------------------

def _train_and_save(path, optimizer_class, lr):
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, opt = session.setup(model, optimizer_class(model.parameters(), lr=lr))
        session.train_step((XS[0], YS[0]), F.cross_entropy)
        session.save(path)
        return session.full_state_dict()


def test_resuming_into_another_optimizer_class_is_refused_unless_weights_only(tmp_path):
    saved = _train_and_save(tmp_path / "adam", torch.optim.Adam, 0.01)
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(pt.ConfigError, match="holds the state of a torch.optim.adam.Adam.*weights_only=True"):
            session.load(tmp_path / "adam")
        session.load(tmp_path / "adam", weights_only=True)
        assert max_param_diff(session.full_state_dict(), saved) == 0
        assert not opt.state and opt.param_groups[0]["lr"] == 0.1 and session.micro_step == 0


def test_a_new_learning_rate_at_resume_is_named_and_can_be_kept(tmp_path):
    _train_and_save(tmp_path / "sgd", torch.optim.SGD, 0.1)
    for policy, lr in [("checkpoint", 0.1), ("current", 0.02)]:
        with pt.Session("single", progress_bar=False) as session:
            model = make_model("mlp")
            model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.02))
            if policy == "checkpoint":
                with pytest.warns(UserWarning, match="replaces this optimizer's lr 0.02 → 0.1"):
                    session.load(tmp_path / "sgd")
            else:
                session.load(tmp_path / "sgd", hyperparameters=policy)
            assert opt.param_groups[0]["lr"] == lr and session.micro_step == 1


def test_adams_betas_come_back_from_the_checkpoint_as_the_learning_rate_does(tmp_path):
    """A tuple hyperparameter (Adam's betas) is saved and restored, as a tuple, and a new value of
    yours is named like a new learning rate (it was dropped at save: yours won, silently)."""
    _train_and_save(tmp_path / "adam", functools.partial(torch.optim.Adam, betas=(0.8, 0.9)), 0.01)
    with pt.Session("single", progress_bar=False) as session:
        model = make_model("mlp")
        model, opt = session.setup(model, torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.5, 0.5)))
        with pytest.warns(UserWarning, match=r"replaces this optimizer's betas \(0.5, 0.5\) → \[0.8, 0.9\]"):
            session.load(tmp_path / "adam")
        assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    with pt.Session("single", progress_bar=False) as session:  # the same betas: nothing to name
        model = make_model("mlp")
        model, opt = session.setup(model, torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9)))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            session.load(tmp_path / "adam")


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


# -- ranks given batches of different sizes ----------------------------------------------------------

def _uneven(topo, strategy, sizes, weighted):
    """Two steps where rank r holds sizes[r] rows of one 20-row batch per step: the warnings
    rank 0 and the others heard, and the parameters after."""
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = _dataset(sum(sizes) * 2).tensors
    mine = slice(sum(sizes[: topo.rank]), sum(sizes[: topo.rank + 1]))
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        for x, y in zip(xs.chunk(2), ys.chunk(2)):  # two steps of sum(sizes) rows
            session.train_step((x[mine], y[mine]), F.cross_entropy, weight=len(x[mine]) if weighted else None)
    said = [str(w.message) for w in heard if issubclass(w.category, pt.UnevenBatchWarning)]
    return said, session.full_state_dict()


def _one_process_on(rows):
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = _dataset(rows * 2).tensors
    for x, y in zip(xs.chunk(2), ys.chunk(2)):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("strategy, sizes", [("ddp", (16, 4)), ("zero3", (16, 4)), ("ddp", (6, 6, 3))])
def test_ranks_given_batches_of_different_sizes_are_warned_once_and_weight_mends_it(strategy, sizes):
    """A mean of means, silently, is what torch's DDP trains; rank 0 names the sizes and weight=,
    and weight=len(batch) then trains what one process does on the same rows."""
    heard = run_on_ranks(_uneven, len(sizes), strategy, sizes, False)
    rank0 = heard[0][0]
    assert len(rank0) == 1, rank0  # once, at the first step
    assert rank0[0].startswith(f"the ranks were given batches of different sizes ({sizes[0]} rows on rank"), rank0
    assert f"{min(sizes)} rows on rank {sizes.index(min(sizes))}" in rank0[0] and "weight=" in rank0[0], rank0
    assert all(not said for said, _ in heard[1:])  # rank 0 speaks for all
    reference = _one_process_on(sum(sizes))
    assert max_param_diff(heard[0][1], reference) > 1e-3  # the mean of means is not one process's step
    weighted = run_on_ranks(_uneven, len(sizes), strategy, sizes, True)
    assert all(not said for said, _ in weighted)
    assert max_param_diff(weighted[0][1], reference) < 1e-5


def test_ranks_given_batches_of_one_size_hear_nothing():
    assert all(not said for said, _ in run_on_ranks(_uneven, 2, "ddp", (8, 8), False))


def _uneven_pipeline(topo):
    session = pt.Session(pt.Pipeline(stages=2, microbatches=2), topology=topo, progress_bar=False)
    model = chain()
    model, opt = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _dataset(16 if topo.rank == 0 else 4).tensors
    session.train_step((x, y), F.cross_entropy)


def test_pipeline_stages_given_batches_of_different_sizes_are_named():
    with pytest.raises(RankFailure, match=r"every stage of a pipeline must be given the same batch, and they differ: "
                                          r"stage 0 \(pipeline rank 0\) cut micro-batches of shapes \[\[8, 12\]\] "
                                          r"from its batch, stage 1 \(pipeline rank 1\) micro-batches of shapes "
                                          r"\[\[2, 12\]\]"):
        run_on_ranks(_uneven_pipeline, 2, timeout=60)
