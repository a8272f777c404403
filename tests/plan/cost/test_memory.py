"""The planner's memory prediction (plan/cost/memory.py) against the bytes real runs hold.

Each strategy trains two steps on real gloo ranks at world 2, 3 and 4 (sizes that no world size
divides, so padding counts); then every tensor storage alive in the rank that was not alive
before the model was built is sorted into parameters (the model's and the optimizer's), optimizer
state, and the rest, which at rest must be the gradients and their buffers (a pipeline stage
also keeps its last step's p2p receive buffers and losses: activations, which are not predicted
exactly). Each must equal the prediction made from the same model built on the meta device, to
the byte.
"""

import time

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

import paratrain as pt
from paratrain.plan.cost.memory import RankMemory, predict
from paratrain.plan.cost.optimizer_state import OPTIMIZERS, OptimizerState
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import ModelSource
from paratrain.testing import run_on_ranks
from tests.support.models import (
    counting_new_objects,
    live_storages,
    live_tensors,
    mse_in_output_dtype,
    storage_of,
    storages,
)

UNITS = pt.WrapPolicy(module_classes=(nn.Linear,))
TINY = 0.0005  # MiB: a bucket cap of 524 bytes, so the model's gradients fill several buckets


def _model() -> nn.Sequential:
    """221 + 221 + 91 = 533 parameters: odd, not divisible by 3, and so are the layers."""
    return nn.Sequential(nn.Linear(12, 17), nn.Tanh(), nn.Linear(17, 13, bias=False), nn.Tanh(),
                         nn.Linear(13, 7, bias=False))


def _strategies(world: int) -> dict[str, pt.Strategy]:
    cases = {"ddp": pt.DDP(), "hierarchical": pt.Hierarchical(bucket_cap_mb=TINY),
             "zero1": pt.ZeRO(stage=1, bucket_cap_mb=TINY), "zero2": pt.ZeRO(stage=2, bucket_cap_mb=TINY),
             "zero3": pt.ZeRO(stage=3, wrap_policy=UNITS),
             "zero1-bf16": pt.ZeRO(stage=1, bucket_cap_mb=TINY, param_dtype=torch.bfloat16),
             "zero2-offload": pt.ZeRO(stage=2, offload=True),
             "zero3-bf16": pt.ZeRO(stage=3, wrap_policy=UNITS, param_dtype=torch.bfloat16),
             "zero3-offload": pt.ZeRO(stage=3, wrap_policy=UNITS, offload=True),
             "pipeline": pt.Pipeline(stages=2, microbatches=2)}
    if world == 4:  # 2 stages × 2 replicas that shard the optimizer (pipeline/sharded.py)
        for stage in (1, 2):
            cases[f"pipeline-zero{stage}"] = pt.Mesh(pp=pt.Pipeline(stages=2, microbatches=2),
                                                     dp=pt.ZeRO(stage=stage, bucket_cap_mb=TINY))
        # hybrid sharding: 2 groups of 2 that each shard as ZeRO over 2 ranks does
        cases.update({f"zero{stage}-hybrid": pt.ZeRO(stage=stage, bucket_cap_mb=TINY, replicate=2) for stage in (1, 2)})
        cases["zero3-hybrid"] = pt.ZeRO(stage=3, wrap_policy=UNITS, replicate=2)
    if world % 2:
        del cases["pipeline"], cases["hierarchical"]
    return cases


# stage 2 with master shards: the reduced slice in param_dtype is held by the reduction, and an fp32
# copy of it is the master's .grad (stage12.py, [Note: master shards])
HIDDEN_GRADS = {"zero2-offload"}

OPTIMIZER_OF = {"adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
                "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}


def _held(topo, strategy: pt.Strategy, optimizer: str, window: bool = False, make=_model) -> dict:
    """Bytes this rank holds after two steps, by kind; `window`: then zero_grad() and one backward
    under no_sync(), as the first micro-batch of a gradient accumulation window runs."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 12), torch.randn(4, 7)
    keep = live_tensors()  # alive until the count: no address is reused
    before = live_storages()
    model = make()
    wrapped, opt = strategy.setup(model, OPTIMIZER_OF[optimizer](model.parameters()), strategy.grid(topo))
    del model  # a pipeline rank keeps its stage only
    for _ in range(2):
        opt.zero_grad()
        wrapped.forward_backward(x, y, mse_in_output_dtype, 1.0)
        wrapped.reduced_finite()  # Session's step takes the finite check's sum before stepping
        opt.step()
    if window:
        opt.zero_grad()
        with wrapped.no_sync():
            wrapped.forward_backward(x, y, mse_in_output_dtype, 1.0)
    params = [*wrapped.parameters(), *(p for g in opt.param_groups for p in g["params"])]
    # at rest: alive in two reads 50 ms apart. One read in some tens saw a gathered unit's buffer
    # that was gone by the next gc pass (a reference a backend thread dropped an instant later)
    first = live_storages()
    time.sleep(0.05)
    live = {ptr: n for ptr, n in live_storages().items() if ptr not in before and ptr in first}
    held = {"params": storages(params),
            "optimizer": storages(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)),
            "via_grad": storages(p.grad for p in params)}
    assert not set(held["params"]) & set(held["optimizer"]), "a storage counted twice"
    out: dict = {kind: sum(s.values()) for kind, s in held.items()}
    out["rest"] = sum(n for ptr, n in live.items() if ptr not in held["params"] and ptr not in held["optimizer"])
    out["unaccounted"] = sum(n for ptr, n in {**held["params"], **held["optimizer"]}.items() if ptr not in live)
    # for a failure's message: what is alive beyond parameters, optimizer state and .grad
    known = {**held["params"], **held["optimizer"], **held["via_grad"]}
    out["unexplained"] = sorted((tuple(t.shape), str(t.dtype)) for t in live_tensors()
                                if (s := storage_of(t)) is not None and (ptr := s.data_ptr()) in live
                                and ptr not in known)
    del keep
    return out


def _measure(topo, optimizer: str, window: bool = False) -> dict[str, dict]:
    with counting_new_objects():  # the model and what it makes: all that the counts look for
        return {name: _held(topo, s, optimizer, window) for name, s in _strategies(topo.world_size).items()}


def _predicted(strategy: pt.Strategy, world: int, optimizer: str, local_world: int,
               accumulate: int = 1, make=_model) -> list[RankMemory]:
    with torch.device("meta"):
        model = make()
    return predict(model, strategy, world=world, optimizer=optimizer, local_world=local_world, accumulate=accumulate)


@pytest.mark.parametrize("world,optimizer", [(2, "adam"), (3, "sgd-momentum"), (4, "adam")])
def test_the_prediction_equals_the_bytes_each_rank_holds(world, optimizer):
    nodes = 2 if world == 4 else 1  # hierarchical at world 4: two nodes of two
    measured = run_on_ranks(_measure, world, optimizer, nodes=nodes, timeout=240)
    for name, strategy in _strategies(world).items():
        predicted = _predicted(strategy, world, optimizer, world // nodes)
        for rank, held in enumerate(measured):
            got = held[name]
            want = predicted[rank]
            where = f"{name} rank {rank} of {world}; alive beyond the state: {got['unexplained']}"
            assert got["unaccounted"] == 0, where  # every counted storage was made by this run
            assert got["params"] == want.params, (where, got, want)
            assert got["optimizer"] == want.optimizer, (where, got, want)
            if not name.startswith("pipeline"):  # at rest, all else is gradients
                assert got["rest"] == want.grads, (where, got, want)
            else:  # plus the last step's p2p receive buffers and losses: activations, not predicted
                assert got["rest"] >= want.grads, (where, got, want)
            if name not in HIDDEN_GRADS:  # every gradient byte is some parameter's .grad
                assert got["via_grad"] == want.grads, (where, got, want)


def test_an_accumulation_window_holds_what_the_prediction_says():
    """Between the micro-batches of a gradient accumulation window (backwards under no_sync(),
    after zero_grad), zero2 holds every full gradient bucket and zero3 every unit's full flat
    gradient: with accumulate > 1 that is comm_buffers, to the byte; ddp's and zero1's buckets are
    their gradients, as at rest. World 3 pads every flat."""
    measured = run_on_ranks(_measure, 3, "adam", True, timeout=240)
    for name, strategy in _strategies(3).items():
        want = _predicted(strategy, 3, "adam", 3, accumulate=2)[0]
        held = want.comm_buffers if name.startswith(("zero2", "zero3")) else want.grads
        for rank, got in enumerate(measured):
            where = f"{name} rank {rank}; alive beyond the state: {got[name]['unexplained']}"
            if name == "zero1-bf16":  # its fp32 master gradients wait for the last backward's reduction
                assert 0 < got[name]["rest"] < held, where
            else:
                assert got[name]["rest"] == held, where
    one, two = (_predicted(pt.ZeRO(stage=3, wrap_policy=UNITS), 3, "adam", 3, accumulate=k)[0] for k in (1, 2))
    assert two.comm_buffers > one.comm_buffers  # without accumulation, one full gradient at a time


def test_gradients_made_again_in_each_backward_do_not_add_to_the_activations():
    """zero2's slices and zero3's shards' gradients are freed by zero_grad and grow as the backward
    frees the activations: the peak holds the larger of the two; ddp's and zero1's buckets stay,
    and offloaded gradients are not on the device."""
    fresh = {name: _predicted(s, 3, "adam", 3)[0] for name, s in _strategies(3).items()}
    assert fresh["zero2"].fresh_grads == fresh["zero2"].grads > 0
    assert fresh["zero3"].fresh_grads == fresh["zero3"].grads > 0
    assert fresh["zero3-offload"].fresh_grads == 0 and fresh["ddp"].fresh_grads == fresh["zero1"].fresh_grads == 0
    assert 0 < fresh["zero2-offload"].fresh_grads < fresh["zero2-offload"].grads  # the fp32 masters' are on the host
    with torch.device("meta"):
        model = _model()
    zero3, ddp, zero2 = (predict(model, s, world=3, activation_bytes=3 * 10**6)[0]  # 1 MB a rank: ≫ the gradients
                         for s in (pt.ZeRO(stage=3, wrap_policy=UNITS), pt.DDP(), pt.ZeRO(stage=2, bucket_cap_mb=TINY)))
    assert zero3.device_peak == zero3.at_rest - zero3.grads + zero3.comm_buffers + zero3.gathered + 10**6
    assert ddp.device_peak == ddp.at_rest + 10**6  # its buckets are there all along
    # zero2 fills one bucket at a time: at the activations' peak, only the first
    assert 0 < zero2.comm_at_start < zero2.comm_buffers
    assert zero2.device_peak == zero2.at_rest - zero2.grads + zero2.comm_at_start + 10**6


def test_the_formulas_of_the_zero_paper_fall_out():
    """Rajbhandari et al. 2020, Figure 1, for Ψ fp32 parameters with Adam (K = 12 with the masters
    counted as parameters here) plus Adam's 4-byte step per stepped tensor; Ψ = 4·(64·64 + 64)
    elements, which world 8 cuts without padding."""
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
    psi, world = 4 * (64 * 64 + 64), 8
    got = {s: predict(model, pt.ZeRO(stage=s, wrap_policy=UNITS), world=world)[0] for s in (1, 2, 3)}
    ddp = predict(model, pt.DDP(), world=world)[0]
    steps = {"ddp": 4 * 8, 1: 4 * 1, 2: 4 * 1, 3: 4 * 4}  # Adam's step: 4 bytes per stepped tensor
    assert ddp.at_rest == 16 * psi + steps["ddp"]
    assert got[1].at_rest == 4 * psi + 4 * psi + 8 * psi // world + steps[1]
    assert got[2].at_rest == 4 * psi + 12 * psi // world + steps[2]
    assert got[3].at_rest == 16 * psi // world + steps[3]
    assert got[3].gathered == 2 * 4 * (64 * 64 + 64)  # the root holds nothing; two units at once


def test_optimizer_state_from_a_torch_optimizer():
    p = [nn.Parameter(torch.zeros(3))]
    assert OptimizerState.of(torch.optim.AdamW(p)) == OptimizerState("adamw", 2, 4, 2)
    assert OptimizerState.of(torch.optim.Adam(p, amsgrad=True)).per_element == 3
    assert OptimizerState.of(torch.optim.SGD(p, lr=0.1)) == OPTIMIZERS["sgd"]
    assert OptimizerState.of(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == OPTIMIZERS["sgd-momentum"]


@pytest.mark.parametrize("foreach", [False, True])
def test_the_optimizer_workspace_is_what_torchs_adam_makes_in_a_step(foreach):
    """OptimizerState.workspace against the temporaries a real step of torch.optim.Adam makes,
    their lifetimes counted op by op (fake_step.Lifetimes), the parameters, gradients and state
    left out: single-tensor (the CPU's default) two of the one it steps and the previous result,
    foreach one of each."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from paratrain.plan.model.fake_step import Lifetimes

    params = [nn.Parameter(torch.zeros(n)) for n in (300, 1000, 200)]
    for p in params:
        p.grad = torch.ones_like(p)
    adam = torch.optim.Adam(params, lr=0.1, foreach=foreach)
    adam.step()  # the state exists from here on
    held = [*params, *(p.grad for p in params), *(t for s in adam.state.values() for t in s.values())]
    with Lifetimes({StorageWeakRef(t.untyped_storage()) for t in held}) as lifetimes:
        adam.step()
    made = lifetimes.peak()
    want = OPTIMIZERS["adam"].workspace([(p.numel(), p.dtype) for p in params], foreach=foreach)
    assert want == (4 * 1500 if foreach else 4 * (2 * 1000 + 300))  # the 300's result is still held
    assert want <= made <= want + 64 * len(params)  # and the 0-dim step counts' arithmetic


def _cut_model() -> nn.Sequential:
    """Layers tp=2 can cut (18 columns, 18 rows), a replicated odd one after them."""
    return nn.Sequential(nn.Linear(12, 18), nn.Tanh(), nn.Linear(18, 13), nn.Tanh(), nn.Linear(13, 7, bias=False))


MESHES = {"tp2": pt.Mesh(tp=2, tp_plan={"0": "colwise", "2": "rowwise"}),
          "tp2-zero1": pt.Mesh(tp=2, dp=pt.ZeRO(stage=1, bucket_cap_mb=TINY), tp_plan={"0": "colwise", "2": "rowwise"}),
          "tp2-zero3": pt.Mesh(tp=2, dp=pt.ZeRO(stage=3, wrap_policy=UNITS), tp_plan={"0": "colwise", "2": "rowwise"})}


def _measure_meshes(topo) -> dict[str, dict]:
    with counting_new_objects():
        return {name: _held(topo, s, "adam", make=_cut_model) for name, s in MESHES.items()}


def test_tensor_parallel_prediction_equals_the_bytes_each_rank_holds():
    """pt.Mesh at world 4 (tp 2 × dp 2): the data-parallel strategy's figures on the model as a
    tp rank holds it (plan/cost/tensor_parallel.py)."""
    measured = run_on_ranks(_measure_meshes, 4, timeout=240)
    for name, strategy in MESHES.items():
        predicted = _predicted(strategy, 4, "adam", 4, make=_cut_model)
        for rank, held in enumerate(measured):
            got, want = held[name], predicted[rank]
            where = f"{name} rank {rank}; alive beyond the state: {got['unexplained']}"
            assert got["unaccounted"] == 0, where
            assert (got["params"], got["optimizer"], got["rest"]) == (want.params, want.optimizer, want.grads), \
                (where, got, want)


class _Block(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.a, self.b = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def _blocks() -> nn.Sequential:
    return nn.Sequential(*(_Block() for _ in range(4)))


BLOCKS = pt.WrapPolicy(module_classes=(_Block,))
COPIED = {"ddp": pt.DDP(), "zero1": pt.ZeRO(stage=1), "zero2": pt.ZeRO(stage=2),
          "zero3": pt.ZeRO(stage=3, wrap_policy=BLOCKS),
          "zero3-bf16": pt.ZeRO(stage=3, wrap_policy=BLOCKS, param_dtype=torch.bfloat16),
          "pipeline": pt.Pipeline(stages=2, microbatches=2)}


class _Copies(TorchDispatchMode):
    """The most bytes alive at once of casts to bf16 of the weights (the 32 × 32 leaves that need a
    gradient; a pipeline stage's received activations are leaves too, of the batch's shape)."""

    def __init__(self):
        super().__init__()
        self.alive: dict[StorageWeakRef, int] = {}
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.alive = {ref: n for ref, n in self.alive.items() if not ref.expired()}
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16 \
                and args[0].is_leaf and args[0].requires_grad and args[0].shape == (32, 32):
            self.alive[StorageWeakRef(out.untyped_storage())] = out.untyped_storage().nbytes()
        self.most = max(self.most, sum(self.alive.values()))
        return out


def _copies_held(topo) -> dict[tuple[str, bool], int]:
    out = {}
    for checkpointed in (False, True):
        for name, strategy in COPIED.items():
            torch.manual_seed(0)
            model = _blocks()
            if checkpointed:
                pt.checkpoint_activations(model, _Block)
            wrapped, _ = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy.grid(topo))
            copies = _Copies()
            with copies, torch.autocast("cpu", dtype=torch.bfloat16):  # as Session's spans forward_backward
                wrapped.forward_backward(torch.randn(6, 32), torch.randn(6, 32), mse_in_output_dtype, 1.0)
            out[name, checkpointed] = copies.most
    return out


def test_autocasts_weight_copies_are_what_each_rank_holds_through_a_bf16_step():
    """fp32 parameters under bf16 autocast: each rank holds a bf16 copy of every weight it computes
    with (autocast caches them) through the backward, checkpointed or not, a pipeline stage of its
    own; ZeRO-3's gathered weights are views, which autocast does not cache: the copies are what
    the matmuls save, all but the first's (its input needs no gradient) and, checkpointed, one
    unit's at a time; none with param_dtype bf16."""
    measured = run_on_ranks(_copies_held, 2, timeout=120)
    built = ModelSource(name="blocks", build=lambda: _meta(_blocks))
    for checkpointed in (False, True):
        facts = model_facts(built, 6, precision="bf16", activation_checkpointing=_Block if checkpointed else None)
        step = facts.checkpointed if checkpointed else facts.step
        assert step.weight_copy_bytes == 2 * 8 * 32 * 32
        for name, strategy in COPIED.items():
            for rank, held in enumerate(measured):
                want = predict(_meta(_blocks), strategy, world=2, step=step)[rank].weight_copies
                got = held[name, checkpointed]
                where = (name, checkpointed, rank, got, want)
                if name == "zero3" and not checkpointed:
                    assert want - got == 2 * 32 * 32, where
                else:
                    assert got == want, where
    assert measured[0]["zero3", True] == 2 * 2 * 32 * 32 and measured[0]["zero3-bf16", False] == 0
    assert measured[0]["pipeline", False] == measured[0]["ddp", False] // 2 > 0


def _meta(make):
    with torch.device("meta"):
        return make()


def test_a_llama_preset_plans_as_a_pipeline_whose_stages_hold_the_model():
    """transformers' Llama has a built-in cut (pipeline/adapters.py): the planner lays out its
    stages, which hold every parameter once, the token embedding on the first and the head on the
    last, and no stage the whole model."""
    from paratrain.plan.model.source import resolve

    model = resolve("llama-2-7b").build()
    stages = predict(model, pt.Pipeline(stages=4, microbatches=4), world=4)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(stage.params for stage in stages) == total
    embedding = model.model.embed_tokens.weight.numel() * 4
    assert stages[0].params > stages[1].params + embedding * 0.99 and stages[3].params > stages[1].params
    assert max(stage.params for stage in stages) < total / 2
