"""Tensor parallelism (parallel/tensor/) proved by parity: a Llama-style model trained through
`Session(strategy=pt.Mesh(...))` ends with the parameters one process reaches on the same global
batches. float64 with Adam: splitting a matmul changes its summation order, and Adam divides such
last-bit differences by √v, which fp32 would carry past 1e-6 (as the issue says)."""

import dataclasses
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.distributed.topology import free_port
from paratrain.testing import run_on_ranks
from tests.support.collectives import counting_collectives
from tests.support.llama import PLAN, llama, lm_loss, token_batches

STEPS, GLOBAL_BATCH = 3, 4


def loader():
    batches = token_batches(STEPS, GLOBAL_BATCH)
    ids, targets = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    return DataLoader(TensorDataset(ids, targets), batch_size=GLOBAL_BATCH, shuffle=False)


def optimizer(params, kind):
    return torch.optim.Adam(params, lr=1e-2) if kind == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def build(hf=False, meta=False, **model_kwargs):
    """The Llama-style model (tests/support/llama.py), or transformers' LlamaForCausalLM; built on
    the meta device, the reference is the same model materialised whole (the rule's values)."""
    if hf:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)).double()
    if meta:
        with torch.device("meta"):
            return llama(**model_kwargs)
    return llama(**model_kwargs)


def batches_for(hf):
    """Token batches; for a transformers model dicts whose labels make it compute its own loss."""
    data = loader()
    return [dict(input_ids=x, labels=x) for x, _ in data] if hf else data  # the model shifts its labels


def reference(kind="adam", clip=None, hf=False, meta=False, **model_kwargs):
    """One process, the same global batches, the same loop as the session's."""
    model = build(hf, meta, **model_kwargs)
    if meta:
        pt.materialize(model)
    opt = optimizer(model.parameters(), kind)
    for batch in batches_for(hf):
        (model(**batch).loss if hf else lm_loss(model(batch[0]), batch[1])).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train(topo, strategy, kind="adam", clip=None, hf=False, meta=False, **model_kwargs):
    """Train through the session; the whole state (rank 0) and each rank's replicated parameters."""
    with pt.Session(strategy=strategy, topology=topo, progress_bar=False, max_grad_norm=clip) as session:
        model = build(hf, meta, **model_kwargs)
        data = loader()
        if hf:  # examples as dicts: the collated batch is the model's keyword arguments
            data = DataLoader([dict(input_ids=x, labels=x) for x, _ in data.dataset], batch_size=GLOBAL_BATCH)
        model, opt, data = session.setup(model, optimizer(model.parameters(), kind), data)
        for batch in session.progress(data):
            session.train_step(batch, None if hf else lm_loss)
        whole = session.full_state_dict()
        replicated = {n: p.detach().clone() for n, p in session.unwrap().named_parameters()
                      if n not in model.shard_dims}
        held = {n: tuple(p.shape) for n, p in session.unwrap().named_parameters()}
        # the next session's port, agreed while this one's group lives: the cut layers keep this
        # session's groups, and with them its store on this port, until they are collected
        port = pt.broadcast_object(free_port() if topo.rank == 0 else None)
    return dict(whole=whole if topo.rank == 0 else None, replicated=replicated, held=held,
                replica=model.replica_index, port=port)


def train_dtensor(topo, sequence=False, **model_kwargs):
    """The same model and plan under torch's own tensor parallelism (DTensor's parallelize_module);
    `sequence`: with its sequence parallelism, as torchtitan's Llama plan writes it (the
    embedding and head cut by the vocabulary)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    topo = topo.init(timeout=60)
    model = llama(**model_kwargs)
    if sequence:
        parts, whole = (Shard(1), None), (Replicate(), None)  # a block's (hidden states, positions)
        plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "layers.*.attn_norm": SequenceParallel(), "layers.*.mlp_norm": SequenceParallel(),
                "layers.*.attn": PrepareModuleInput(input_layouts=parts, desired_input_layouts=whole),
                "layers.*.mlp": PrepareModuleInput(input_layouts=parts[:1], desired_input_layouts=whole[:1]),
                "layers.*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                "layers.*.mlp.down": RowwiseParallel(output_layouts=Shard(1)), "norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
        plan.update({k: ColwiseParallel() for k, v in PLAN.items() if v == "colwise"})
    else:
        plan = {k: {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[v]() for k, v in PLAN.items()}
    parallelize_module(model, init_device_mesh("cpu", (topo.world_size,)), plan)
    opt = optimizer(model.parameters(), "adam")
    for x, y in loader():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    port = pt.broadcast_object(free_port() if topo.rank == 0 else None)
    pt.destroy()
    return dict(whole=whole, port=port)


def sweep(topo, cases):
    out = []
    for strategy, kwargs in cases:
        out.append(train(topo, strategy, **kwargs) if strategy != "dtensor" else train_dtensor(topo, **kwargs))
        topo = dataclasses.replace(topo, master_port=out[-1]["port"])
    return out


def assert_close(got, want, atol=1e-6):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.allclose(got[k], want[k], atol=atol, rtol=0), (k, (got[k] - want[k]).abs().max().item())


VOCAB_CUT = {**PLAN, "embed": "rowwise", "lm_head": "colwise_rep"}
CASES = {  # world → (strategy, training settings) run in one job each
    2: [(pt.Mesh(tp=2), {}), (pt.Mesh(tp=2), dict(kind="sgd", clip=0.5, tied=True, bias=True)),
        (pt.Mesh(tp=2, tp_plan=VOCAB_CUT), dict(tied=True)),
        (pt.Mesh(tp=2), dict(meta=True)), (pt.Mesh(tp=2), dict(hf=True)), ("dtensor", {}),
        ("dtensor", dict(sequence=True)), (pt.Mesh(tp=2, sequence_parallel=True, tp_plan=VOCAB_CUT), {}),
        # sequence parallelism: the embedding and tied head held whole (each rank's part of the
        # sequence, their gradients summed over tp), or both cut by the vocabulary
        (pt.Mesh(tp=2, sequence_parallel=True), dict(tied=True, bias=True)),
        (pt.Mesh(tp=2, sequence_parallel=True, tp_plan=VOCAB_CUT), dict(tied=True, kind="sgd", clip=0.5)),
        # loss parallelism: the cross-entropy of logits cut by the vocabulary, with sequence
        # parallelism and a tied embedding, and alone
        (pt.Mesh(tp=2, sequence_parallel=True, loss_parallel=True, tp_plan=VOCAB_CUT), dict(tied=True)),
        (pt.Mesh(tp=2, loss_parallel=True, tp_plan={**PLAN, "lm_head": "colwise"}), dict(kind="sgd", clip=0.5))],
    4: [(pt.Mesh(tp=2, dp="ddp"), {}), (pt.Mesh(tp=2, dp="zero1"), {}), (pt.Mesh(tp=2, dp="zero2"), dict(clip=0.5)),
        (pt.Mesh(tp=2, dp="zero3"), dict(clip=0.5)), (pt.Mesh(tp=4), dict(heads=4, kv_heads=4)),
        (pt.Mesh(tp=2, pp=pt.Pipeline(stages=2, microbatches=2, layers="layers")), dict(tied=True, clip=0.5)),
        # interleaved 1F1B: each rank two chunks of a 4-block model, each chunk cut over tp
        (pt.Mesh(tp=2, pp=pt.Pipeline(stages=2, virtual=2, microbatches=2, schedule="interleaved-1f1b",
                                      layers="layers")), dict(layers=4, clip=0.5)),
        (pt.Mesh(tp=2, dp="zero3", sequence_parallel=True), dict(tied=True, bias=True)),
        (pt.Mesh(tp=2, dp="ddp", sequence_parallel=True), dict(bias=True)),
        (pt.Mesh(tp=4, sequence_parallel=True), dict(heads=4, kv_heads=4, tied=True)),
        (pt.Mesh(tp=2, dp="zero3", sequence_parallel=True, loss_parallel=True, tp_plan=VOCAB_CUT), dict(tied=True)),
        # hybrid sharding under tp: ZeRO-3 shards of one rank, replicated twice
        (pt.Mesh(tp=2, dp="zero3", replicate=2), dict(clip=0.5, tied=True, bias=True))],
}


@pytest.fixture(scope="module")
def runs():
    return {world: run_on_ranks(sweep, world, cases, timeout=300) for world, cases in CASES.items()}


@pytest.mark.parametrize("world,index", [(w, i) for w, cases in CASES.items() for i, (strategy, _) in enumerate(cases)
                                         if strategy != "dtensor"])
def test_tensor_parallel_training_matches_one_process(runs, world, index):
    strategy, kwargs = CASES[world][index]
    results = [rank[index] for rank in runs[world]]
    assert_close(results[0]["whole"], reference(**kwargs))
    # the cut layers hold 1/tp of the whole; the replicated parameters stay equal on every rank
    whole = results[0]["whole"]
    tp, stages = strategy.tp, strategy.pp.stages if strategy.pp is not None else 1
    first = {}  # each replicated parameter as the first rank holding it has it (a stage holds its own)
    for r in results:
        for name, shape in r["held"].items():
            if name not in r["replicated"]:
                assert math.prod(shape) * tp == whole[name].numel(), name
        for name, value in r["replicated"].items():
            assert torch.equal(value, first.setdefault(name, value)), name
    replicas = world // (tp * stages)
    assert sorted(r["replica"] for r in results) == sorted(i % replicas for i in range(world))


@pytest.mark.parametrize("nodes", [1, 2])
def test_tensor_parallelism_over_hierarchical_data_parallelism_matches_one_process(nodes):
    """tp 2 × hierarchical over 4 ranks: on one node its data-parallel pairs reduce inside the node;
    on two (a tp group per node) each pair spans both nodes and reduces across them."""
    results = run_on_ranks(sweep, 4, [(pt.Mesh(tp=2, dp="hierarchical"), dict(bias=True))], nodes=nodes, timeout=300)
    assert_close(results[0][0]["whole"], reference(bias=True))  # rank 0 gathers it


@pytest.mark.parametrize("ours,theirs", [((pt.Mesh(tp=2), {}), ("dtensor", {})),
                                         ((pt.Mesh(tp=2, sequence_parallel=True, tp_plan=VOCAB_CUT), {}),
                                          ("dtensor", dict(sequence=True)))])
def test_torch_dtensor_tensor_parallelism_reaches_the_same_parameters(runs, ours, theirs):
    """torch's parallelize_module with the same plan (ColwiseParallel / RowwiseParallel; with
    sequence parallelism, torchtitan's SequenceParallel and PrepareModuleInput) and ours agree,
    and both agree with one process."""
    ours, theirs = (runs[2][0][CASES[2].index(case)]["whole"] for case in (ours, theirs))
    assert_close(ours, theirs)
    assert_close(theirs, reference())


def count_collectives(topo, layers, sequence_parallel=False, loss_parallel=False):
    """The collectives one forward and backward of the cut model issues: (name, elements) each."""
    plan = {**PLAN, "lm_head": "colwise"} if loss_parallel else None
    with pt.Session(strategy=pt.Mesh(tp=2, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                                     tp_plan=plan), topology=topo, progress_bar=False) as session:
        model = llama(layers=layers)
        model, _ = session.setup(model, optimizer(model.parameters(), "sgd"))
        x, y = token_batches(1, GLOBAL_BATCH)[0]
        with counting_collectives() as calls:
            model.forward_backward(x, y, lm_loss, 1.0)
    return calls


def test_each_block_all_reduces_its_activations_once_forward_and_once_backward():
    """Per block, one all-reduce of b·s·h elements after attention and one after the MLP in
    forward, and one for each half's input gradient in backward (q, k and v share theirs, as do
    gate and up); nothing else. The formula of Narayanan et al. (2021), §3.2."""
    layers, width = 3, 32
    b_s_h = GLOBAL_BATCH * token_batches(1, GLOBAL_BATCH)[0][0].shape[1] * width
    for calls in run_on_ranks(count_collectives, 2, layers, timeout=120):
        assert calls == [("all_reduce", b_s_h)] * (4 * layers)


def test_sequence_parallelism_gathers_and_scatters_the_bytes_tensor_parallelism_all_reduces():
    """Under sequence parallelism no activation is all-reduced: per block half, an all-gather of
    b·s·h elements before its column-parallel layers and a reduce-scatter to b·s·h / tp after its
    row-parallel one, and the reverse in backward (each half the bytes of an all-reduce); the
    logits gathered once (b·s/tp·V each); and one all-reduce per parameter held whole, of its
    gradient (norms, embedding, head): Korthikanti et al. (2022), §4.2.2."""
    layers, width, vocab, tp = 3, 32, 64, 2
    x, _ = token_batches(1, GLOBAL_BATCH)[0]
    b_s_h = x.numel() * width
    gather = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(torch.distributed, "reduce_scatter_single") else "reduce_scatter_tensor"
    whole = {"embed.weight": vocab * width, "lm_head.weight": vocab * width, "norm.weight": width}
    whole.update({f"layers.{i}.{n}.weight": width for i in range(layers) for n in ("attn_norm", "mlp_norm")})
    for calls in run_on_ranks(count_collectives, 2, layers, True, timeout=120):
        forward = calls[:4 * layers + 1]
        assert forward == [(gather, b_s_h), (scatter, b_s_h // tp)] * (2 * layers) + [("all_gather", x.numel() * vocab // tp)]
        backward = calls[4 * layers + 1:]
        assert sorted(n for name, n in backward if name == "all_reduce") == sorted(whole.values())
        assert sorted(c for c in backward if c[0] != "all_reduce") == sorted([(gather, b_s_h), (scatter, b_s_h // tp)] * (2 * layers))


def odd_lengths(topo):
    """Under sequence parallelism at tp 2: the model's logits for a 7-token sequence under
    torch.no_grad() (sampling), and the error for one while autograd records."""
    with pt.Session(strategy=pt.Mesh(tp=2, sequence_parallel=True), topology=topo, progress_bar=False) as session:
        model = llama(tied=True)
        model, _ = session.setup(model, optimizer(model.parameters(), "sgd"))
        ids = token_batches(1, 2, seq=7)[0][0]
        with torch.no_grad():
            logits = model(ids)
        try:
            model(ids)
        except pt.UsageError as e:
            return logits, str(e)


def test_sequence_parallelism_runs_any_length_under_no_grad_and_names_the_length_it_cannot_cut():
    ids = token_batches(1, 2, seq=7)[0][0]
    with torch.no_grad():
        expected = llama(tied=True)(ids)
    for logits, error in run_on_ranks(odd_lengths, 2, timeout=120):
        assert torch.allclose(logits, expected, atol=1e-12, rtol=0)
        assert "activation of shape (2, 7, 32): make the sequence length a multiple of 2" in error


def test_loss_parallelism_sends_three_numbers_per_token_not_the_logits():
    """The head's logits stay cut: the cross-entropy all-reduces the max, the sum of exponentials
    and the target's logit, b·s numbers each, where gathering them would send b·s·V / tp."""
    layers, width = 2, 32
    x, _ = token_batches(1, GLOBAL_BATCH)[0]
    b_s_h = x.numel() * width
    for calls in run_on_ranks(count_collectives, 2, layers, False, True, timeout=120):
        blocks = [("all_reduce", b_s_h)] * (2 * layers)
        assert calls == blocks + [("all_reduce", x.numel())] * 3 + blocks + [("all_reduce", b_s_h)]


def loss_parallel_errors(topo):
    """What a loss function may not do with loss-parallel logits, and that evaluation sees them whole."""
    plan = {**PLAN, "lm_head": "colwise"}
    with pt.Session(strategy=pt.Mesh(tp=2, loss_parallel=True, tp_plan=plan), topology=topo,
                    progress_bar=False) as session:
        model = llama()
        model, _ = session.setup(model, optimizer(model.parameters(), "sgd"))
        x, y = token_batches(1, GLOBAL_BATCH)[0]
        errors = []
        for loss_fn in (lambda z, t: -z.log_softmax(-1).mean(),
                        lambda z, t: torch.nn.functional.cross_entropy(z.view(-1, 64), t.flatten()),
                        lambda z, t: torch.nn.functional.cross_entropy(z.flatten(0, 1), t.flatten(), label_smoothing=0.1)):
            try:
                model.forward_backward(x, y, loss_fn, 1.0)
            except pt.UsageError as e:
                errors.append(str(e))
        with torch.no_grad():
            whole = model(x)
        masked = y.flatten().masked_fill(torch.arange(y.numel()) % 3 == 0, -100)  # ignore_index
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), masked, reduction=r).detach()
                  for r in ("mean", "sum", "none")]
        port = pt.broadcast_object(free_port() if topo.rank == 0 else None)
    try:  # the default plan gathers nothing cut by the vocabulary
        with pt.Session(strategy=pt.Mesh(tp=2, loss_parallel=True), topology=dataclasses.replace(topo, master_port=port),
                        progress_bar=False) as session:
            session.setup(llama(), None)
    except pt.ConfigError as e:
        errors.append(str(e))
    return errors, whole, masked, losses


def test_loss_parallel_logits_refuse_what_would_read_one_slice_and_are_whole_under_no_grad():
    """Its cross-entropy equals torch's on the whole logits, with ignored targets, for every
    reduction; what it refuses, it names; under no_grad the logits are whole."""
    x, _ = token_batches(1, GLOBAL_BATCH)[0]
    with torch.no_grad():
        expected = llama()(x)
    for errors, whole, masked, losses in run_on_ranks(loss_parallel_errors, 2, timeout=120):
        for r, loss in zip(("mean", "sum", "none"), losses):
            want = torch.nn.functional.cross_entropy(expected.flatten(0, 1), masked, reduction=r)
            assert torch.allclose(loss, want, atol=1e-12, rtol=0), r
        assert len(errors) == 4
        assert errors[0].startswith("log_softmax of loss-parallel logits would read this rank's slice")
        assert "view moves the vocabulary from the last dimension of loss-parallel logits ((4, 8, 32) → " in errors[1]
        assert "no class weights, no label smoothing" in errors[2]
        assert "needs the model's head, a linear layer at the top of Llama, cut 'colwise'" in errors[3]
        assert torch.allclose(whole, expected, atol=1e-12, rtol=0)
