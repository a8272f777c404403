"""ZeRO stages on real ranks against single-process training."""

import contextlib
import copy
import tempfile

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain import checkpoint
from paratrain.parallel.zero import OwnerCollectives
from paratrain.testing import assert_same_params, run_on_ranks
from tests.support.models import make_batches, make_model, make_optimizer, reference, train_on_rank

STEPS, GLOBAL_BATCH = 3, 16


FORCED = OwnerCollectives(reduce_scatter=True, all_gather=True)  # nccl's choice, run on gloo


def _train_sharded(topo, name, stage, optim, accumulate, forced=False):
    model = make_model(name)
    model, opt = pt.shard(model, make_optimizer(optim, model.parameters()), stage=stage, bucket_cap_mb=0.0005,
                          collectives=FORCED if forced else None)
    train_on_rank(topo, model, opt, steps=STEPS, global_batch=GLOBAL_BATCH, accumulate=accumulate)
    return pt.full_state_dict(model)


def _batch(world):
    return 18 if world % 3 == 0 else GLOBAL_BATCH  # equal pieces per rank


def _reference(name, world, accumulate, optim):
    return reference(name, optim, world=world, accumulate=accumulate, steps=STEPS, global_batch=_batch(world))


CASES = [(stage, name, world, optim, 1, False) for stage in (1, 2) for name in ("mlp", "tied", "bn")
         for world in (2, 4) for optim in ("adam", "sgd") if not (world == 4 and name == "bn")]
CASES += [(1, "mlp", 2, "adam", 2, False), (2, "mlp", 2, "adam", 2, False), (2, "tied", 4, "sgd", 2, False),
          (1, "tied", 2, "adamw", 1, False)]
CASES += [(1, "dropout", 2, "sgd", 1, False), (2, "dropout", 2, "adam", 1, False),
          (2, "dropout", 4, "sgd", 2, False)]
# reduce-scatter and all-gather (what nccl uses) forced on gloo, so that the path every GPU run
# takes differs from a tested one only by the backend
CASES += [(2, "mlp", 2, "adam", 1, True), (2, "tied", 4, "sgd", 2, True), (2, "bn", 2, "sgd", 1, True),
          (1, "mlp", 4, "adam", 1, True)]


@pytest.mark.parametrize("stage,name,world,optim,accumulate,forced", CASES)
def test_zero_matches_single_process(stage, name, world, optim, accumulate, forced):
    ours = run_on_ranks(_train_sharded, world, name, stage, optim, accumulate, forced)
    ref = _reference(name, world, accumulate, optim)
    for state in ours:
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)  # measured: at most 1.2e-7


def _two_synced_backwards(topo):
    """Two backwards that both synchronise (no no_sync()), then one step: each stage's reduced
    gradients must add up, as .grad does on one process."""
    states = {}
    for stage in (1, 2, 3):
        model = make_model("mlp")
        model, opt = pt.shard(model, make_optimizer("sgd", model.parameters()), stage=stage,
                              bucket_cap_mb=0.0005, wrap_policy=_policy("mlp"))
        train_on_rank(topo, model, opt, steps=STEPS, global_batch=GLOBAL_BATCH, accumulate=2, no_sync=False)
        states[stage] = pt.full_state_dict(model)
    return states


def test_synchronised_backwards_before_one_step_add_up():
    ref = _reference("mlp", 2, 2, "sgd")
    for states in run_on_ranks(_two_synced_backwards, 2):
        for stage, state in states.items():
            assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)  # measured: 3.0e-8


def _unused_in_stage(topo, stage):
    model = make_model("unused")
    model, _ = pt.shard(model, make_optimizer("sgd", model.parameters()), stage=stage)
    xs, ys = make_batches(1, 4)
    F.cross_entropy(model(xs[0]), ys[0]).backward()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_parameter_without_gradient_under_zero_is_named(stage):
    """Every stage steps whole slices of its buckets or flats: a parameter that got no gradient
    would be stepped with zeros (momentum, weight decay) where one process skips it, so it is
    refused ([Note: no gradient] in flat_shard.py)."""
    advice = "ZeRO stages 1 and 2" if stage < 3 else "ZeRO stage 3"
    with pytest.raises(pt.testing.RankFailure, match=rf"spare\.weight(.|\n)*{advice}"):
        run_on_ranks(_unused_in_stage, 2, stage, timeout=60, collective_timeout=10)


class _Detour(torch.nn.Module):
    """The MLP with a head that takes part only while `detour` is set."""

    def __init__(self):
        super().__init__()
        self.net, self.extra, self.detour = make_model("mlp"), torch.nn.Linear(12, 5), False

    def forward(self, x):
        return self.net(x) + self.extra(x) if self.detour else self.net(x)


def _detour_training(pieces_of, model, opt, accumulate, no_sync=contextlib.nullcontext):
    """Three AdamW steps; each step's first micro-batch takes the detour, the others do not.
    `pieces_of(x, y)`: this process's (x, y) pieces of a step's global batch."""
    xs, ys = make_batches(3, 12)
    inner = getattr(model, "module", model)
    for step in range(3):
        pieces = pieces_of(xs[step], ys[step])
        for i, (x, y) in enumerate(pieces):
            inner.detour = i % accumulate == 0
            with no_sync() if i < len(pieces) - 1 else contextlib.nullcontext():
                (F.cross_entropy(model(x), y) / len(pieces)).backward()
        opt.step()
        opt.zero_grad()


def _detour_on_ranks(topo, wrapped):
    from paratrain.parallel.zero.wrap_policy import WrapPolicy
    torch.manual_seed(0)
    model = _Detour()
    policy = WrapPolicy(module_classes=(torch.nn.Linear,)) if wrapped else None
    model, opt = pt.shard(model, make_optimizer("adamw", model.parameters()), stage=3, wrap_policy=policy)
    world, rank = topo.world_size, topo.rank
    _detour_training(lambda x, y: list(zip(x.chunk(2 * world), y.chunk(2 * world)))[2 * rank:2 * rank + 2],
                     model, opt, 2, model.no_sync)
    return pt.full_state_dict(model)


@pytest.mark.parametrize("world,wrapped", [(2, True), (3, False), (3, True)])
def test_stage3_a_parameter_used_in_an_earlier_micro_batch_is_stepped_as_on_one_process(world, wrapped):
    """`extra` gets its gradient in the first micro-batch (under no_sync) and none in the
    synchronised one: it holds a gradient, so it is not refused, and steps as on one process;
    `wrapped`: it is a unit of its own, whose flat no leaf reaches in the synchronised backward."""
    torch.manual_seed(0)
    ref_model = _Detour()
    _detour_training(lambda x, y: list(zip(x.chunk(2 * world), y.chunk(2 * world))), ref_model,
                     make_optimizer("adamw", ref_model.parameters()), 2)
    ref = {k: v.detach() for k, v in ref_model.named_parameters()}
    for state in run_on_ranks(_detour_on_ranks, world, wrapped):
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)


def _policy(name):
    from torch import nn

    from paratrain.parallel.zero.wrap_policy import WrapPolicy
    if name == "stack":  # each block (272 parameters) is below it, their list (816) is not
        return WrapPolicy(min_params=300)
    return WrapPolicy(module_classes=(nn.Linear,)) if name != "bn" else WrapPolicy(min_params=40)


def _train_stage3(topo, name, optim, accumulate, forced=False, own_flats=False):
    """`own_flats`: every root parameter a flat of its own, whose first gradient is the flat's
    buffer as autograd made it (units.py, [Note: the root's big parameters])."""
    if own_flats:
        from paratrain.parallel.zero import units
        units.OWN_FLAT_ELEMENTS = 1
    model = make_model(name)
    model, opt = pt.shard(model, make_optimizer(optim, model.parameters()), stage=3,
                          wrap_policy=_policy(name), collectives=FORCED if forced else None)
    train_on_rank(topo, model, opt, steps=STEPS, global_batch=_batch(topo.world_size), accumulate=accumulate)
    return pt.full_state_dict(model), len(model.units)


CASES3 = [(name, world, optim, 1, False) for name in ("mlp", "tied", "bn") for world in (2, 4)
          for optim in ("adam", "sgd") if not (world == 4 and name == "bn")]
CASES3 += [("mlp", 2, "adam", 2, False), ("tied", 4, "sgd", 2, False), ("tied", 2, "adamw", 1, False)]
CASES3 += [("mlp", 2, "adam", 1, True), ("tied", 4, "sgd", 2, True)]  # all-gather, reduce-scatter on gloo
CASES3 += [("stack", 2, "adam", 1, False)]  # the list's owner is the unit: the list is never called


CASES3 = [case + (False,) for case in CASES3]
CASES3 += [(name, world, optim, accumulate, False, True) for name, world, optim, accumulate in
           [("tied", 2, "adam", 1), ("tied", 3, "sgd", 1), ("tied", 4, "sgd", 2), ("bn", 2, "adam", 1)]]


@pytest.mark.parametrize("name,world,optim,accumulate,forced,own_flats", CASES3)
def test_stage3_matches_single_process(name, world, optim, accumulate, forced, own_flats):
    ours = run_on_ranks(_train_stage3, world, name, optim, accumulate, forced, own_flats)
    ref = _reference(name, world, accumulate, optim)
    for state, units in ours:
        assert units > 1
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)  # measured: at most 1.2e-7


def _sharded(name, stage, seed=0):
    model = make_model(name, seed=seed)
    return pt.shard(model, make_optimizer("adam", model.parameters()), stage=stage, wrap_policy=_policy(name))


def _step(model, opt, x, y):
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _round_trip(topo, name, stage):
    xs, ys = make_batches(4, GLOBAL_BATCH)
    mine = [(x.chunk(topo.world_size)[topo.rank], y.chunk(topo.world_size)[topo.rank]) for x, y in zip(xs, ys)]
    model, opt = _sharded(name, stage)
    for x, y in mine[:3]:
        _step(model, opt, x, y)
    # state dicts hold references to live tensors: copy them before the next step changes them
    full, sharded, optim = copy.deepcopy((pt.full_state_dict(model), model.state_dict(), opt.state_dict()))
    _step(model, opt, *mine[3])
    expected = pt.full_state_dict(model)
    results = []
    for kind in ("full", "sharded"):  # a fresh model (other initial weights) loads the state
        model2, opt2 = _sharded(name, stage, seed=1)
        if kind == "full":
            model2.load_full_state_dict(full) if stage == 3 else model2.module.load_state_dict(full)
        else:
            model2.load_state_dict(sharded)
        opt2.load_state_dict(copy.deepcopy(optim))  # torch adopts the tensors it is given
        _step(model2, opt2, *mine[3])
        results.append(pt.full_state_dict(model2))
    return expected, results


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_dict_round_trip_reproduces_the_next_step(stage):
    for expected, results in run_on_ranks(_round_trip, 2, "tied", stage):
        for got in results:
            assert_same_params(got, expected, atol=0)


def _stale_optimizer(topo):
    model = make_model("mlp")
    stale = torch.optim.SGD(model.parameters(), lr=0.1)
    model, _ = pt.shard(model, stale, stage=3)
    xs, ys = make_batches(1, 4)
    F.cross_entropy(model(xs[0]), ys[0]).backward()
    stale.step()


def test_optimizer_made_before_stage3_is_a_clear_error():
    with pytest.raises(pt.testing.RankFailure, match="created from the model before ZeRO stage 3"):
        run_on_ranks(_stale_optimizer, 2, timeout=60)


def _bad_optimizers(topo, case):
    model = make_model("mlp")
    if case == "foreign":
        pt.shard(model, torch.optim.SGD(make_model("mlp").parameters(), lr=0.1), stage=2)
    elif case == "partial":
        pt.shard(model, torch.optim.SGD(model.net[0].parameters(), lr=0.1), stage=1)
    elif case == "lbfgs":
        pt.shard(model, torch.optim.LBFGS(model.parameters()), stage=3)
    elif case == "stage":
        pt.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=4)
    elif case == "frozen":
        model.net[0].weight.requires_grad_(False)
        pt.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=2)
    elif case == "late-group":  # a learnable temperature added after sharding would never step
        _, opt = pt.shard(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=1)
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(()))]})


@pytest.mark.parametrize("case,message", [
    ("foreign", "not parameters of the model"), ("partial", "does not hold 4 trainable"),
    ("lbfgs", "LBFGS looks across whole tensors"), ("stage", "stages 1, 2 and 3; got stage=4"),
    ("frozen", r"1 frozen parameter\(s\) \(requires_grad=False\).*if p.requires_grad"),
    ("late-group", "cannot take a param group after pt.shard")])
def test_optimizer_misuse_is_a_clear_error(case, message):
    with pytest.raises(pt.testing.RankFailure, match=message):
        run_on_ranks(_bad_optimizers, 2, case, timeout=60)


def _train_mixed(topo, offload, param_dtype, stage=3, clip=None, batch=GLOBAL_BATCH):
    model = make_model("mlp")
    model, opt = pt.shard(model, make_optimizer("adam", model.parameters()), stage=stage, offload=offload,
                          param_dtype=param_dtype, wrap_policy=_policy("mlp"), bucket_cap_mb=0.0005)
    xs, ys = make_batches(STEPS, batch)
    for x, y in zip(xs, ys):
        F.cross_entropy(model(x.chunk(topo.world_size)[topo.rank]), y.chunk(topo.world_size)[topo.rank]).backward()
        if clip:
            model.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    dtypes = {str(s.dtype) for s in model.shards} | {str(t.dtype) for st in opt.state.values()
                                                     for t in st.values() if t.dim()}
    computed = {f.full.dtype for u in model.units for f in u.flats} if stage == 3 else \
        {p.dtype for p in model.module.parameters()}
    views = stage != 3 and any(s.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                               for s, b in zip(model.shards, model.param_buffers))  # the optimizer steps the model's own
    return pt.full_state_dict(model), dtypes, computed, views


def mixed_reference(world, dtype):
    """fp32 master weights and Adam; each replica's forward and backward in `dtype`; gradients
    divided by the world in `dtype`, summed in `dtype`, then stepped in fp32."""
    master = make_model("mlp")
    opt = make_optimizer("adam", master.parameters())
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    for x, y in zip(xs, ys):
        total = None
        for xr, yr in zip(x.chunk(world), y.chunk(world)):
            replica = copy.deepcopy(master).to(dtype)
            F.cross_entropy(replica(xr.to(dtype)), yr).backward()
            grads = [p.grad / world for p in replica.parameters()]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        for p, g in zip(master.parameters(), total):
            p.grad = g.float()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in master.named_parameters()}


@pytest.mark.parametrize("stage,offload", [(3, False), (1, False), (2, False), (2, True)])
def test_bf16_compute_with_fp32_master_state_matches_its_arithmetic(stage, offload):
    ref = mixed_reference(2, torch.bfloat16)
    for state, dtypes, computed, views in run_on_ranks(_train_mixed, 2, offload, torch.bfloat16, stage):
        assert dtypes == {"torch.float32"} and computed == {torch.bfloat16} and not views
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)  # measured: 0
        assert all(v.dtype == torch.float32 for v in state.values())  # the masters', not the bf16 copies


@pytest.mark.parametrize("stage,world", [(3, 2), (1, 3), (2, 3)])
def test_offload_matches_single_process(stage, world):
    # on this CPU-only machine the shards' home and the compute device coincide; the device to
    # host copies are exercised only where CUDA is present (stages 1 and 2 step copies, not views)
    batch = 5 * world  # equal pieces per rank
    ref = reference("mlp", "adam", world=world, accumulate=1, steps=STEPS, global_batch=batch)
    for state, dtypes, _, views in run_on_ranks(_train_mixed, world, True, None, stage, None, batch):
        assert dtypes == {"torch.float32"} and not views
        assert_same_params({k: state[k] for k in ref}, ref, atol=1e-6)  # measured: 7.5e-8


def test_clipping_scales_the_master_gradients_the_step_reads():
    model = make_model("mlp")
    opt = make_optimizer("adam", model.parameters())
    for x, y in zip(*make_batches(STEPS, GLOBAL_BATCH)):
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    for state, *_ in run_on_ranks(_train_mixed, 2, True, None, 2, 0.05):
        assert_same_params({k: state[k] for k in model.state_dict()}, model.state_dict(), atol=1e-6)


class CudaOnlyAdam(torch.optim.Adam):
    def step(self, closure=None):
        if any(p.device.type != "cuda" for g in self.param_groups for p in g["params"]):
            raise RuntimeError("expected CUDA tensors")
        return super().step(closure)


def _offload_cuda_only(topo, stage):
    model = make_model("mlp")
    pt.shard(model, CudaOnlyAdam(model.parameters()), stage=stage, offload=True)


@pytest.mark.parametrize("stage", [1, 2])
def test_offload_with_an_optimizer_that_cannot_step_on_cpu_is_refused(stage):
    with pytest.raises(pt.testing.RankFailure, match=r"offload steps the optimizer on the CPU, and CudaOnlyAdam "
                                                     r"cannot step a CPU tensor \(RuntimeError: expected CUDA"):
        run_on_ranks(_offload_cuda_only, 2, stage, timeout=60)


def _mixed_round_trip(topo, path, load):
    model = make_model("tied")
    model, opt = pt.shard(model, make_optimizer("adam", model.parameters()), stage=2, param_dtype=torch.bfloat16,
                          offload=True, bucket_cap_mb=0.0005)
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    mine = [(x.chunk(topo.world_size)[topo.rank], y.chunk(topo.world_size)[topo.rank]) for x, y in zip(xs, ys)]
    if load:
        checkpoint.load(path, model, opt)
    else:
        _step(model, opt, *mine[0])
        checkpoint.save(path, model, opt)
    _step(model, opt, *mine[1])
    return pt.full_state_dict(model)


def test_a_mixed_precision_checkpoint_holds_the_master_weights():
    """Saved and loaded are the fp32 masters (loading copies them back into the bf16 parameters):
    the next step after a load equals the next step of the run that saved."""
    with tempfile.TemporaryDirectory() as tmp:
        saved = run_on_ranks(_mixed_round_trip, 2, f"{tmp}/ckpt", False)
        resumed = run_on_ranks(_mixed_round_trip, 2, f"{tmp}/ckpt", True)
    for a, b in zip(saved, resumed):
        assert a.keys() == b.keys() and all(v.dtype == torch.float32 for v in a.values())
        assert_same_params(b, a, atol=0)


def _evaluate(topo):
    model, _ = _sharded("tied", 3)
    x = make_batches(1, 4)[0][0]
    with torch.no_grad():
        out = model(x)
    gathered = [f.full.untyped_storage().size() for u in model.units for f in u.flats]
    return out, gathered


def test_stage3_inference_gathers_then_frees_every_unit():
    expected = make_model("tied")(make_batches(1, 4)[0][0]).detach()
    for out, gathered in run_on_ranks(_evaluate, 2):
        assert torch.allclose(out, expected, rtol=0, atol=1e-6)  # measured: 0
        assert gathered and all(size == 0 for size in gathered)


def _recover(topo):
    model, opt = _sharded("mlp", 3)
    xs, ys = make_batches(STEPS + 1, GLOBAL_BATCH)
    mine = [(x.chunk(topo.world_size)[topo.rank], y.chunk(topo.world_size)[topo.rank]) for x, y in zip(xs, ys)]

    def boom(grad):
        raise RuntimeError("a backward that fails halfway")

    out = model(mine[0][0])
    out.register_hook(boom)
    try:
        F.cross_entropy(out, mine[0][1]).backward()
    except RuntimeError:
        pass
    opt.zero_grad()
    for x, y in mine[1:]:
        _step(model, opt, x, y)
    return pt.full_state_dict(model)


def test_stage3_recovers_from_a_failed_backward():
    model = make_model("mlp")
    opt = make_optimizer("adam", model.parameters())
    xs, ys = make_batches(STEPS + 1, GLOBAL_BATCH)
    for x, y in zip(xs[1:], ys[1:]):
        _step(model, opt, x, y)
    for state in run_on_ranks(_recover, 2):
        assert_same_params(state, model.state_dict(), atol=1e-6)  # measured: 3.0e-8
