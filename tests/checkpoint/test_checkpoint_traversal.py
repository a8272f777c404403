"""A checkpoint reads only its own files: a `.metadata` (or a `paratrain.json`) that points a tensor
at a file outside the checkpoint is refused, naming the file, by each of the three ways a checkpoint
is read: `session.resume`, `paratrain ckpt info` and `paratrain ckpt export`. The attacker rewrites
the checksums too, as in test_checkpoint.py's unpickling test: checksums catch damage, not intent."""

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import paratrain as pt
from paratrain.checkpoint.files import digest
from tests.support import ROOT_DIR
from tests.support.models import make_batches, make_model

ROOT = Path(ROOT_DIR)


def _saved(root: Path) -> Path:
    """A one-step single-process checkpoint under `root`, and a copy of its data file beside the
    root (`secret.distcp`): the outside file a tampered checkpoint points at. Being a real DCP file
    with the same layout, a read that is not refused succeeds and loads its values."""
    session = pt.Session("single", progress_bar=False)
    model = make_model("mlp")
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = make_batches(1, 8)
    session.train_step((xs[0], ys[0]), F.cross_entropy)
    path = session.checkpoint(root)
    session.close()
    data = next(path.glob("*.distcp"))
    shutil.copy(data, root.parent / "secret.distcp")
    return path


def _point_at(ckpt: Path, how: str) -> str:
    """Rewrite `ckpt`'s `.metadata` so that its tensors are read from a file chosen by `how`, and
    its recorded checksum to match. Returns the path written into the metadata."""
    outside = ckpt.parent.parent / "secret.distcp"
    target = {"parent": "../../secret.distcp", "absolute": str(outside), "symlink": "link.distcp",
              "unlisted": "extra.distcp"}[how]
    if how == "symlink":
        (ckpt / "link.distcp").symlink_to(outside)
    if how == "unlisted":
        shutil.copy(outside, ckpt / "extra.distcp")
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = target
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    marker = json.loads((ckpt / "paratrain.json").read_text())
    marker["files"][".metadata"] = digest(ckpt / ".metadata")
    (ckpt / "paratrain.json").write_text(json.dumps(marker))
    return target


HOW = ["parent", "absolute", "symlink", "unlisted"]
REASON = {"parent": "leads out of the checkpoint's directory", "absolute": "is an absolute path",
          "symlink": "leads out of the checkpoint's directory", "unlisted": "does not list it"}


@pytest.mark.parametrize("how", HOW)
def test_resume_refuses_a_tensor_stored_outside_the_checkpoint(tmp_path, how):
    target = _point_at(_saved(tmp_path / "root"), how)
    session = pt.Session("single", progress_bar=False)
    model = make_model("mlp")
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(pt.UsageError, match="refusing to read") as refused:
        session.resume(tmp_path / "root")
    assert repr(target) in str(refused.value) and REASON[how] in str(refused.value)
    session.close()


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paratrain", "ckpt", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how", ["parent", "symlink"])
@pytest.mark.parametrize("command", ["info", "export"])
def test_ckpt_info_and_export_refuse_a_tensor_stored_outside_the_checkpoint(tmp_path, command, how):
    ckpt = _saved(tmp_path / "root")
    target = _point_at(ckpt, how)
    out = tmp_path / "model.safetensors"
    done = _cli(command, ckpt, *([out] if command == "export" else []))
    assert done.returncode != 0, done.stdout
    assert f"refusing to read {target!r}" in done.stderr and REASON[how] in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_a_marker_listing_a_file_outside_the_checkpoint_is_refused(tmp_path):
    """The file list in `paratrain.json` is hashed on every load: a name that leads out of the
    directory would have the checksum pass read (and time) any file the job can reach."""
    ckpt = _saved(tmp_path / "root")
    marker = json.loads((ckpt / "paratrain.json").read_text())
    marker["files"]["../../secret.distcp"] = digest(tmp_path / "secret.distcp")
    (ckpt / "paratrain.json").write_text(json.dumps(marker))
    session = pt.Session("single", progress_bar=False)
    model = make_model("mlp")
    session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(pt.UsageError, match=r"refusing to read '../../secret.distcp', a file its "
                                            r"paratrain.json lists .* leads out"):
        session.resume(tmp_path / "root")
    session.close()
