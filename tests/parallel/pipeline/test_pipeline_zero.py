"""A pipeline whose replicas shard the optimizer (pt.Mesh(pp=..., dp="zero1" | "zero2"),
parallel/pipeline/sharded.py): parity with one process through a Session, each replica holding
its share of the optimizer state (and, under zero2, no full gradient between steps), and what it
refuses."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.parallel.pipeline import PipelineStage
from paratrain.testing import RankFailure, assert_same_params, run_on_ranks
from tests.support.pipeline_models import GLOBAL_BATCH, batches, chain, tiny_gpt

STEPS = 4


def _optimizer(model):
    # weight decay and Adam's moments step every element: a slice stepped where one process
    # would skip, or stepped twice, shows
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _session(topo, zero, schedule, m, accumulate, clip):
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    strategy = pt.Mesh(pp=pt.Pipeline(stages=2, schedule=schedule, microbatches=m, virtual=virtual), dp=zero)
    session = pt.Session(strategy=strategy, accumulate=accumulate, max_grad_norm=clip, topology=topo,
                         progress_bar=False)
    xs, ys = batches(STEPS)
    loader = DataLoader(TensorDataset(xs.flatten(0, 1), ys.flatten()), shuffle=False,
                        batch_size=GLOBAL_BATCH // accumulate)
    model = chain()
    model, opt, loader = session.setup(model, _optimizer(model), loader)
    losses = [session.train_step(batch, F.cross_entropy).item() for batch in session.progress(loader)]
    stage = session.model
    assert isinstance(stage, PipelineStage)  # the pipeline, also with tp=1 (not DDP of the whole model)
    assert (stage.sharded is not None) == (zero != "ddp")
    freed = zero != "ddp" and all(b.buffer.untyped_storage().size() == 0
                                  for sync in stage.sharded.syncs for b in sync.buckets.buckets)
    return dict(state=session.unwrap().state_dict(), losses=losses, replica=stage.replica_index,
                state_elems=sum(t.numel() for s in opt.state.values() for k, t in s.items() if k == "exp_avg"),
                stage_elems=sum(p.numel() for p in stage.module.parameters()), freed=freed)


def _sessions(topo, settings):
    return [_session(topo, *setting) for setting in settings]


def _reference(accumulate, clip):
    model = chain()
    opt = _optimizer(model)
    xs, ys = batches(STEPS)
    losses = []
    for x, y in zip(xs, ys):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            # the clip must bind on every step, or a norm summed over too few ranks goes unseen
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > clip
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


SETTINGS = [("ddp", "1f1b", 2, 1, 0.1), ("zero1", "1f1b", 3, 1, None), ("zero2", "1f1b", 4, 1, 0.1), ("zero1", "gpipe", 2, 2, 0.1),
            ("zero2", "interleaved-1f1b", 2, 2, 0.1), ("zero1", "zb-h1", 4, 1, 0.1), ("zero2", "zb-h1", 2, 2, None)]


@pytest.fixture(scope="module")
def trained():
    return run_on_ranks(_sessions, 4, SETTINGS, timeout=300)  # world 4: 2 stages × 2 replicas


@pytest.mark.parametrize("index", range(len(SETTINGS)), ids=["-".join(map(str, s)) for s in SETTINGS])
def test_pipeline_with_sharded_replicas_trains_like_one_process(trained, index):
    zero, schedule, m, accumulate, clip = SETTINGS[index]
    results = [rank[index] for rank in trained]
    expected, losses = _reference(accumulate, clip)
    for replica in (0, 1):
        state = {}
        for r in results:
            if r["replica"] == replica:
                state.update(r["state"])
        assert_same_params(state, expected, atol=1e-6)
    if accumulate == 1:  # each replica's loss is of its half of the batch, on each of its stages
        halves = {r["replica"]: r["losses"] for r in results}
        assert [(a + b) / 2 for a, b in zip(halves[0], halves[1])] == pytest.approx(losses, abs=1e-6)


@pytest.mark.parametrize("index", range(1, len(SETTINGS)), ids=["-".join(map(str, s)) for s in SETTINGS[1:]])
def test_each_replica_holds_half_of_its_stages_optimizer_state(trained, index):
    zero = SETTINGS[index][0]
    for r in (rank[index] for rank in trained):
        # its slice of every bucket, each padded to 2 equal slices: half, rounded up per bucket
        assert r["stage_elems"] / 2 <= r["state_elems"] < r["stage_elems"] / 2 + 8
        assert r["freed"] == (zero == "zero2")  # zero2 keeps no full gradient between steps


def _refused(topo, dp, model_fn):
    session = pt.Session(strategy=pt.Mesh(pp=pt.Pipeline(stages=2, microbatches=2, layers="blocks")
                                          if model_fn is tiny_gpt else pt.Pipeline(stages=2, microbatches=2),
                                          dp=dp), topology=topo, progress_bar=False)
    model = model_fn()
    xs, ys = batches(1)
    session.setup(model, _optimizer(model), DataLoader(TensorDataset(xs[0], ys[0]), batch_size=GLOBAL_BATCH))


@pytest.mark.parametrize("dp,model_fn,message", [
    (pt.ZeRO(stage=1, offload=True), chain, r"keep no master copies yet: leave ZeRO\(param_dtype=None, offload=False\)"),
    ("zero2", tiny_gpt, r"a weight tied across pipeline stages cannot be sharded by zero2 yet"),
])
def test_what_sharded_replicas_refuse_at_setup(dp, model_fn, message):
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(_refused, 2, dp, model_fn)


def test_mesh_refuses_what_a_pipelines_replicas_cannot_run():
    with pytest.raises(pt.ConfigError, match=r"average their gradients \(dp='ddp'\) or shard the optimizer "
                                              r"\(dp='zero1' or 'zero2'\); got .*dp='zero3'"):
        pt.Mesh(pp=pt.Pipeline(stages=2), dp="zero3")
    with pytest.raises(pt.ConfigError, match=r"a pipeline of tensor-parallel stages takes dp='ddp' yet"):
        pt.Mesh(tp=2, pp=pt.Pipeline(stages=2), dp="zero1")
