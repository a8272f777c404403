"""Pipeline parallelism on real ranks: parity with single-process training, and the schedules'
bubble and activation memory measured from the events each stage recorded."""

import struct

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain.distributed.topology import Topology
from paratrain.errors import ConfigError
from paratrain.parallel.pipeline import (
    Kind,
    Pipeline,
    PipelineStage,
    boundaries,
    draw,
    gpipe,
    idle_fraction,
    layer_costs,
    peak_in_flight,
    replay,
    split_model,
)
from paratrain.parallel.pipeline.timeline import by_stage
from paratrain.testing import RankFailure, assert_same_params, run_on_ranks
from tests.support.pipeline_models import GLOBAL_BATCH, STEPS, batches, block_chain, chain


def reference(steps: int = STEPS, model_fn=chain):
    """One process, the whole global batch per step: parameters and losses."""
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = batches(steps)
    losses = []
    for step in range(steps):
        loss = F.cross_entropy(model(xs[step]), ys[step])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


class _CountSends:
    """Stands in for comm.isend on a rank: counts sends started and not yet waited on (each holds
    its tensor), and the most at once."""

    def __init__(self, isend):
        self.isend, self.open, self.most = isend, 0, 0

    def __call__(self, *args, **kwargs):
        handle, counter = self.isend(*args, **kwargs), self
        self.open += 1
        self.most = max(self.most, self.open)

        class Counted:
            def wait(self):
                counter.open -= 1
                return handle.wait()
        return Counted()


def _train(topo, stages, schedule, m, virtual=1, model_fn=chain):
    import paratrain.distributed.comm
    sends = paratrain.distributed.comm.isend = _CountSends(paratrain.distributed.comm.isend)  # this rank's process only
    strategy = Pipeline(stages=stages, schedule=schedule, microbatches=m, virtual=virtual)
    model = model_fn()
    stage, opt = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                strategy.grid(topo))
    replicas, index = stage.replicas, stage.replica_index
    xs, ys = batches()
    losses, first_grads = [], None
    for step in range(STEPS):
        x, y = xs[step].chunk(replicas)[index], ys[step].chunk(replicas)[index]
        losses.append(stage.forward_backward(x, y, F.cross_entropy, 1.0).item())
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in stage.module.named_parameters()}
        opt.step()
        opt.zero_grad()
    paratrain.distributed.comm.isend = sends.isend
    return dict(state=stage.module.state_dict(), losses=losses, events=stage.gather_events(),
                replica=index, stage=stage.stage, most_sends=sends.most, grads=first_grads,
                actions=stage.actions)


def _sweep(topo, stages, settings):
    return [_train(topo, stages, *setting) for setting in settings]


def _merged(results, replica=0):
    """The full model's state from the stages of one replica (stage keys are the model's keys)."""
    state = {}
    for r in results:
        if r["replica"] == replica:
            state.update(r["state"])
    return state


SWEEPS = {  # (world, stages): settings run in one job
    (2, 2): [(s, m) for s in ("gpipe", "1f1b") for m in (1, 2, 3, 4, 8)],
    (4, 4): [(s, m) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 6, 8)],
    (4, 2): [(s, m) for s in ("gpipe", "1f1b") for m in (1, 3, 4)],  # 2 stages × 2 replicas
}


@pytest.fixture(scope="module")
def sweeps():
    return {key: run_on_ranks(_sweep, key[0], key[1], settings, timeout=240)
            for key, settings in SWEEPS.items()}


@pytest.mark.parametrize("key", list(SWEEPS))
def test_pipeline_matches_single_process(sweeps, key):
    ref_state, ref_losses = reference()
    world, stages = key
    for index, (schedule, m) in enumerate(SWEEPS[key]):
        results = [rank[index] for rank in sweeps[key]]
        for replica in range(world // stages):
            assert_same_params(_merged(results, replica), ref_state, atol=1e-6)  # measured: 1.5e-8
        if world == stages:  # one replica: its loss is the whole batch's, on every stage
            for r in results:
                assert r["losses"] == pytest.approx(ref_losses, abs=1e-6), (schedule, m)  # measured: 2.4e-7


@pytest.mark.parametrize("key", [(2, 2), (4, 4)])
def test_bubble_and_activations_in_flight_from_recorded_events(sweeps, key):
    world, p = key
    for index, (schedule, m) in enumerate(SWEEPS[key]):
        events = sweeps[key][0][index]["events"]  # every rank gathered the same pipeline's events
        assert len(events) == 2 * p * m
        uniform = replay(events)  # the recorded orders on uniform stages; raises on a deadlock
        assert idle_fraction(uniform) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (schedule, m)
        peak = peak_in_flight(events)
        if schedule == "gpipe":
            assert peak == {s: m for s in range(p)}
        else:  # stage s holds its warm-up plus one: p - s, never more than p
            assert peak == {s: min(p - s, m) for s in range(p)}
        # the measured bubble, from noisy times on a shared machine: at least what the recorded
        # order and durations force (the fastest run of them), since every action waited for its
        # input; with one micro-batch the stages run one at a time, the theory's (p-1)/p exactly
        _assert_inputs_arrived_before_use(events, p)
        fastest = idle_fraction(replay(events, measured=True))
        assert idle_fraction(events) >= fastest - 1e-9, (schedule, m)
        if m == 1:
            assert fastest == pytest.approx((p - 1) / p, abs=1e-9)


def _assert_inputs_arrived_before_use(events, p):
    """The recorded times follow the data flow: F(s, i) starts after F(s-1, i) ended (its
    activation came from there), B(s, i) after B(s+1, i) ended (its output's gradient did)."""
    end = {(e.stage, e.kind, e.microbatch): e.end for e in events}
    for e in events:
        source = e.stage - 1 if e.kind is Kind.FORWARD else e.stage + 1
        if 0 <= source < p:
            assert e.start >= end[(source, e.kind, e.microbatch)], e


def _order_by_definition(schedule, p, s, m):
    """What stage s of p runs, by the schedules' definitions: GPipe (Huang et al. 2019) every
    forward, then every backward; 1F1B (Narayanan et al. 2021) min(p-1-s, m) warm-up forwards,
    then forward i and backward i-warmup in turn, then the backwards left."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(p - 1 - s, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, m):
        order += [("F", i), ("B", i - warmup)]
    return order + [("B", i) for i in range(m - warmup, m)]


@pytest.mark.parametrize("key", list(SWEEPS))
def test_each_stage_runs_the_order_its_schedule_defines(sweeps, key):
    world, p = key
    for index, (schedule, m) in enumerate(SWEEPS[key]):
        for rank in range(p):  # every rank gathered its pipeline's events
            events = by_stage(sweeps[key][rank][index]["events"])
            for s in range(p):
                assert [(e.kind.value, e.microbatch) for e in events[s]] == \
                    _order_by_definition(schedule, p, s, m), (schedule, m, s)


@pytest.mark.parametrize("key", list(SWEEPS))
def test_a_stage_holds_one_message_per_neighbour_not_one_per_microbatch(sweeps, key):
    """Sends keep their tensors until waited on: each stage waits for its previous send to a
    neighbour before the next, so it holds at most one activation (with its shape header, two
    tensors, on the first step) and one gradient, whatever m."""
    world, p = key
    for index, (schedule, m) in enumerate(SWEEPS[key]):
        for rank, results in enumerate(sweeps[key]):
            stage = results[index]["stage"]
            neighbours = (stage > 0) + (stage < p - 1)
            assert results[index]["most_sends"] <= neighbours + 2 * (stage < p - 1), (schedule, m, rank)


NEW_SWEEPS = {  # (world, stages): (schedule, m, virtual, model) run in one job
    (2, 2): [("interleaved-1f1b", m, 2, block_chain) for m in (1, 2, 4, 6)]
    + [("zb-h1", m, 1, block_chain) for m in (1, 3, 4, 6)] + [("1f1b", 4, 1, block_chain)],
    (4, 4): [("interleaved-1f1b", m, 2, block_chain) for m in (3, 4, 8, 12)]
    + [("zb-h1", m, 1, block_chain) for m in (2, 4, 8, 12)] + [("1f1b", 8, 1, block_chain)],
    (4, 2): [("interleaved-1f1b", m, 2, block_chain) for m in (1, 2, 4)]  # × 2 replicas
    + [("zb-h1", m, 1, block_chain) for m in (2, 3)],
}


@pytest.fixture(scope="module")
def new_sweeps():
    return {key: run_on_ranks(_sweep, key[0], key[1], settings, timeout=240)
            for key, settings in NEW_SWEEPS.items()}


@pytest.mark.parametrize("key", list(NEW_SWEEPS))
def test_interleaved_and_zero_bubble_schedules_match_single_process(new_sweeps, key):
    ref_state, ref_losses = reference(model_fn=block_chain)
    world, stages = key
    for index, setting in enumerate(NEW_SWEEPS[key]):
        results = [rank[index] for rank in new_sweeps[key]]
        for replica in range(world // stages):
            assert_same_params(_merged(results, replica), ref_state, atol=1e-6)
        if world == stages:
            for r in results:
                assert r["losses"] == pytest.approx(ref_losses, abs=1e-6), setting


@pytest.mark.parametrize("key", [(2, 2), (4, 4)])
def test_zero_bubbles_split_backward_gives_the_unsplit_weight_gradients_bitwise(new_sweeps, key):
    """After the first step, ZB-H1's weight gradients (I, then W later) equal 1F1B's (one B)."""
    settings = NEW_SWEEPS[key]
    one_f_one_b = next(i for i, s in enumerate(settings) if s[0] == "1f1b")
    zero_bubble = next(i for i, s in enumerate(settings) if s[0] == "zb-h1" and s[1] == settings[one_f_one_b][1])
    for rank in new_sweeps[key]:
        split, whole = rank[zero_bubble]["grads"], rank[one_f_one_b]["grads"]
        assert split.keys() == whole.keys()
        for name in whole:
            assert torch.equal(split[name], whole[name]), name


@pytest.mark.parametrize("key", [(2, 2), (4, 4)])
def test_new_schedules_run_their_action_lists_and_idle_as_their_theory_says(new_sweeps, key):
    """Each rank's recorded compute order is its checked action list's; replayed on uniform
    stages the recorded order idles for the schedule's formula; each rank held at most the
    activations its list allows; and the recorded times follow the data flow."""
    from paratrain.parallel.pipeline.actions import COMPUTE
    from paratrain.parallel.pipeline.check import peak_alive
    from paratrain.parallel.pipeline.schedules import SCHEDULES
    world, p = key
    for index, (schedule, m, v, _) in enumerate(NEW_SWEEPS[key]):
        events = new_sweeps[key][0][index]["events"]
        for rank, results in enumerate(new_sweeps[key]):
            mine = [(a.op.value, a.microbatch, a.stage) for a in results[index]["actions"] if a.op in COMPUTE]
            ran = [(e.kind.value, e.microbatch, e.chunk * p + e.stage) for e in by_stage(events)[rank]]
            assert ran == mine, (schedule, m, rank)
            assert peak_in_flight(events)[rank] == peak_alive([results[index]["actions"]])[0], (schedule, m, rank)
            links = 2 * v  # one message held per link: each chunk's output and input gradient
            assert results[index]["most_sends"] <= 3 * links, (schedule, m, rank)
        formula = SCHEDULES[schedule].bubble(p, v, m)
        if formula is not None:
            assert idle_fraction(replay(events)) == pytest.approx(float(formula), abs=1e-12), (schedule, m)
        end = {(e.chunk * p + e.stage, e.kind.value, e.microbatch): e.end for e in events}
        for e in events:
            k = e.chunk * p + e.stage
            if e.kind is Kind.FORWARD and k > 0:
                assert e.start >= end[(k - 1, "F", e.microbatch)]
            if e.kind in (Kind.BACKWARD, Kind.INPUT) and k < p * v - 1:
                assert e.start >= max(end.get((k + 1, kind, e.microbatch), 0) for kind in ("B", "I"))


def _session(topo, stages, schedule, m, accumulate, clip):
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    session = pt.Session(strategy=Pipeline(stages=stages, schedule=schedule, microbatches=m, virtual=virtual),
                         accumulate=accumulate, max_grad_norm=clip, topology=topo, progress_bar=False)
    xs, ys = batches(4)
    loader = DataLoader(TensorDataset(xs.flatten(0, 1), ys.flatten()), shuffle=False,
                        batch_size=GLOBAL_BATCH // accumulate)
    model = chain()
    model, opt, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       loader)
    losses = [session.train_step(batch, F.cross_entropy).item() for batch in session.progress(loader)]
    return dict(state=session.unwrap().state_dict(), losses=losses, replica=session.model.replica_index)


def _sessions(topo, settings):
    return [_session(topo, *setting) for setting in settings]


def _session_reference(accumulate, clip):
    model = chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = batches(4)
    for x, y in zip(xs, ys):
        F.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


SESSIONS = [(2, "1f1b", 3, 1, None), (2, "gpipe", 2, 2, 0.5), (4, "1f1b", 6, 1, 0.5),
            (2, "interleaved-1f1b", 2, 2, 0.5), (4, "zb-h1", 6, 1, 0.5), (2, "zb-h1", 2, 2, None)]


def test_session_trains_a_pipeline_like_one_process():
    """World 4: 2 stages × 2 replicas (and 4 stages × 1), with accumulation and clipping."""
    per_rank = run_on_ranks(_sessions, 4, SESSIONS, timeout=240)
    for index, (stages, schedule, m, accumulate, clip) in enumerate(SESSIONS):
        results = [rank[index] for rank in per_rank]
        for replica in range(4 // stages):
            expected = _session_reference(accumulate, clip)
            assert_same_params(_merged(results, replica), expected, atol=1e-6)  # measured: 3.0e-8


def _infer(topo, stages, m):
    """One training step, then inference forwards of uneven sizes, then a forward with grad on."""
    strategy = Pipeline(stages=stages, microbatches=m)
    model = chain()
    stage, opt = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                strategy.grid(topo))
    replicas, index = stage.replicas, stage.replica_index
    xs, ys = batches(1)
    stage.forward_backward(xs[0].chunk(replicas)[index], ys[0].chunk(replicas)[index], F.cross_entropy, 1.0)
    opt.step()
    stage.eval()
    with torch.no_grad():  # 10 rows in m micro-batches that need not divide them, then 7
        outputs = [stage(xs[0][:10]), stage(xs[0][:7])]
    with pytest.raises(pt.UsageError, match="under torch.no_grad"):
        stage(xs[0])
    return outputs


@pytest.mark.parametrize("world,stages,m", [(2, 2, 4), (4, 4, 3), (4, 2, 4)])
def test_inference_forward_gives_the_models_output_on_every_rank(world, stages, m):
    model = chain()
    model.load_state_dict(reference(steps=1)[0])
    x = batches(1)[0][0]
    with torch.no_grad():
        expected = [model(x[:10]), model(x[:7])]
    for outputs in run_on_ranks(_infer, world, stages, m):
        for out, exp in zip(outputs, expected):
            torch.testing.assert_close(out, exp, atol=1e-6, rtol=0)  # measured: 3.0e-8


def _bn_chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 16),
                         nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 5))


def _batchnorm(topo, settings):
    """A chain with BatchNorm on 2 stages (× 2 replicas at world 4, which see different data),
    for each (schedule, m): the stage's state after training, and its output in evaluation."""
    out = []
    for schedule, m in settings:
        strategy = Pipeline(stages=2, schedule=schedule, microbatches=m)
        model = _bn_chain()
        stage, opt = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy.grid(topo))
        replicas, index = stage.replicas, stage.replica_index
        xs, ys = batches()
        for x, y in zip(xs, ys):
            stage.forward_backward(x.chunk(replicas)[index], y.chunk(replicas)[index], F.cross_entropy, 1.0)
            opt.step()
            opt.zero_grad()
        state = {k: v.clone() for k, v in stage.module.state_dict().items()}
        stage.eval()
        with torch.no_grad():
            out.append(dict(state=state, replica=index, output=stage(xs[0])))
    return out


def _batchnorm_reference(replicas, m):
    """One process: each replica's micro-batches with their own statistics, gradients averaged;
    the running statistics that go on are replica 0's (replicas take them before each step)."""
    model = _bn_chain()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = batches()
    for x, y in zip(xs, ys):
        for replica, (xr, yr) in enumerate(zip(x.chunk(replicas), y.chunk(replicas))):
            kept = [b.clone() for b in model.buffers()]
            for xm, ym in zip(xr.chunk(m), yr.chunk(m)):
                (F.cross_entropy(model(xm), ym) / (m * replicas)).backward()
            if replica:
                for b, k in zip(model.buffers(), kept):
                    b.copy_(k)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


BN_SETTINGS = {2: [("gpipe", 2), ("1f1b", 4)], 4: [("1f1b", 2)]}


@pytest.fixture(scope="module")
def batchnorm():
    return {world: run_on_ranks(_batchnorm, world, settings) for world, settings in BN_SETTINGS.items()}


@pytest.mark.parametrize("world", list(BN_SETTINGS))
def test_pipeline_with_batchnorm_matches_single_process(batchnorm, world):
    """Parameters and running statistics: each micro-batch normalised by its own statistics,
    which update the running ones in micro-batch order, as one process running the micro-batches
    one after another."""
    for index, (schedule, m) in enumerate(BN_SETTINGS[world]):
        ref = _batchnorm_reference(world // 2, m)
        results = [rank[index] for rank in batchnorm[world]]
        for replica in range(world // 2):
            state = {}
            for r in results:
                if r["replica"] == replica:
                    state.update(r["state"])
            if replica:  # its running statistics are its own until the next step takes replica 0's
                state = {k: v for k, v in state.items() if "running" not in k and "batches" not in k}
                assert_same_params(state, {k: ref[k] for k in state}, atol=1e-6)  # measured: 6.0e-8
            else:
                assert_same_params(state, ref, atol=1e-6)  # measured: 6.0e-8


def test_replicas_take_replica_0s_batchnorm_statistics_so_every_rank_evaluates_alike(batchnorm):
    outputs = [rank[0]["output"] for rank in batchnorm[4]]
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], atol=0, rtol=0)


def test_timeline_picture_is_a_png(tmp_path):
    events = replay(_fake_events(3, 4))
    draw({"GPipe": events}, str(tmp_path / "t.png"), unit="forward times")
    header = (tmp_path / "t.png").read_bytes()[:8]
    assert header == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">I", (tmp_path / "t.png").read_bytes()[16:20])[0] > 100  # width


def _fake_events(p, m):
    """GPipe's per-stage order for p stages and m micro-batches (times filled in by replay)."""
    from paratrain.parallel.pipeline import Event, Kind
    return [Event(s, kind, i, 0.0, 0.0, 0) for s in range(p) for kind in (Kind.FORWARD, Kind.BACKWARD)
            for i in range(m)]


# -- misuse ----------------------------------------------------------------------------------------

def test_more_stages_than_layers_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot cut 9 layers into 10 stages"):
        split_model(chain(), 10)


def test_microbatches_must_divide_the_batch():
    stage = PipelineStage(nn.Linear(12, 5), stage=0, stages=1, schedule=gpipe, microbatches=4,
                          pipe_group=None, dp_group=None, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="4 micro-batches do not divide this stage's batch of 6"):
        stage.forward_backward(torch.randn(6, 12), torch.zeros(6, dtype=torch.long), F.cross_entropy)


@pytest.mark.parametrize("batch,drop_last,message", [
    (6, False, "cuts each replica's batch into 4 equal micro-batches, but each replica reads batches of 6"),
    (8, False, "the last batch of each epoch holds 6 samples per replica.*drop_last=True"),
    (8, True, None),  # 30 samples: 3 full batches of 8, the 6 left are dropped
])
def test_setup_refuses_a_loader_whose_batches_do_not_cut_into_microbatches(batch, drop_last, message):
    with pt.Session(Pipeline(stages=1, microbatches=4), progress_bar=False) as session:
        model = chain()
        data = TensorDataset(torch.randn(30, 12), torch.randint(0, 5, (30,)))
        loader = DataLoader(data, batch_size=batch, drop_last=drop_last)
        if message is None:
            _, _, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
            assert [len(x) for x, _ in loader] == [8, 8, 8]
        else:
            with pytest.raises(ConfigError, match=message):
                session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)


def test_stages_must_divide_the_world():
    topo = Topology.from_env({}, rank=0, world_size=4)
    with pytest.raises(ConfigError, match=r"stages=3\) does not divide the world size 4"):
        Pipeline(stages=3).grid(topo)


def _three_stages_on_four(topo):
    pt.Session(strategy=Pipeline(stages=3), topology=topo).setup(chain())


def test_stages_not_dividing_the_world_fails_at_setup_on_ranks():
    with pytest.raises(RankFailure, match="does not divide the world size 4"):
        run_on_ranks(_three_stages_on_four, 4, timeout=60)


@pytest.mark.parametrize("kwargs,message", [(dict(schedule="zb"), "unknown pipeline schedule"),
                                            (dict(microbatches=0), "microbatches >= 1"),
                                            (dict(balance="flops"), "balance must be one of")])
def test_bad_pipeline_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Pipeline(**kwargs)


def test_a_model_that_is_not_a_chain_is_refused():
    with pytest.raises(ConfigError, match="nn.Sequential"):
        split_model(nn.Linear(2, 2), 2)


# -- partition -------------------------------------------------------------------------------------

def test_balance_by_parameters_and_by_time():
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    assert boundaries(layer_costs(model, "params"), 2) == [0, 1, 4]  # the big layer alone
    assert boundaries([1.0] * 9, 4) == [0, 3, 5, 7, 9]
    costs = layer_costs(model, "time", torch.randn(64, 100))
    assert len(costs) == 4 and all(c > 0 for c in costs)
    stages = split_model(chain(), 3)
    assert [list(dict(s.named_children())) for s in stages] == [["0", "1", "2"], ["3", "4", "5"],
                                                               ["6", "7", "8"]]


# -- replicas: a stage's full bucket starts its all-reduce while its backward continues -------------

def _replica_launch_order(topo):
    """2 stages × 2 replicas, a bucket per parameter; this stage's log of its last micro-batch's
    backward (the one that synchronises): each bucket's all-reduce start, and a point inside it."""
    from paratrain.parallel import buckets
    from paratrain.parallel.buckets import AllReduce

    log: list[str] = []

    class Logged(AllReduce):
        def start(self, bucket):
            log.append(f"start bucket {bucket.index}")
            super().start(bucket)

    buckets.FIRST_BUCKET_BYTES, buckets.DEFAULT_BUCKET_MB = 1, 1e-9  # default_caps(), this rank's process only
    strategy = Pipeline(stages=2, schedule="1f1b", microbatches=2)
    model = chain()
    stage, _ = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy.grid(topo))
    stage._grad_syncs[0].set_reduction(Logged(group=stage.dp_group))

    def note_middle(module, args, out):
        out.register_hook(lambda grad: log.append("first layer's output gradient"))

    next(m for m in stage.module.modules() if isinstance(m, nn.Linear)).register_forward_hook(note_middle)
    xs, ys = batches()
    stage.forward_backward(xs[0].chunk(2)[stage.replica_index], ys[0].chunk(2)[stage.replica_index],
                           F.cross_entropy, 1.0)
    log.append("forward_backward returned")
    return log, len(stage._grad_syncs[0].buckets.buckets)


def test_a_replicated_stage_starts_each_full_buckets_all_reduce_while_backward_continues():
    marker = "first layer's output gradient"
    for log, buckets in run_on_ranks(_replica_launch_order, 4):
        unsynced, synced = log[:log.index(marker)], log[log.index(marker) + 1:]
        assert unsynced == [], log  # micro-batch 0's backward does not synchronise
        middle = synced.index(marker)  # inside micro-batch 1's backward
        # the buckets of the stage's later layers (a weight and a bias each) launch before the
        # gradient reaches its first layer; the first layer's own two after it, still in backward
        assert buckets > 2 and synced[:middle] == [f"start bucket {i}" for i in range(buckets - 2)], log
        assert synced[middle + 1:] == [f"start bucket {buckets - 2}", f"start bucket {buckets - 1}",
                                       "forward_backward returned"], log
