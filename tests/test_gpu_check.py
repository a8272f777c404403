"""bench/gpu_check.py, the check a session with a lent GPU runs first, in its CPU dry-run mode:
every part runs the code it would run on the GPU, at tiny sizes, and the JSON records each."""

import json
import subprocess
import sys

from tests.support import ROOT_DIR

ROOT = ROOT_DIR


def test_gpu_check_dry_run_runs_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["dry_run"] is True
    for part in ("tests", "session", "mfu", "parity", "nccl"):
        assert results[part]["ok"], (part, results[part])
    assert "collected" in results["tests"]["summary"][0]  # the CUDA-marked tests exist
    rows = results["session"]["rows"]
    cases = ["single", "ddp", "ddp-acc4", "zero2", "zero3"]
    assert [(r["optimizer"], r["case"]) for r in rows] == [(k, c) for k in ("fused", "foreach") for c in cases]
    assert all(r["flops_per_step"] > 0 and r["plain_ms"] > 0 and r["session_ms"] > 0 for r in rows)
    acc = {r["case"]: r["flops_per_step"] for r in rows}
    assert acc["ddp-acc4"] == 4 * acc["ddp"]  # 4 micro-batches of the same batch per optimizer step
    assert 0 < results["mfu"]["mfu_single"]["dry"] < 1
    assert set(results["parity"]["max_param_diff"]) == {"ddp", "zero1", "zero2", "zero3", "zero2-offload",
                                                        "zero3-offload"}
    # CPU ranks against the CPU reference: the parity tests' 1e-6 (a GPU run allows 1e-5, see parity())
    assert results["parity"]["tolerance"] == 1e-6
    assert max(results["parity"]["max_param_diff"].values()) < 1e-6
