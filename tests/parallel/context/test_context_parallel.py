"""Context parallelism (parallel/context/) proved by parity: a Llama-style model (rotary
positions, grouped-query attention, causal SDPA) and transformers' LlamaForCausalLM trained
through `Session(strategy=pt.Mesh(cp=...))` end with the parameters one process reaches on the
same global batches. float64 with Adam: the ring sums each query's attention in another order,
and Adam divides such last-bit differences by √v, which fp32 would carry past 1e-6."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.distributed.comm import ByteCounter
from paratrain.distributed.topology import free_port
from paratrain.errors import ConfigError, UsageError
from paratrain.testing import run_on_ranks
from tests.support.llama import llama, lm_loss, token_batches

STEPS, GLOBAL_BATCH, SEQ = 3, 4, 16


def batches(masked=False):
    """(ids, targets) per step; `masked`: the last targets of each sequence are -100 (so the cp
    ranks hold unequal numbers of valid tokens: rank 0 holds the sequence's last chunk)."""
    out = token_batches(STEPS, GLOBAL_BATCH, seq=SEQ)
    if masked:
        out = [(x, torch.cat([y[:, :-3], torch.full_like(y[:, -3:], -100)], dim=1)) for x, y in out]
    return out


def loader(masked=False):
    data = batches(masked)
    return DataLoader(TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])),
                      batch_size=GLOBAL_BATCH, shuffle=False)


def hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).double()


def build(hf=False, **kwargs):
    return hf_model() if hf else llama(**kwargs)


def reference(hf=False, masked=False, weight=None, ckpt=False, **kwargs):
    """One process, the same global batches, the same loop as the session's."""
    model = build(hf, **kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in loader(masked):
        (model(input_ids=x, labels=x).loss if hf else lm_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def train(topo, strategy, hf=False, masked=False, weight=None, ckpt=False, **kwargs):
    """`ckpt`: activation checkpointing of every block, recomputed in backward under the routing."""
    with pt.Session(strategy=strategy, topology=topo, progress_bar=False,
                    activation_checkpointing="auto" if ckpt else None) as session:
        model = build(hf, **kwargs)
        data = loader(masked)
        if hf:
            data = DataLoader([dict(input_ids=x) for x, _ in data.dataset], batch_size=GLOBAL_BATCH)
        model, _, data = session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2), data)
        for batch in session.progress(data):
            if hf:
                session.train_step(dict(batch, labels=batch["input_ids"]), weight=weight)
            else:
                session.train_step(batch, lm_loss, weight=weight)
        whole = session.full_state_dict()
        port = pt.broadcast_object(free_port() if topo.rank == 0 else None)
    return dict(whole=whole if topo.rank == 0 else None, replica=model.replica_index, port=port)


def sweep(topo, cases):
    out = []
    for strategy, kwargs in cases:
        out.append(train(topo, strategy, **kwargs))
        topo = dataclasses.replace(topo, master_port=out[-1]["port"])
    return out


def assert_close(got, want, atol=1e-6):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], atol=atol, rtol=0), (k, (got[k] - want[k]).abs().max().item())


CASES = {  # world → (strategy, training settings), run in one job each
    2: [(pt.Mesh(cp=2), {}), (pt.Mesh(cp=2), dict(positioned=True)), (pt.Mesh(cp=2, cp_mode="all-to-all"), {}),
        (pt.Mesh(cp=2, cp_mode="all-gather"), dict(masked=True)),
        (pt.Mesh(cp=2), dict(masked=True)), (pt.Mesh(cp=2), dict(masked=True, weight="tokens")),
        (pt.Mesh(cp=2), dict(hf=True)), (pt.Mesh(cp=2), dict(hf=True, weight="tokens")),
        # each rank of a tp group passes the same weight: normalised by the world, not the replicas
        (pt.Mesh(tp=2), dict(masked=True, weight="tokens")), (pt.Mesh(cp=2), dict(masked=True, ckpt=True))],
    4: [(pt.Mesh(cp=2, dp="ddp"), dict(masked=True)), (pt.Mesh(cp=2, dp="zero3"), {}), (pt.Mesh(cp=2, tp=2), {}),
        (pt.Mesh(cp=4), dict(masked=True)), (pt.Mesh(cp=2, dp="zero1"), dict(masked=True, weight="tokens")),
        (pt.Mesh(cp=4, cp_mode="all-gather"), {})],
}


@pytest.fixture(scope="module")
def runs():
    return {world: run_on_ranks(sweep, world, cases, timeout=400) for world, cases in CASES.items()}


@pytest.mark.parametrize("world,index", [(w, i) for w, cases in CASES.items() for i in range(len(cases))])
def test_context_parallel_training_matches_one_process(runs, world, index):
    strategy, kwargs = CASES[world][index]
    results = [rank[index] for rank in runs[world]]
    assert_close(results[0]["whole"], reference(**kwargs))
    # the ranks of a cp (and tp) group read the same batches: one replica
    replicas = world // (strategy.cp * strategy.tp)
    assert sorted(r["replica"] for r in results) == sorted(r // (strategy.cp * strategy.tp) for r in range(world))
    assert max(r["replica"] for r in results) == replicas - 1


class MaskedAttention(torch.nn.Module):
    """Attention that passes what cp cannot route: an attn_mask, or dropout."""

    def __init__(self, mask=False, dropout=0.0):
        super().__init__()
        self.proj, self.mask, self.dropout = torch.nn.Linear(8, 8).double(), mask, dropout

    def forward(self, x):
        q = self.proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
        mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril() if self.mask else None
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=self.dropout,
                                              is_causal=not self.mask).transpose(1, 2).flatten(-2)


def refusals(topo):
    """Each input cp cannot take, through a session of its own: the error each rank raised."""
    x = torch.randn(2, 16, 8, dtype=torch.float64)
    mse = lambda out, y: F.mse_loss(out, y)  # noqa: E731
    cases = [
        (pt.Mesh(cp=2), lambda: MaskedAttention(mask=True), (x, x)),
        (pt.Mesh(cp=2), lambda: MaskedAttention(dropout=0.1), (x, x)),
        (pt.Mesh(cp=2), lambda: MaskedAttention(), (x[:, :14], x[:, :14])),
        (pt.Mesh(cp=2), hf_model, dict(input_ids=torch.ones(2, 16, dtype=torch.long),
                                       attention_mask=torch.ones(2, 16, dtype=torch.long).tril(8)[:, :16])),
        (pt.Mesh(cp=2, cp_mode="all-to-all"), lambda: llama(width=24, heads=3, kv_heads=3), token_batches(1, 2, seq=16)[0]),
    ]
    out = []
    for strategy, make, batch in cases:
        with pt.Session(strategy=strategy, topology=topo, progress_bar=False) as session:
            model = make()
            model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            try:
                loss = lm_loss if isinstance(batch, tuple) and batch[0].dtype == torch.long else mse
                session.train_step(batch, None if isinstance(batch, dict) else loss)
                out.append(None)
            except (UsageError, ConfigError) as e:
                out.append((type(e).__name__, str(e)))
            topo = dataclasses.replace(topo, master_port=pt.broadcast_object(free_port() if topo.rank == 0 else None))
    return out


def test_what_cp_cannot_cut_or_route_is_refused_by_name():
    errors = run_on_ranks(refusals, 2, timeout=200)
    assert errors[0] == errors[1]
    expected = [("UsageError", "this call passed an attn_mask of shape (8, 8)"),  # built for the local 8 of 16
                ("UsageError", "asked for dropout_p=0.1 inside attention"),
                ("ConfigError", "14 tokens do not divide by 4: make the sequence length a multiple of 4 (12 or 16)"),
                ("UsageError", "this batch's attention_mask pads some of them"),
                ("ConfigError", "3 query heads / 3 key-value heads do not divide by 2: use cp_mode='ring'")]
    for got, (kind, text) in zip(errors[0], expected):
        assert got is not None and got[0] == kind and text in got[1], (got, text)


def test_mesh_refuses_bad_cp_settings_before_any_rank_starts():
    with pytest.raises(ConfigError, match="a positive integer; got 0"):
        pt.Mesh(cp=0)
    with pytest.raises(ConfigError, match="choose 'ring', 'all-to-all' or 'all-gather'"):
        pt.Mesh(cp=2, cp_mode="ulysses")
    with pytest.raises(ConfigError, match=r"Mesh\(cp=..., pp=...\) is not supported yet"):
        pt.Mesh(cp=2, pp=pt.Pipeline(stages=2, microbatches=2))


def saved_bytes(model, x, y):
    """Bytes autograd keeps from one forward for its backward: the activations (a tensor once,
    by its storage; the parameters, which do not grow with the sequence, left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model(x), y)
    loss.backward()
    return sum(seen.values())


def bytes_and_memory(topo, cp):
    """The bytes of K and V one step sends, and the activation bytes it keeps, on this rank."""
    with pt.Session(strategy=pt.Mesh(cp=cp), topology=topo, progress_bar=False) as session:
        model = llama(layers=3)
        model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = token_batches(1, 2, seq=32)[0]
        model.counter = ByteCounter()
        model.forward_backward(x, y, lm_loss, 1.0)
        sent = model.counter.sent
        # the same forward on this rank's cut, routed, with autograd's saved tensors counted
        from paratrain.parallel.context import sharding
        from paratrain.parallel.context.routing import Cut, routed
        with routed(Cut(model.group, model.cp_rank, cp, 32)):
            kept = saved_bytes(session.unwrap(), sharding.cut(x, model.cp_rank, cp), sharding.cut(y, model.cp_rank, cp))
    return sent, kept


@pytest.mark.parametrize("cp", [2, 4])
def test_each_layer_sends_the_cp_minus_1_over_cp_of_k_and_v_and_keeps_1_over_cp_of_the_activations(cp):
    layers, batch, heads, head_dim, seq = 3, 2, 4, 8, 32  # the model repeats its 2 kv heads for SDPA: 4 travel
    results = run_on_ranks(bytes_and_memory, cp, cp, timeout=200)
    whole_kv = 2 * batch * heads * seq * head_dim * 8  # K and V of one layer, float64
    assert [sent for sent, _ in results] == [layers * whole_kv * (cp - 1) // cp] * cp
    x, y = token_batches(1, 2, seq=32)[0]
    one = saved_bytes(llama(layers=3), x, y)
    for _, kept in results:
        assert kept <= one / cp * 1.05, (kept, one)


def save_then_load_elsewhere(topo, path):
    """Train at cp 2 with ZeRO-3 (shards over dp × cp), save; load under plain DDP."""
    with pt.Session(strategy=pt.Mesh(cp=2, dp="zero3"), topology=topo, progress_bar=False) as session:
        model = llama()
        model, _, data = session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2), loader())
        for batch in session.progress(data):
            session.train_step(batch, lm_loss)
        session.save(path)
        saved = session.full_state_dict()
        topo = dataclasses.replace(topo, master_port=pt.broadcast_object(free_port() if topo.rank == 0 else None))
    with pt.Session(strategy="ddp", topology=topo, progress_bar=False) as session:
        model = llama(seed=5)
        session.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))
        session.load(path)
        return saved, session.full_state_dict()


def test_a_checkpoint_saved_under_cp_loads_under_another_strategy(tmp_path):
    for saved, loaded in run_on_ranks(save_then_load_elsewhere, 2, str(tmp_path / "ckpt"), timeout=200):
        assert_close(loaded, saved, atol=0)
