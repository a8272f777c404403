"""`paratrain plan` (plan/plan_cli.py) and its calibration (plan/cluster/calibrate.py), in this process
except for the calibration's two ranks."""

import dataclasses
import json
import re

import pytest
import torch

import paratrain as pt
from paratrain.cli import main as cli
from paratrain.plan.cluster import calibrate as cal
from paratrain.plan.cluster.cluster import Link, save_cluster
from paratrain.plan.cluster.presets import load_cluster, preset
from paratrain.plan.cost.comm_model import TERMS, ring_all_reduce_terms
from paratrain.plan.cost.memory import predict
from paratrain.plan.cost.step_time import gradient_copy, zero3_local_copies
from paratrain.plan.model.probe import model_facts
from paratrain.plan.model.source import resolve
from paratrain.plan.recommend import predict_time


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        cli.main(["plan", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_fit_recovers_alpha_and_beta_of_exact_timings():
    alpha, beta = 50e-6, 2e9
    points = [(size, TERMS[op](n).time(size, Link(beta, alpha)), TERMS[op](n))
              for op in TERMS for n in (2, 4) for size in (1e3, 1e5, 1e7)]
    link = cal.fit(points)
    assert link.latency == pytest.approx(alpha, rel=1e-9) and link.bandwidth == pytest.approx(beta, rel=1e-9)


def test_fit_clamps_a_negative_latency_to_zero():
    """Ring all-reduce at n = 2 costs 2α + S/β. Timings of 1 ns/byte, the smallest message at half
    that, fit a negative α; with α = 0, 1/β = Σ(S/t) / Σ(S/t)² over relative errors:
    S/t = 2e9, 1e9, 1e9, so 1/β = 4e9 / 6e18 and β = 1.5 GB/s."""
    terms = ring_all_reduce_terms(2)
    points = [(1e3, 0.5e-6, terms), (1e6, 1e-3, terms), (1e8, 0.1, terms)]
    link = cal.fit(points)
    assert link.latency == 0.0 and link.bandwidth == pytest.approx(1.5e9)


def test_the_model_facts_print_and_the_json_follows_the_schema(capsys):
    code, out, _ = run(capsys, "tests.support.models:MLP", "--batch", "4")
    assert code == 0
    assert f"model tests.support.models:MLP: {12 * 33 + 33 + 33 * 33 + 33 + 33 * 5 + 5:,} parameters" in out
    assert "no repeated blocks for activation checkpointing" in out  # an MLP: no blocks to checkpoint

    code, out, _ = run(capsys, "tests.support.models:MLP", "--batch", "4", "--activation-checkpointing", "none",
                       "--cluster", "a100-8x", "--json")
    got = json.loads(out)
    facts = model_facts(resolve("tests.support.models:MLP"), 4, activation_checkpointing=None)
    assert got["schema"] == "paratrain.plan/0" and got["calibrated"] is None
    assert set(got) == {"schema", "model", "cluster", "compute_seconds", "calibrated", "accumulate", "nodes",
                        "strategies", "recommended", "fit_advice", "search"}
    assert got["accumulate"] == 1  # no --gpus:
    assert got["strategies"] is None and got["recommended"] is None and got["nodes"] is None
    model = got["model"]
    assert set(model["step"]) == {  # each documented in plan_cli's docstring
        "flops_forward", "flops_backward", "activation_bytes", "transient_bytes", "block_activation_bytes",
        "block_output_bytes", "block_flops", "lead_flops", "lead_activation_bytes", "extended", "matmuls",
        "traffic", "checkpointed", "attention_kv_bytes", "attention_calls", "weight_copy_bytes"}
    assert [tuple(shape[:5]) for shape, _ in model["step"]["matmuls"]] == \
        [tuple(shape[:5]) for shape, _ in facts.step.matmuls]
    assert model["step"]["traffic"] == list(facts.step.traffic) and len(model["step"]["traffic"]) == 4
    assert model["params"] == facts.params == 1721 and model["tokens"] == 4 and model["seq"] is None
    assert model["step"]["flops_forward"] == facts.step.flops_forward
    assert model["step"]["activation_bytes"] == facts.step.activation_bytes
    assert model["checkpointed"] is None
    assert model["flops_per_token"]["forward"] == facts.step.flops_forward / 4
    assert got["cluster"]["name"] == "a100-8x"
    rate = preset("a100-8x").flops("fp32")
    assert got["compute_seconds"]["step"] == pytest.approx(
        (facts.step.flops_forward + facts.step.flops_backward) / rate)


def test_gpus_adds_each_strategys_memory_per_rank(capsys):
    """The rows are memory.predict's for each strategy's defaults on the meta-built model, the
    batch's activations split over the ranks; a strategy that cannot run the model says why."""
    import paratrain as pt

    code, out, _ = run(capsys, "tests.support.models:MLP", "--batch", "8", "--gpus", "2", "--optimizer", "sgd-momentum", "--json")
    got = json.loads(out)
    assert code == 0
    rows = {row["label"]: row for row in got["strategies"]}
    assert [r["strategy"] for r in got["strategies"]] == ["ddp", "hierarchical"] + ["zero1", "zero2", "zero3"] * 2 + [
        "pipeline"] + ["mesh"] * 3
    assert list(rows)[5:8] == ["zero1+offload", "zero2+offload", "zero3+offload"]  # no cluster: every row
    assert "cuts an nn.Sequential" in got["strategies"][8]["error"]  # an MLP module is no Sequential
    assert list(rows)[9:] == ["tp2 x ddp", "tp2 x zero1", "tp2 x zero3"]
    assert all("has no plan and no stack of identical blocks" in r["error"] for r in got["strategies"][9:])
    step = got["model"]["step"]
    activations = max(step["transient_bytes"], step["activation_bytes"])  # StepCount.activation_peak_bytes
    for name, strategy in (("ddp", pt.DDP()), ("zero3", pt.ZeRO(stage=3)),
                           ("zero3+offload", pt.ZeRO(stage=3, offload=True))):
        want = predict(resolve("tests.support.models:MLP").build(), strategy, world=2, optimizer="sgd-momentum",
                       activation_bytes=activations)[0]
        assert (rows[name]["params"], rows[name]["grads"], rows[name]["optimizer"]) == \
            (want.params, want.grads, want.optimizer)
        assert rows[name]["activations"] == activations // 2 and rows[name]["device_peak"] == want.device_peak
    assert rows["zero3"]["params"] < rows["ddp"]["params"]

    code, out, _ = run(capsys, "tests.support.models:MLP", "--gpus", "1")
    assert code == 0 and "memory per rank on 1 device(s), adam" in out
    assert [line.split()[0] for line in out.splitlines()[-9:]] == ["single", "ddp", "hierarchical", "zero1", "zero2",
                                                                   "zero3", "zero1+offload", "zero2+offload",
                                                                   "zero3+offload"]  # no pipeline of one stage


def test_a_transformers_preset_with_checkpointing(capsys):
    code, out, _ = run(capsys, "gpt2", "--seq", "64", "--json")
    model = json.loads(out)["model"]
    assert code == 0 and model["seq"] == 64 and model["tokens"] == 64
    assert model["checkpointed"]["checkpointed"] == [f"transformer.h.{i}" for i in range(12)]
    assert model["checkpointed"]["activation_bytes"] < model["step"]["activation_bytes"]
    assert "12 identical blocks" in model["notes"][0]


@pytest.mark.parametrize("argv,says", [
    (["tests.support.models:MLP", "--cluster", "dgx-9000"], "no cluster preset or file 'dgx-9000': choose one of cpu-here, h100-8x, a100-8x"),
    (["plan_test_missing_module:build"], "cannot import plan_test_missing_module"),
    (["tests.support.models:MLP", "--batch", "0"], "batch and seq must be at least 1"),
    (["tests.support.models:MLP", "--gpus", "0"], "--gpus must be at least 1; got 0"),
    (["tests.support.models:MLP", "--gpus", "8", "--nodes", "3", "--cluster", "h100-8x"],
     "--nodes 3 cannot hold 8 devices evenly: give a number of nodes that divides --gpus 8 (1, 2, 4, 8)"),
    (["tests.support.models:MLP", "--gpus", "16", "--nodes", "1", "--cluster", "h100-8x"],
     "16 devices on 1 node(s) is 16 per node, but a node of h100-8x holds 8: give --nodes 2 or more"),
    (["tests.support.models:MLP", "--gpus", "6", "--nodes", "0"], "--nodes 0 cannot hold 6 devices evenly"),
    (["tests.support.models:MLP", "--nodes", "2"], "--nodes 2 spreads the devices of --gpus over nodes: give --gpus N too"),
    (["tests.support.models:MLP", "--batch", "10", "--accumulate", "4"],
     "--accumulate 4 splits --batch 10 into micro-batches: give a --batch that is a multiple of it"),
    (["tests.support.models:MLP", "--accumulate", "0"], "--accumulate 0 splits --batch 1 into micro-batches"),
    ([], "name a MODEL to plan, or --calibrate OUT.json"),
])
def test_bad_input_is_one_line_and_exit_status_2(capsys, argv, says):
    code, out, err = run(capsys, *argv)
    assert code == 2 and not out
    assert err.count("\n") == 1 and err.startswith("paratrain plan: error: ") and says in err


def test_a_factory_that_raises_is_named(capsys, tmp_path, monkeypatch):
    (tmp_path / "plan_raising_factory.py").write_text("def build():\n    raise RuntimeError('no weights here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, "plan_raising_factory:build")
    assert code == 2
    assert err == ("paratrain plan: error: the model factory plan_raising_factory:build raised "
                   "RuntimeError: no weights here\n")


@pytest.mark.multiprocess  # calibrate times collectives on ranks it starts
def test_calibrate_writes_a_cluster_file_of_this_machine(capsys, tmp_path, monkeypatch):
    tiny = cal.Settings(sizes=(2**10, 2**20, 2**22), repeats=1, trials=3, matmul_size=64, matmul_seconds=0.02,
                        matmul_grid=(8, 64), shape_seconds=0.003, optimizer_sizes=(2**10, 2**14),
                        cold_bytes=2**20)
    monkeypatch.setattr("paratrain.cli.plan.QUICK", tiny)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this CPU's path, on a GPU machine too
    path = tmp_path / "here.json"
    code, out, err = run(capsys, "--calibrate", str(path), "--quick")
    assert code == 0 and f"wrote {path}" in out, err
    cluster = load_cluster(path)
    assert cluster.device == "cpu" and cluster.backend == "gloo" and cluster.matmul_efficiency == 1.0
    assert cluster.peak_flops["fp32"] > 0 and cluster.intra.bandwidth > 0 and cluster.intra.latency >= 0
    assert set(cluster.measured["collectives"]) == set(TERMS)
    assert set(cluster.collective_links) <= set(TERMS)  # a fit lost in noise is left out, said why
    assert all(isinstance(link, Link) for link in cluster.collective_links.values())
    assert all(len(fit["points"]) == 3 for fit in cluster.measured["collectives"].values())
    assert "measured by paratrain plan --calibrate" in cluster.sources["all"]
    table = cluster.matmul_rates["fp32"]  # every shape of the grid, each with its rate
    assert sorted(tuple(row[:3]) for row in table) == [(m, k, n) for m in (8, 64) for k in (8, 64) for n in (8, 64)]
    assert all(row[3] > 0 for row in table) and cluster.matmul_rate("fp32")(64, 64, 64) == table[-1][3]
    assert [size for size, _ in cluster.optimizer_rates] == [2**10, 2**14]
    assert all(rate > 0 for _, rate in cluster.optimizer_rates) and cluster.traffic_rate > 0


def test_calibrating_on_one_gpu_says_what_to_do(capsys, tmp_path, monkeypatch):
    """nccl needs a GPU per rank, so one GPU cannot time a collective: refused before measuring."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, out, err = run(capsys, "--calibrate", str(tmp_path / "gpu.json"), "--quick")
    assert code == 2 and "needs 2 ranks, and this machine has one GPU" in err, (code, err)
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.slow
def test_a_transformers_config_file(capsys, tmp_path):
    """A Llama of width 64, 3 layers, 4 heads (2 key/value heads), MLP 128, vocabulary 100:
    2·V·C + L·(2·C² + 2·C·kv·C/heads + 3·C·I + 2·C) + C parameters; its context length is the
    default sequence."""
    config = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=100, max_position_embeddings=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, out, _ = run(capsys, str(tmp_path / "config.json"), "--json")
    model = json.loads(out)["model"]
    c, layers = 64, 3
    assert code == 0 and model["seq"] == 32
    assert model["params"] == 2 * 100 * c + layers * (2 * c * c + 2 * c * 2 * 16 + 3 * c * 128 + 2 * c) + c


@pytest.mark.slow
def test_gpus_and_a_cluster_time_each_strategy_and_recommend_the_fastest_that_fits(capsys):
    """The issue's own command: a table and a recommendation, from fake tensors."""
    argv = ("gpt2-xl", "--gpus", "8", "--cluster", "h100-8x", "--batch", "8", "--seq", "1024", "--precision", "bf16")
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    assert "step time per strategy on 8 h100-8x device(s) (1 node(s))" in out
    code, out, err = run(capsys, *argv, "--json")
    plan = json.loads(out)
    rows = [r for r in plan["strategies"] if "error" not in r]
    assert {r["label"] for r in rows} >= {"ddp", "zero1", "zero2", "zero3", "pipeline 8x8", "pipeline 2x2"}
    for r in rows:  # the parts add up, and the speed follows from the step time
        assert r["step_seconds"] == pytest.approx(r["compute_seconds"] + r["exposed_comm_seconds"] + r["bubble_seconds"]
                                                  + r["optimizer_seconds"])
        assert r["optimizer_seconds"] > 0  # the preset's HBM bandwidth gives Adam a rate
        assert r["per_device_per_second"] == pytest.approx(8 * 1024 / r["step_seconds"] / 8)
        assert r["fits"] == (r["device_peak"] <= 80 * 2**30) and 0 < r["mfu"] < 0.6  # at most the achievable
    best = max((r for r in rows if r["fits"]), key=lambda r: r["per_device_per_second"])
    assert plan["recommended"] == best["session"] and plan["fit_advice"] is None
    assert f"recommended: {best['session']}" in run(capsys, *argv)[1]
    by = {r["label"]: r for r in rows}  # zero3 moves its parameters twice more than ddp: slower, smaller
    assert by["zero3"]["comm_seconds"] > by["ddp"]["comm_seconds"] and by["zero3"]["device_peak"] < by["ddp"]["device_peak"]


@pytest.mark.slow
def test_offload_rows_step_on_the_host_and_copy_over_its_link(capsys, tmp_path):
    """On a GPU cluster ZeRO's stages with offload are rows of their own: the host's cores step
    this rank's shards (at the preset's host rate) and the copies over PCIe are exposed (step_time.
    offload, by hand in tests/plan/cost/test_step_time.py); the device holds less. On a CPU cluster there are
    none, and a node's host memory too small for the offloaded state does not fit."""
    from paratrain.plan.cost.traffic import traffic

    argv = ("gpt2", "--gpus", "8", "--cluster", "h100-8x", "--batch", "8", "--seq", "128", "--json")
    plan = json.loads(run(capsys, *argv)[1])
    assert plan["search"] is None  # only with --search
    by = {r["label"]: r for r in plan["strategies"]}
    h100, model = preset("h100-8x"), resolve("gpt2").build()
    for stage in (1, 2, 3):
        plain, off = by[f"zero{stage}"], by[f"zero{stage}+offload"]
        assert off["session"] == f"pt.Session(pt.ZeRO(stage={stage}, offload=True))"
        shards = [max(1, n // 8) for n, _ in traffic(model, pt.ZeRO(stage=stage), world=8, local_world=8).buckets]
        assert off["optimizer_seconds"] == pytest.approx(sum(shards) / h100.host_optimizer_rate)
        moves = 1 + (2 if stage == 3 else 1)  # the gradients down; the shards up after the step, or at each gather
        copies = moves * (4 * sum(shards) / h100.host_link.bandwidth + len(shards) * h100.host_link.latency)
        assert off["exposed_comm_seconds"] == pytest.approx(plain["exposed_comm_seconds"] + copies)
        assert off["compute_seconds"] == plain["compute_seconds"] and off["host"] > 0 == plain["host"]
        assert off["device_peak"] < plain["device_peak"] and off["fits"]
    small = tmp_path / "small_host.json"
    save_cluster(dataclasses.replace(h100, host_memory=by["zero3+offload"]["host"] * 8 - 1), small)
    tight = {r["label"]: r for r in json.loads(run(capsys, *argv[:4], str(small), *argv[5:])[1])["strategies"]}
    assert not tight["zero3+offload"]["fits"] and tight["zero3"]["fits"]
    cpu = json.loads(run(capsys, *argv[:4], "cpu-here", *argv[5:])[1])
    assert not [r for r in cpu["strategies"] if "offload" in r["label"]]


@pytest.mark.slow
def test_accumulate_runs_the_batch_as_micro_batches_and_synchronises_once(capsys):
    """--accumulate 4: the same optimizer step of 16 samples as 4 micro-batches of 4, so a quarter of
    the activations, the same state, ddp's all-reduce once and zero3's gathers in every one."""
    base = ("gpt2", "--gpus", "4", "--cluster", "h100-8x", "--batch", "16", "--seq", "128", "--json")
    one = json.loads(run(capsys, *base)[1])
    four = json.loads(run(capsys, *base, "--accumulate", "4")[1])
    assert (one["accumulate"], four["accumulate"]) == (1, 4) and four["model"] == one["model"]
    by_one = {r["label"]: r for r in one["strategies"] if r["strategy"] != "pipeline"}
    by_four = {r["label"]: r for r in four["strategies"] if r["strategy"] != "pipeline"}
    for name, row in by_four.items():
        was = by_one[name]
        assert row["session"] == was["session"][:-1] + ", accumulate=4)"
        assert all(row[k] == was[k] for k in ("params", "grads", "optimizer", "gathered"))
        assert abs(4 * row["activations"] - was["activations"]) < 16  # floors of 1/16 and 1/4
        assert row["compute_seconds"] == pytest.approx(was["compute_seconds"])  # a preset: one flat rate
        assert row["step_seconds"] >= was["step_seconds"] * 0.999
    assert by_four["ddp"]["comm_seconds"] == pytest.approx(by_one["ddp"]["comm_seconds"])
    assert by_four["zero3"]["comm_seconds"] > 2 * by_one["zero3"]["comm_seconds"]
    for name in ("zero2", "zero3"):  # every full gradient is kept through the window
        assert by_four[name]["comm_buffers"] > by_one[name]["comm_buffers"]
    pipelines = [r["label"] for r in four["strategies"] if r["strategy"] == "pipeline"]
    assert pipelines == ["pipeline 4x4", "pipeline 2x2"]  # micro-batches of a micro-batch of 4


@pytest.mark.slow
def test_a_model_that_fits_nowhere_says_what_would_fit(capsys):
    # 128 samples: with checkpointing, even zero3 with offload holds a quarter of 133 GiB of activations
    code, out, err = run(capsys, "llama-2-70b", "--gpus", "4", "--cluster", "h100-8x", "--batch", "128",
                         "--seq", "1024", "--precision", "bf16")
    assert code == 2 and len(err.strip().splitlines()) == 1
    advice = re.search(r"no strategy fits llama-2-70b in 80 GiB per device on 4 h100-8x device\(s\); it would fit "
                       r"with (\d+) devices under zero3 with activation checkpointing( and a batch of (\d+))?", err)
    assert advice, err
    assert "ddp +ckpt" in out  # what did not fit was tried again with checkpointing
    # the advice holds: on that many devices (with a sample for each, if it said so) zero3 with checkpointing fits
    batch = advice.group(3) or "128"
    assert int(batch) >= int(advice.group(1))
    code, out, _ = run(capsys, "llama-2-70b", "--gpus", advice.group(1), "--cluster", "h100-8x", "--batch", batch,
                       "--seq", "1024", "--precision", "bf16", "--json")
    zero3 = [r for r in json.loads(out)["strategies"] if r["label"].startswith("zero3")]
    assert code == 0 and any(r["fits"] for r in zero3)  # with checkpointing, or already without


def test_png_draws_throughput_and_memory_from_1_to_1024_devices(capsys, tmp_path):
    from paratrain.plan.scaling import COUNTS, at_batch, leaders, line_name, scaling

    png = tmp_path / "scaling.png"
    code, out, err = run(capsys, "tests.support.models:MLP", "--batch", "8", "--gpus", "2", "--cluster", "a100-8x", "--png", str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    facts = model_facts(resolve("tests.support.models:MLP"), 8)
    doubled = at_batch(facts, 16)  # FLOPs and saved bytes are linear in the batch
    assert doubled.step.flops_forward == 2 * facts.step.flops_forward
    assert doubled.step.activation_bytes == 2 * facts.step.activation_bytes
    assert doubled.step.activation_bytes == model_facts(resolve("tests.support.models:MLP"), 16).step.activation_bytes
    points = scaling(resolve("tests.support.models:MLP"), facts, preset("a100-8x"), optimizer="adam", per_device=4)
    assert sorted(points) == list(COUNTS) == [2**k for k in range(11)]
    ddp = {n: next(r for r in rows if r["strategy"] == "ddp") for n, rows in points.items()}
    assert ddp[1]["exposed_comm_seconds"] == 0 and ddp[16]["exposed_comm_seconds"] > ddp[8]["exposed_comm_seconds"]
    # one line per strategy across the counts (not per label: a pipeline's changes with them), offload apart
    lines = [line_name(r) for r in points[8] if "error" not in r]
    assert len(lines) == len(set(lines)) and {"zero3", "zero3+offload"} <= set(lines)
    by_line = {line_name(r): r for r in points[8] if "error" not in r}
    assert leaders(points[8], 20) == sorted(lines, key=lambda name: (by_line[name]["fits"],
                                                                   by_line[name]["per_device_per_second"]), reverse=True)
    code, _, err = run(capsys, "tests.support.models:MLP", "--gpus", "2", "--png", str(png))  # no cluster to time on
    assert code == 2 and "--png draws the strategies' predictions: give --gpus N and --cluster too" in err


@pytest.mark.slow
def test_nodes_spreads_the_devices_and_the_gradients_cross_the_slower_link(capsys):
    """The same 8 devices of h100-8x on 1 node and on 2: DDP's all-reduce leaves the node, paced by
    InfiniBand (50 GB/s) instead of NVLink (450 GB/s), so its step is slower; each comm time is
    comm_model's for the group, over the buckets traffic.py reads with 8 / nodes ranks per node."""
    import paratrain as pt
    from paratrain.plan.cost import comm_model
    from paratrain.plan.cost.comm_model import Group
    from paratrain.plan.cost.traffic import traffic

    argv = ("gpt2", "--gpus", "8", "--cluster", "h100-8x", "--batch", "8", "--seq", "64", "--precision", "bf16",
            "--json")
    plans = {}
    for nodes in (1, 2):
        code, out, err = run(capsys, *argv, "--nodes", str(nodes))
        assert code == 0, err
        plans[nodes] = json.loads(out)
        assert plans[nodes]["nodes"] == nodes
    assert json.loads(run(capsys, *argv)[1])["nodes"] == 1  # the default: the fewest whole nodes
    cluster = preset("h100-8x")
    for nodes, plan in plans.items():
        rows = {r["strategy"]: r for r in plan["strategies"]}
        for name, strategy, reduce in (("ddp", pt.DDP(), comm_model.all_reduce),
                                       ("hierarchical", pt.Hierarchical(), comm_model.hierarchical_all_reduce)):
            if nodes == 1:
                reduce = comm_model.all_reduce  # one node: hierarchical is a plain all-reduce
            sent = traffic(resolve("gpt2").build(), strategy, world=8, local_world=8 // nodes)
            want = sum(reduce(nbytes, Group(8, nodes), cluster) for _, nbytes in sent.buckets)
            assert rows[name]["comm_seconds"] == pytest.approx(want, rel=1e-9)
    one, two = ({r["strategy"]: r for r in plans[n]["strategies"]}["ddp"] for n in (1, 2))
    assert two["comm_seconds"] > one["comm_seconds"] and two["step_seconds"] > one["step_seconds"]
    assert two["compute_seconds"] == one["compute_seconds"]  # only the links differ
    assert "on 8 h100-8x device(s) (2 node(s))" in run(capsys, *argv[:-1], "--nodes", "2")[1]


def test_png_with_nodes_scales_with_that_node_size():
    """--gpus 8 --nodes 2: nodes of 4, so 8 devices are 2 nodes and 16 are 4 (scaling.per_node)."""
    from paratrain.plan.recommend import spread
    from paratrain.plan.scaling import scaling

    assert [spread(n, 4) for n in (1, 2, 4, 8, 16)] == [1, 1, 1, 2, 4]
    assert [spread(n, 3) for n in (2, 4, 6, 8)] == [1, 2, 2, 4]  # evenly: 8 on nodes of at most 3 is 4 × 2
    facts = model_facts(resolve("tests.support.models:MLP"), 8)
    by = {per_node: scaling(resolve("tests.support.models:MLP"), facts, preset("h100-8x"), optimizer="adam", per_device=1,
                            counts=(4, 8), per_node=per_node) for per_node in (4, 8)}
    ddp = {k: {n: next(r for r in rows if r["strategy"] == "ddp") for n, rows in points.items()}
           for k, points in by.items()}
    assert ddp[4][4]["comm_seconds"] == ddp[8][4]["comm_seconds"]  # one node either way
    assert ddp[4][8]["comm_seconds"] > ddp[8][8]["comm_seconds"]  # 2 nodes of 4 against one of 8


def test_every_backward_of_a_pipelines_micro_batches_adds_its_gradients(monkeypatch):
    """A pipeline stage's m micro-batches each add their gradients to the stage's (times accumulate)."""
    from paratrain.plan.cost import step_time

    source = resolve("gpt2")
    facts = model_facts(source, 24, 32, activation_checkpointing=None)
    here = dataclasses.replace(preset("cpu-here"), traffic_rate=2e9)

    def compute(copy_seconds: float, **how) -> float:
        monkeypatch.setattr(step_time, "gradient_copy", lambda *args, **kwargs: copy_seconds)
        return predict_time(source, **how, step=facts.step, cluster=here, nodes=1, facts=facts).compute

    for strategy, accumulate, backwards in ((pt.Pipeline(stages=2, microbatches=4), 1, 4),
                                            (pt.Pipeline(stages=2, microbatches=4), 3, 12), (pt.DDP(), 3, 3)):
        how = dict(strategy=strategy, gpus=2, accumulate=accumulate)
        assert compute(1.0, **how) - compute(0.0, **how) == pytest.approx(backwards)


def test_ddp_and_zero3_copy_each_gradient_into_their_buffers_once_per_backward():
    """On a cluster with a traffic rate, ddp's backward at world 1 takes what single's does plus
    a read and a write of every gradient (its buckets); with accumulate=2, twice; zero3 copies its
    gradients and its units besides."""
    source = resolve("tests.support.models:MLP")
    facts = model_facts(source, 8, activation_checkpointing=None)
    here = dataclasses.replace(preset("cpu-here"), traffic_rate=2e9)
    grads = sum(p.numel() * p.element_size() for p in source.build().parameters())
    single, ddp = (predict_time(source, s, facts.step, here, gpus=1, nodes=1, facts=facts)
                   for s in (pt.Single(), pt.DDP()))
    assert ddp.compute - single.compute == pytest.approx(gradient_copy(grads, here, world=1)) and grads > 0
    twice = predict_time(source, pt.DDP(), facts.step, here, gpus=1, nodes=1, facts=facts, accumulate=2)
    alone = predict_time(source, pt.Single(), facts.step, here, gpus=1, nodes=1, facts=facts, accumulate=2)
    assert twice.compute - alone.compute == pytest.approx(2 * gradient_copy(grads, here, world=1))
    zero3 = predict_time(source, pt.ZeRO(stage=3), facts.step, here, gpus=1, nodes=1, facts=facts)
    assert zero3.compute - single.compute == pytest.approx(gradient_copy(grads, here, world=1)
                                                           + zero3_local_copies(grads, here, world=1))


@pytest.mark.slow
def test_every_strategy_plans_the_same_on_the_shared_model_as_on_a_fresh_one():
    """A plan reads one model, built once (ModelSource.shared), for every strategy's memory and
    time: planning some strategies first must not change what another one gets."""
    from paratrain.plan.memory_table import memory_rows, strategies

    h100 = preset("h100-8x")
    source = resolve("gpt2")
    facts = model_facts(source, 8, seq=64)
    chosen = strategies(8, 8, offload=True)
    assert {s.name for s in chosen} >= {"ddp", "hierarchical", "zero1", "zero2", "zero3", "pipeline"}
    how = dict(gpus=8, gpus_per_node=8, optimizer="adam", activation_bytes=facts.step.activation_peak_bytes,
               step=facts.step)
    shared = memory_rows(source, chosen=chosen, **how)
    times = [predict_time(source, s, facts.step, h100, gpus=8, nodes=1, facts=facts) for s in chosen]
    for strategy, row, seconds in zip(chosen, shared, times):
        fresh = resolve("gpt2")  # its own model, built for this strategy alone
        assert memory_rows(fresh, chosen=[strategy], **how) == [row], row["label"]
        assert predict_time(fresh, strategy, facts.step, h100, gpus=8, nodes=1, facts=facts) == seconds
    assert source.shared is source.shared and source.build() is not source.build()


def test_search_prints_the_fastest_layouts_that_fit_each_with_its_session_line(capsys):
    argv = ("gpt2", "--gpus", "16", "--cluster", "h100-8x", "--batch", "32", "--seq", "128", "--precision", "bf16")
    code, out, err = run(capsys, *argv, "--search", "3", "--json")
    assert code == 0, err
    found = json.loads(out)["search"]
    assert len(found) == 3 and all(row["fits"] for row in found)
    speeds = [row["per_device_per_second"] for row in found]
    assert speeds == sorted(speeds, reverse=True)
    assert speeds[0] >= max(r["per_device_per_second"] for r in json.loads(out)["strategies"] if r.get("fits"))
    code, out, _ = run(capsys, *argv, "--search")  # TOP defaults to 5
    assert code == 0 and "the 5 fastest that fit" in out and found[0]["session"] in out
    code, _, err = run(capsys, "gpt2", "--gpus", "16", "--search")
    assert code == 2 and "--search ranks layouts over the devices of a cluster" in err
