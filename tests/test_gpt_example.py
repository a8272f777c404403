"""examples/gpt.py as a user runs it: two processes through `paratrain run` with ddp, zero3, a
two-stage pipeline (the token embedding on stage 0 tied to the head on stage 1) and tensor
parallelism over both (`--tp 2`), and context parallelism (`--cp 2`: each sequence cut over both),
and one in-process single run as the reference. A small model, 100 steps: each run must learn
(validation loss well below the uniform guess ln 96, and below the unigram plateau near 3.3)
and write its files. The two-rank runs must also match the single run at the first validation
(step 25); not at the end, because one batch of 32 and two of 16 round differently (and ZeRO
sums the clipping norm in float64), and at this learning rate such differences grow to a few
hundredths by step 100, as they would between two thread counts of the single run."""

import csv
import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import paratrain as pt
from tests.support import ROOT_DIR

ROOT = ROOT_DIR
SCRIPT = os.path.join(ROOT, "examples", "gpt.py")
SMALL = ["--steps", "100", "--eval-every", "25", "--batch-size", "32", "--block-size", "32",
         "--layers", "2", "--width", "64", "--lr", "1e-2", "--sample-chars", "40"]
UNIFORM = math.log(96)  # cross-entropy of a uniform guess among the 96 characters


def load_example():
    spec = importlib.util.spec_from_file_location("gpt_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_rows(out, steps: int = 100) -> list[dict]:
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(25, steps + 1, 25))
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"]) - 0.2
    assert (out / "loss.png").stat().st_size > 1000
    return rows


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[float, list[dict]]:
    out = tmp_path_factory.mktemp("single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `paratrain run` gives each rank (2 threads on a busy 2-core box: 10x slower)
    try:
        loss = load_example().main(SMALL + ["--strategy", "single", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
        pt.destroy()  # main() closes its session, but not when it fails
    return loss, read_rows(out)


@pytest.mark.slow
def test_single_run_learns(single):
    assert single[0] < UNIFORM - 1.2


@pytest.mark.parametrize("strategy,extra", [("ddp", []), ("zero3", []), ("pipeline", []),
                                            ("zero3", ["--activation-checkpointing"]), ("ddp", ["--tp", "2"]),
                                            ("ddp", ["--cp", "2"])])
def test_two_ranks_learn_as_one_does(strategy, extra, single, tmp_path):
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "examples/gpt.py", *SMALL,
           "--strategy", strategy, *extra, "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = float(re.search(r"^validation loss: (\d+\.\d+)$", done.stdout, re.M).group(1))
    assert loss < UNIFORM - 1.2
    assert re.search(rf"^tokens per second: \d+ \(2 process\(es\), strategy {strategy}, ", done.stdout, re.M)
    assert re.search(r"^sample:\nReturn the .{40}", done.stdout, re.M | re.S)
    rows = read_rows(tmp_path)
    # same global batches and seed: equal to the single run before rounding differences grow
    assert float(rows[0]["val_loss"]) == pytest.approx(float(single[1][0]["val_loss"]), abs=1e-3)


def test_four_stages_with_gpipe_learn(tmp_path):
    """The example cut into 4 stages, a block each, under GPipe (the parity of both schedules at
    2 and 4 stages with one process is tests/parallel/pipeline/test_pipeline_cut.py's). Twice the
    layers learn more slowly: 200 steps."""
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "4", "examples/gpt.py", *SMALL, "--layers", "4",  # the last wins
           "--steps", "200", "--strategy", "pipeline", "--stages", "4", "--schedule", "gpipe", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = float(re.search(r"^validation loss: (\d+\.\d+)$", done.stdout, re.M).group(1))
    assert loss < UNIFORM - 1.2
    assert re.search(r"^tokens per second: \d+ \(4 process\(es\), strategy pipeline, ", done.stdout, re.M)
    read_rows(tmp_path, steps=200)


def test_a_meta_built_model_learns_under_zero3_and_its_export_starts_another_run(tmp_path):
    """--meta-init: every rank materialises only its shards, by the rule (its values differ from
    the eager build's, so it is compared with learning, not with the single run). Its --export,
    loaded by --init-from into another meta-built zero3 run that does not move (lr 0), gives
    the same validation loss. From the rule's init it learns more slowly: 200 steps."""
    exported = str(tmp_path / "gpt.safetensors")
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "examples/gpt.py", *SMALL, "--strategy", "zero3",
           "--meta-init", "--steps", "200", "--out", str(tmp_path), "--export", exported]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loss = float(re.search(r"^validation loss: (\d+\.\d+)$", done.stdout, re.M).group(1))
    assert loss < UNIFORM - 1.2
    read_rows(tmp_path, steps=200)
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "examples/gpt.py", *SMALL, "--strategy", "zero3",
           "--meta-init", "--init-from", exported, "--steps", "1", "--eval-every", "1", "--lr", "0",
           "--out", str(tmp_path / "again")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    again = float(re.search(r"^validation loss: (\d+\.\d+)$", done.stdout, re.M).group(1))
    assert abs(again - loss) < 1e-4
