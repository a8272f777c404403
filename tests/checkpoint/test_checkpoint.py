"""Checkpoints: resharding across world sizes and strategies, exact resume, atomic saves,
damaged or foreign checkpoints, no unpickling of arbitrary objects."""

import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain as pt
from paratrain import checkpoint
from paratrain.checkpoint.files import digest
from paratrain.testing import RankFailure, assert_same_params, run_on_ranks
from tests.support.models import make_batches, make_model
from tests.support.pipeline_models import chain

GLOBAL_BATCH = 8


def _data():
    xs, ys = make_batches(1, 48, seed=7)
    return TensorDataset(xs[0], ys[0])


def _session(topo, strategy, name="tied"):
    if strategy == "zero3-units":
        strategy = pt.ZeRO(stage=3, wrap_policy=pt.WrapPolicy(module_classes=(torch.nn.Linear,)))
    if strategy == "pipeline":  # 2 stages; at world 4, 2 stages × 2 replicas
        strategy = pt.Pipeline(stages=2, schedule="1f1b", microbatches=2)
    if strategy in ("pp-zero1", "pp-zero2"):  # 2 stages × 2 replicas, which shard the optimizer state
        strategy = pt.Mesh(pp=pt.Pipeline(stages=2, schedule="1f1b", microbatches=2), dp=strategy[3:])
    session = pt.Session(strategy, topology=topo, progress_bar=False, seed=3)
    model = chain() if name == "chain" else make_model(name)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    session.setup(model, optimizer, DataLoader(_data(), batch_size=GLOBAL_BATCH, shuffle=True))
    return session


def _batches(session):
    while True:  # epoch after epoch, as a training loop does
        yield from session.progress(session.loader)


def _train(session, steps):
    """`steps` more steps of one uninterrupted loop (the loop survives between calls)."""
    if not hasattr(session, "_test_batches"):
        session._test_batches = _batches(session)
    for _ in range(steps):
        session.train_step(next(session._test_batches), F.cross_entropy)
    return session.full_state_dict()


def _train_and_save(topo, strategy, steps, path, name="tied"):
    session = _session(topo, strategy, name)
    _train(session, steps)
    session.save(path)
    return True


def _load_and_train(topo, strategy, steps, path, name="tied"):
    session = _session(topo, strategy, name)
    session.load(path)
    return _train(session, steps)


def _uninterrupted(topo, strategy, steps, name="tied"):
    return _train(_session(topo, strategy, name), steps)


@pytest.mark.parametrize("saver,loader,name", [
    (("ddp", 4), ("zero3-units", 2), "tied"),
    (("zero3-units", 2), ("single", 1), "tied"),
    (("zero1", 2), ("zero2", 4), "tied"),
    (("zero2", 4), ("ddp", 2), "tied"),
    (("pipeline", 2), ("ddp", 2), "chain"),  # each stage writes its own layers
    (("ddp", 2), ("pipeline", 4), "chain"),  # each stage of each replica reads its own
    (("pipeline", 4), ("single", 1), "chain"),
    (("pp-zero2", 4), ("zero1", 2), "chain"),  # each replica of each stage writes its slices
    (("ddp", 2), ("pp-zero1", 4), "chain"),
])
def test_a_checkpoint_loads_under_another_world_size_and_strategy(tmp_path, saver, loader, name):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_train_and_save, saver[1], saver[0], 3, path, name)
    resumed = run_on_ranks(_load_and_train, loader[1], loader[0], 2, path, name)
    expected = run_on_ranks(_uninterrupted, 1, "single", 5, name)[0]
    for state in resumed:
        assert_same_params(state, expected, atol=1e-6)  # measured: at most 6.0e-8


def _train_and_save_format_1(topo, strategy, steps, path):
    """As paratrain before tensor parallelism saved: every parameter flattened (format 1)."""
    checkpoint.save_load.FORMAT = 1
    return _train_and_save(topo, strategy, steps, path)


def _stored_sizes(path):
    metadata = torch.distributed.checkpoint.FileSystemReader(path).read_metadata()
    return {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if k.startswith(("model/", "optim/"))}


def test_a_format_1_checkpoint_still_loads_and_format_2_keeps_the_shapes(tmp_path):
    """Format 2 stores each parameter and its optimizer state at the parameter's shape; a
    format 1 checkpoint (flattened) written by ZeRO-3 still loads, into DDP at another world."""
    old, new = str(tmp_path / "format1"), str(tmp_path / "format2")
    run_on_ranks(_train_and_save_format_1, 2, "zero3", 3, old)
    run_on_ranks(_train_and_save, 2, "zero3", 3, new)
    shapes = {n: tuple(p.shape) for n, p in make_model("tied").named_parameters()}
    assert _stored_sizes(old)["model/proj_in.weight"] == (12 * 12,)
    assert {k: v for k, v in _stored_sizes(new).items() if k.split("/")[-1] != "step"} == {
        **{f"model/{n}": s for n, s in shapes.items()},
        **{f"optim/{n}/{key}": s for n, s in shapes.items() for key in ("exp_avg", "exp_avg_sq")}}
    expected = run_on_ranks(_uninterrupted, 1, "single", 5)[0]
    for path in (old, new):
        for state in run_on_ranks(_load_and_train, 4, "ddp", 2, path):
            assert_same_params(state, expected, atol=1e-6)


def _two_groups(model):
    """SGD with the first layer in a group of its own: on 2 stages, stage 1 holds none of it."""
    first = list(model[0].parameters())
    rest = [p for layer in list(model)[1:] for p in layer.parameters()]
    return torch.optim.SGD([{"params": first, "lr": 0.05}, {"params": rest, "lr": 0.1}], momentum=0.9)


def _groups_on_stages(topo, path):
    session = pt.Session(pt.Pipeline(stages=2, microbatches=2), topology=topo, progress_bar=False)
    model = chain()
    _, optimizer, _ = session.setup(model, _two_groups(model), DataLoader(_data(), batch_size=GLOBAL_BATCH))
    _train(session, 1)
    for group, lr in zip(optimizer.param_groups, (0.01, 0.02)):  # where a scheduler would have got
        group["lr"] = lr
    session.save(path)
    return [(len(g["params"]), g["lr"]) for g in optimizer.param_groups]


def _load_groups(topo, path):
    session = pt.Session("single", topology=topo, progress_bar=False)
    model = chain()
    _, optimizer = session.setup(model, _two_groups(model))
    session.load(path)
    return [g["lr"] for g in optimizer.param_groups]


def test_a_pipeline_stage_keeps_the_users_param_groups_even_empty_ones(tmp_path):
    stage0, stage1 = run_on_ranks(_groups_on_stages, 2, str(tmp_path / "c"))
    assert [n for n, _ in stage0] == [2, 4] and [n for n, _ in stage1] == [0, 4]
    assert [lr for _, lr in stage1] == [0.01, 0.02]
    assert run_on_ranks(_load_groups, 1, str(tmp_path / "c"))[0] == [0.01, 0.02]


def _with_scheduler(topo, steps, path, load, register_after_load=False):
    """DDP with a StepLR that halves the learning rate every 2 steps, registered with the session
    (after the load: the checkpoint's state waits for it)."""
    session = _session(topo, "ddp")
    scheduler = torch.optim.lr_scheduler.StepLR(session.optimizer, step_size=2, gamma=0.5)
    if not register_after_load:
        session.register(scheduler=scheduler)
    if load:
        session.load(path)
    if register_after_load:
        session.register(scheduler=scheduler)
    for _ in range(steps):
        _train(session, 1)
        scheduler.step()
    if not load:
        session.save(path)
    return session.full_state_dict(), scheduler.get_last_lr()


def test_a_registered_scheduler_resumes_where_it_was(tmp_path):
    """Without its state the new StepLR would count from 0 and halve at other steps; also when it
    is registered only after the load."""
    path = str(tmp_path / "c")
    run_on_ranks(_with_scheduler, 2, 3, path, False)
    resumed = run_on_ranks(_with_scheduler, 2, 2, path, True)
    resumed += run_on_ranks(_with_scheduler, 2, 2, path, True, True)
    expected = run_on_ranks(_with_scheduler, 2, 5, str(tmp_path / "straight"), False)[0]
    for state, lrs in resumed:
        assert_same_params(state, expected[0], atol=0)  # the same world and strategy: bitwise
        assert lrs == expected[1] == [1e-3 / 4]


def _resume_exactly(topo, root, first, then):
    """`first` steps, a checkpoint, `then` more; and a fresh session resuming from it."""
    session = _session(topo, "ddp", name="dropout")  # dropout: the RNG states must resume too
    _train(session, first)
    session.checkpoint(root, keep=2)
    straight = _train(session, then)
    resumed = _session(topo, "ddp", name="dropout")
    torch.manual_seed(12345)  # whatever happened since, the checkpoint's RNG states win
    assert resumed.resume(root)
    return straight, _train(resumed, then)


def test_resume_continues_bitwise_mid_epoch_with_rng_and_sampler(tmp_path):
    for straight, resumed in run_on_ranks(_resume_exactly, 2, str(tmp_path), 4, 5):
        assert_same_params(resumed, straight, atol=0)


def _checkpoints(topo, root):
    session = _session(topo, "zero2")
    paths = []
    for _ in range(4):
        _train(session, 1)
        paths.append(session.checkpoint(root, keep=2).name)
    session.close()  # releases the root's lock
    return paths, sorted(p.name for p in Path(root).iterdir())


def test_keeps_the_newest_k(tmp_path):
    paths, left = run_on_ranks(_checkpoints, 2, str(tmp_path))[0]
    assert paths == ["step-00000001", "step-00000002", "step-00000003", "step-00000004"]
    assert left == ["step-00000003", "step-00000004"]


def _crash_during_save(topo, root):
    session = _session(topo, "zero3-units")
    _train(session, 1)
    good = session.checkpoint(root)
    _train(session, 1)
    original = torch.distributed.checkpoint.FileSystemWriter.finish

    def crash(self, *args, **kwargs):  # every rank's data is written, the metadata never is
        raise OSError("disk full, on purpose")

    torch.distributed.checkpoint.FileSystemWriter.finish = crash
    try:
        session.checkpoint(root)
        raise AssertionError("the save should have failed")
    except pt.CheckpointError as e:
        assert "every checkpoint saved before is intact" in str(e)
    finally:
        torch.distributed.checkpoint.FileSystemWriter.finish = original
    fresh = _session(topo, "zero3-units")
    assert fresh.resume(root)
    return good.name, checkpoint.latest(root).name, sorted(p.name for p in Path(root).iterdir())


def test_a_save_interrupted_midway_leaves_the_previous_checkpoint_loadable(tmp_path):
    good, latest, names = run_on_ranks(_crash_during_save, 2, str(tmp_path))[0]
    assert latest == good == "step-00000001"
    assert "step-00000002.partial" in names and "step-00000002" not in names


def _save_single(topo, path, name="tied"):
    session = _session(topo, "single", name=name)
    _train(session, 1)
    session.save(path)


def _load_single(topo, path, name="tied"):
    _session(topo, "single", name=name).load(path)


def test_a_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    run_on_ranks(_save_single, 1, str(tmp_path / "c"))
    with pytest.raises(RankFailure, match="holds another model"):
        run_on_ranks(_load_single, 1, str(tmp_path / "c"), "mlp")


def test_a_truncated_file_is_a_clear_error(tmp_path):
    run_on_ranks(_save_single, 1, str(tmp_path / "c"))
    data = next(p for p in (tmp_path / "c").iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(RankFailure, match="damaged or incomplete"):
        run_on_ranks(_load_single, 1, str(tmp_path / "c"))


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_refuses_to_unpickle_arbitrary_objects(tmp_path):
    run_on_ranks(_save_single, 1, str(tmp_path / "c"))
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(_Evil()))
    # checksums catch damage, not an attacker, who rewrites them too: the allow-list must hold
    marker = json.loads((tmp_path / "c" / "paratrain.json").read_text())
    marker["files"][".metadata"] = digest(tmp_path / "c" / ".metadata")
    (tmp_path / "c" / "paratrain.json").write_text(json.dumps(marker))
    with pytest.raises(RankFailure, match="refusing to load posix.system"):
        run_on_ranks(_load_single, 1, str(tmp_path / "c"))


def test_an_interrupted_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / "step-00000009.partial").mkdir()
    with pytest.raises(pt.ConfigError, match="not a complete paratrain checkpoint"):
        checkpoint.load(tmp_path / "step-00000009.partial", make_model("mlp"))
    assert checkpoint.latest(tmp_path) is None


def _export(topo, path):
    session = _session(topo, "zero3-units")
    _train(session, 2)
    session.export(path)
    return session.full_state_dict()


def test_export_writes_one_safetensors_file_of_the_whole_model(tmp_path):
    from safetensors.torch import load_file

    state = run_on_ranks(_export, 2, str(tmp_path / "model.safetensors"))[0]
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert_same_params(exported, state, atol=0)
    model = make_model("tied")
    model.load_state_dict(exported)  # loads into the plain, unwrapped model


def _info(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "paratrain", "ckpt", "info", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_ckpt_info_reads_a_sharded_checkpoint_offline(tmp_path):
    """Written by 2 ZeRO-3 ranks (each holding pieces of every flattened parameter), read by a
    process with no process group and no model: every tensor under its own shape, bytes adding up;
    a damaged file is named, and a root is not a checkpoint."""
    path = tmp_path / "step-3"
    run_on_ranks(_train_and_save, 2, "zero3-units", 3, str(path), "mlp")
    done = _info(path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "written by 2 process(es), strategy zero3, optimizer torch.optim.adam.Adam" in out
    assert "micro-batches trained 3, optimizer steps 3 (accumulate 1)" in out
    model = make_model("mlp")
    for name, p in model.named_parameters():
        size = p.numel() * 4
        assert f"model/{name}" in out and f"[{', '.join(map(str, p.shape))}]" in out
        assert re.search(rf"optim/{re.escape(name)}/exp_avg\s+float32\s+\[{', '.join(map(str, p.shape))}\]\s+{size:,} bytes", out)
    total = sum(p.numel() * 4 for p in model.parameters())
    assert f"model: {len(list(model.parameters()))} tensors, {total:,} bytes" in out
    shard = next(path.glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    damaged = _info(path)
    assert damaged.returncode == 2 and f"{shard.name} does not match the sha256" in damaged.stderr
    root = _info(tmp_path)
    assert root.returncode == 2 and "not a complete paratrain checkpoint" in root.stderr
