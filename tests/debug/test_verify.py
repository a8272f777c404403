"""`paratrain verify` on the examples, as a user runs it: every strategy agrees with one process,
and a bug injected through the test-only hook is named — its step, its parameter, its rank."""

import os
import re
import subprocess
import sys
import time

import torch

from paratrain.cli.verify import _check_summaries
from paratrain.debug.verify import CHUNK, summary
from paratrain.parallel.base import Slice
from tests.support import ROOT_DIR

ROOT = ROOT_DIR
GPT_SMALL = ["--block-size", "16", "--layers", "2", "--width", "32", "--heads", "2", "--batch-size", "8"]


def verify(*args: str, inject: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "PARATRAIN_VERIFY_INJECT"}
    if inject:
        env["PARATRAIN_VERIFY_INJECT"] = inject
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "paratrain", "verify", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return done, time.perf_counter() - start


def test_every_strategy_agrees_with_one_process_on_the_digits_example_with_accumulation(tmp_path):
    done, _ = verify("-n", "2", "--steps", "3", "--strategy", "ddp,hierarchical,zero1,zero2,zero3,pipeline",
                     "examples/digits.py", "--accumulate", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    agreed = re.findall(r"^paratrain verify: 2 processes \((\w+)\) against 1 \(single\), 3 optimizer step\(s\): "
                        r"they agree\.$", done.stdout, re.M)
    assert agreed == ["ddp", "hierarchical", "zero1", "zero2", "zero3", "pipeline"]
    assert "all 8 parameters" in done.stdout  # Dropout(0.25) is in the model: verify turned it off


def test_the_strategies_agree_on_the_gpt_example(tmp_path):
    # 'script': the script's own strategy, here its pipeline, which cuts the GPT at its blocks (a
    # Cut verify could not guess), checked against the same reference run as the others (the
    # digits test above runs the data-parallel strategies one by one)
    done, _ = verify("-n", "2", "--steps", "2", "--strategy", "ddp,zero3,script",
                     "examples/gpt.py", *GPT_SMALL, "--strategy", "pipeline", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("they agree.") == 3
    assert "2 processes (the script's) against 1 (single), 2 optimizer step(s): they agree." in done.stdout


def test_injected_bugs_are_named_with_their_step_parameter_and_rank(tmp_path):
    cases = [  # (hook, what the report must say)
        ("unaveraged:7.weight:2:1", "optimizer step 2, the gradient of 7.weight", "on rank 1; rank 0 agrees"),
        ("scaled-twice:9.bias:1", "optimizer step 1, the gradient of 9.bias", "on ranks 0, 1"),
        # the digits CNN's 8 parameters (600 KB) share one DDP bucket: dropping it on rank 1 zeroes
        # every gradient there, and the first in backward order is the last layer's bias
        ("dropped-bucket:0.weight:2:1", "optimizer step 2, the gradient of 9.bias", "on rank 1; rank 0 agrees"),
    ]
    reference = tmp_path / "reference"  # one reference run for the three (--reference)
    for index, (hook, where, ranks) in enumerate(cases):
        done, _ = verify("-n", "2", "--steps", "2", "--strategy", "ddp", "--reference", str(reference),
                         "examples/digits.py", "--out", str(tmp_path), inject=hook)
        assert done.returncode == 1, (hook, done.stdout, done.stderr[-2000:])
        assert "they DIFFER" in done.stdout and f"first difference: {where}\n" in done.stdout, done.stdout
        assert ranks in done.stdout, done.stdout
        assert ("is the one in" in done.stdout) == (index > 0), done.stdout


def test_a_summary_of_pieces_adds_up_to_the_whole_and_catches_a_change():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * CHUNK + 17, generator=g)
    cut = CHUNK + 5  # pieces that do not start at a chunk boundary
    parts = summary("w", 0, x[:cut]) + summary("w", cut, x[cut:])
    whole = summary("w", 0, x)
    assert torch.allclose(parts, whole, rtol=1e-10, atol=1e-9)
    n = x.numel()
    held = {0: [(0, cut, summary("w", 0, x[:cut]))], 1: [(cut, n - cut, summary("w", cut, x[cut:]))]}
    assert _check_summaries(whole, held, n, 1e-4, 1e-7)[1] == []  # sharded, equal
    y = x.clone()
    y[cut + 3] += 1.0  # one element of rank 1's piece
    held[1] = [(cut, n - cut, summary("w", cut, y[cut:]))]
    error, bad, _ = _check_summaries(whole, held, n, 1e-4, 1e-7)
    assert bad == [0, 1] and error > 1e-4  # a sharded parameter is compared whole: its holders named


MASKED_SCRIPT = '''
import torch, torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import paratrain as pt

torch.manual_seed(0)
ids = torch.randint(0, 11, (16, 6))
labels = torch.randint(0, 11, (16, 6))
for row in range(16):  # the first rows keep every label, the last keep one
    labels[row, 6 - (row // 3) % 6:] = -100 if row >= 8 else labels[row, 6 - (row // 3) % 6:]
model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 11))
session = pt.Session("ddp")
model, optimizer, loader = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                         DataLoader(TensorDataset(ids, labels), batch_size=8))
for _ in range(3):
    for x, y in loader:
        session.train_step((x, y), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                           weight="tokens")
'''


def test_token_weighted_losses_are_compared_over_every_token(tmp_path):
    """Rank 1's half of each batch holds fewer label tokens than rank 0's: one process's loss is
    the mean over all of them, and so must the ranks' be, weighted by their tokens. A reference
    kept by --reference is run again once the script changes (the injected-bugs test reuses one);
    a directory of other files is refused, untouched."""
    script = tmp_path / "masked.py"
    reference = tmp_path / "reference"
    for lr in ("0.5", "0.25"):
        script.write_text(MASKED_SCRIPT.replace("lr=0.5", f"lr={lr}"))
        done, _ = verify("-n", "2", "--steps", "3", "--reference", str(reference), str(script))
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        assert "2 processes (the script's) against 1 (single), 3 optimizer step(s): they agree." in done.stdout
        assert ("running it again" in done.stdout) == (lr == "0.25") and "is the one in" not in done.stdout
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    done, _ = verify("-n", "2", "--reference", str(other), str(script))
    assert done.returncode != 0 and "holds files that are not a reference run" in done.stderr, done.stderr
    assert (other / "notes.txt").read_text() == "keep me"


def test_verify_checks_a_tensor_parallel_job_and_names_a_bug_in_a_slice(tmp_path):
    """tp2 × zero3 at 4 processes, with sequence parallelism and activation checkpointing, agrees
    with one process (each rank's holdings are runs of its slice, or of the flat shard of it); a
    slice's gradient left unaveraged on one rank is named."""
    done, _ = verify("-n", "4", "--steps", "2", "examples/gpt.py", *GPT_SMALL, "--tp", "2", "--strategy", "zero3",
                     "--sequence-parallel", "--activation-checkpointing", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "4 processes (the script's) against 1 (single), 2 optimizer step(s): they agree." in done.stdout
    done, _ = verify("-n", "2", "--steps", "2", "examples/gpt.py", *GPT_SMALL, "--tp", "2", "--out", str(tmp_path),
                     inject="unaveraged:blocks.1.attn.q.weight:2:1")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "first difference: optimizer step 2, the gradient of blocks.1.attn.q.weight\n" in done.stdout, done.stdout
    assert "on rank 1; rank 0 agrees" in done.stdout, done.stdout


def test_the_summaries_of_a_slices_runs_add_up_to_the_whole():
    """A parameter cut along its columns (a row-parallel weight) is held as a run per row; the
    two slices' summaries, each the sum over its runs, add up to the whole parameter's."""
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(3, CHUNK // 2 + 8, dtype=torch.float64, generator=g)  # rows across chunk bounds
    parts = whole.chunk(2, dim=1)
    total = 0
    for index, part in enumerate(parts):
        runs = Slice(1, index, 2).runs(part.shape, 0, part.numel())
        assert len(runs) == 3 and sum(n for _, _, n in runs) == part.numel()
        flat = part.reshape(-1)
        for at, local, n in runs:
            assert torch.equal(whole.reshape(-1)[at:at + n], flat[local:local + n])
            total = total + summary("w", at, flat[local:local + n])
    assert torch.allclose(total, summary("w", 0, whole.reshape(-1)), rtol=1e-10, atol=1e-9)


def test_verify_checks_a_context_parallel_job_and_names_a_bug_in_it(tmp_path):
    """Under pt.Mesh(cp=2) both ranks read the same batches and each trains on half of every
    sequence: their weighed losses average to one process's, and a gradient left unaveraged on
    one rank is named there."""
    args = ["-n", "2", "--steps", "2", "--reference", str(tmp_path / "reference"), "examples/gpt.py", *GPT_SMALL,
            "--cp", "2", "--out", str(tmp_path)]
    done, _ = verify(*args)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "2 processes (the script's) against 1 (single), 2 optimizer step(s): they agree." in done.stdout
    done, _ = verify(*args, inject="unaveraged:blocks.1.attn.q.weight:2:1")
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    assert "first difference: optimizer step 2, the gradient of blocks.1.attn.q.weight\n" in done.stdout, done.stdout
    assert "on rank 1; rank 0 agrees" in done.stdout, done.stdout

