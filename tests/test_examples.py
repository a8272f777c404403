"""The README's demo, run as a user runs it (through `paratrain run`, two processes), its test command,
and the benchmark pages' figures against the committed results."""

import csv
import os
import re
import subprocess
import sys

import pytest
import torch

from tests.support import ROOT_DIR

ROOT = ROOT_DIR


@pytest.mark.parametrize("strategy", ["ddp", "pipeline"])  # pipeline: 2 stages, its forward evaluates
def test_digits_demo_with_two_ranks_reaches_095(tmp_path, strategy):
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "examples/digits.py",
           "--strategy", strategy, "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = float(re.search(r"^test accuracy: (0\.\d+)$", done.stdout, re.M).group(1))
    assert accuracy >= 0.95
    assert re.search(r"^samples per second: \d+", done.stdout, re.M)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10 and float(rows[-1]["loss"]) < float(rows[0]["loss"])
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_the_demo_reads_the_same_digits_as_sklearn_without_importing_it(tmp_path):
    import numpy as np
    from sklearn.datasets import load_digits  # the reference, imported by the test only

    code = ("import importlib.util, sys, numpy; spec = importlib.util.spec_from_file_location('d', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); x, y = m._load_digits(); "
            "numpy.save(sys.argv[2], numpy.concatenate([x, y[:, None]], 1)); print('sklearn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, os.path.join(ROOT, "examples", "digits.py"),
                           str(tmp_path / "digits.npy")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"  # the demo's ranks never import sklearn (1.3 s each)
    table = np.load(tmp_path / "digits.npy")
    x, y = load_digits(return_X_y=True)
    assert table.shape == (1797, 65)
    assert np.array_equal(table[:, :-1], x) and np.array_equal(table[:, -1].astype(int), y)


def test_readme_test_command_is_what_ci_runs():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read().strip().splitlines()
    commands = re.findall(r"```bash\n(.*?)\n```", readme)
    assert commands[1] in ci  # the second command of the README runs the tests, as a line of its own
    assert "torch==2.13.0" in commands[0] and "examples/digits.py" in commands[0]


def test_hf_causal_lm_example_trains_resumes_and_exports_for_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cmd = [sys.executable, "-m", "paratrain", "run", "-n", "2", "examples/hf_causal_lm.py", "--strategy", "zero3",
           "--steps", "40", "--checkpoint-every", "20", "--out", str(tmp_path)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    losses = re.search(r"loss: first (\d+\.\d+) last (\d+\.\d+)", first.stdout)
    assert float(losses.group(2)) < float(losses.group(1)) - 0.5  # it learns
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "resumed at optimizer step 40" in again.stdout, again.stderr[-3000:]
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model")
    alphabet = "\n" + "".join(chr(c) for c in range(32, 127))  # examples/gpt.py's characters
    ids = torch.tensor([[alphabet.index(c) for c in "Return the number of items in the list, or None."]])
    untrained = transformers.GPT2LMHeadModel(model.config)
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss < untrained(input_ids=ids, labels=ids).loss - 0.5


# -- the benchmark pages (docs/benchmarks, written by tools/bench_pages.py) against bench/results:
# consistency of committed figures, which no code change can fail; the benchmarks themselves refuse
# a busy machine (tests/test_bench.py), and tests/test_bench_pages.py checks that the pages are
# the generator's output


def bench_pages(*names: str) -> str:
    """The text of the named benchmark pages (default: all of them)."""
    folder = os.path.join(ROOT, "docs", "benchmarks")
    return "\n".join(open(os.path.join(folder, name)).read() for name in names or sorted(os.listdir(folder)))


def test_docs_ddp_table_is_consistent_with_bench_json():
    import json

    readme = bench_pages()
    results = json.load(open(os.path.join(ROOT, "bench", "results", "ddp.json")))["models"]
    for label, name in [("MLP", "mlp"), ("small GPT", "transformer"), ("MLP, bf16 hook", "mlp+bf16")]:
        m = results[name]
        row = re.search(rf"^\| {label} \| .*$", readme, re.M).group(0)
        assert f"| {m['ours_ms']:.1f} | {m['torch_ms']:.1f} | {m['ratio']:.3f} |" in row
        assert m["ratio"] <= 1.05 and m["max_param_diff"] <= 1e-6
        assert m["ours_peak_mb"] <= m["torch_peak_mb"]


def test_docs_pipeline_table_is_consistent_with_bench_json():
    import json

    readme = bench_pages()
    bench = json.load(open(os.path.join(ROOT, "bench", "results", "pipeline.json")))
    assert not bench["settings"]["quick"]
    for r in bench["results"]:
        row = (f"| {r['schedule']} | {r['microbatches']} | {r['ours_ms']:.1f} | {r['torch_ms']:.1f} | "
               f"{r['ratio']:.3f} | {max(r['ours_peak_mb']):.1f} | {max(r['torch_peak_mb']):.1f} |")
        assert row in readme
        assert r["ratio"] <= 1.0 and r["max_param_diff"] == 0
    r = bench["replicas"]  # 2 stages x 2 replicas, gradients through DDP's buckets
    assert (f"| {r['schedule']} | {r['stages']} × {r['replicas']} | {r['microbatches']} | {r['ours_ms']:.1f} | "
            f"{r['torch_ms']:.1f} | {r['ratio']:.3f} | {r['max_param_diff']:.0e} |") in readme
    g = bench["gpt"]  # a GPT cut at a named block, against torch.distributed.pipelining at the same point
    assert (f"| {', '.join(g['split_at'])} | {g['schedule']} | {g['microbatches']} | {g['ours_ms']:.1f} | "
            f"{g['torch_ms']:.1f} | {g['ratio']:.3f} | {g['max_param_diff']:.0e} |") in readme
    assert g["ratio"] <= 1.0 and g["max_param_diff"] == 0
    assert r["max_param_diff"] <= 1e-6  # against torch's DDP over the replicas: other bucket sums (2.4e-7)


def test_docs_zero_table_is_consistent_with_bench_json():
    import json

    readme = bench_pages()
    bench = json.load(open(os.path.join(ROOT, "bench", "results", "zero.json")))
    assert not bench["settings"]["quick"]
    labels = {"mlp": "MLP", "transformer": "small GPT"}
    rows = 0
    for stage, models in bench["results"].items():
        for name, r in models.items():
            mib = 2.0**20
            row = (f"| {stage.removeprefix('stage')} | {labels[name]} {r['params'] / 1e6:.1f} M | {r['reference']} | "
                   f"{r['ours_ms']:.1f} | {r['reference_ms']:.1f} | {r['ratio']:.3f} | {r['ours_bytes'] / mib:.1f} | "
                   f"{r['formula_bytes'] / mib:.1f} | {r['ours_bytes_over_formula']:.3f} | {r['max_param_diff']:.0e} |")
            assert row in readme, row
            rows += 1
    assert rows == len(re.findall(r"^\| [123] \| (MLP|small GPT) ", readme, re.M)) == 6


def test_docs_session_table_is_consistent_with_bench_json():
    import json

    readme = bench_pages("session.md")
    bench = json.load(open(os.path.join(ROOT, "bench", "results", "session.json")))
    off = json.load(open(os.path.join(ROOT, "bench", "results", "session_no_nan_check.json")))
    assert not bench["settings"]["quick"] and not off["settings"]["quick"]
    assert bench["settings"].get("nan_check", True) and off["settings"]["nan_check"] is False
    assert not bench["settings"].get("control") and not off["settings"].get("control")  # not an A/A run
    assert bench["settings"]["keep_freed_blocks"] and off["settings"]["keep_freed_blocks"]  # as the README says
    labels = {"tiny": "tiny MLP", "mlp": "MLP", "transformer": "small GPT"}
    for r in bench["results"]:
        o = next(x for x in off["results"] if (x["model"], x["case"]) == (r["model"], r["case"]))
        row = (f"| {labels[r['model']]} | {r['case']} | {r['plain_ms']:.2f} | {r['session_ms']:.2f} | "
               f"{r['ratio']:.3f} ± {r['ratio_error']:.3f} | {r['added_ms_per_microbatch']:.3f} | "
               f"{o['ratio']:.3f} ± {o['ratio_error']:.3f} | {o['added_ms_per_microbatch']:.3f} |")
        assert row in readme, row
        assert r["max_param_diff"] == 0 and o["max_param_diff"] == 0  # the same steps as the plain loop
    rows = re.findall(r"^\| (?:tiny MLP|MLP|small GPT) \| (?:ddp|zero2|zero3|ddp-acc4) \|", readme, re.M)
    assert len(rows) == len(bench["results"]) == 12


def test_docs_launch_table_is_consistent_with_bench_json():
    import json

    readme = bench_pages()
    bench = json.load(open(os.path.join(ROOT, "bench", "results", "launch.json")))
    assert not bench["settings"]["quick"] and bench["settings"]["processes"] == 2
    labels = {"torchrun": "torchrun", "paratrain": "paratrain run"}
    for r in bench["results"]:
        row = (f"| {labels[r['launcher']]} | {r['start_s']:.2f} | {r['imports_s']:.2f} | {r['script_s']:.2f} | "
               f"{r['exit_s']:.2f} | {r['total_s']:.2f} | {r['ratio']:.3f} |")
        assert row in readme, row
    assert "a script that imports paratrain, opens a `Session(\"ddp\")` and closes it, on 2 ranks" in readme
    assert f"alternately, {bench['settings']['rounds']} rounds;" in " ".join(readme.split())


def test_docs_big_model_table_is_consistent_with_bench_json():
    import json

    readme = bench_pages()
    bench = json.load(open(os.path.join(ROOT, "bench", "results", "big_model.json")))
    assert not bench["settings"]["quick"] and bench["settings"]["world"] == 4
    assert bench["whole_model"]["params"] > 300_000_000  # training state of several GB: 16 bytes each
    for r in bench["rows"]:
        row = (f"| {r['setup']:.0f} | {r['setup_ratio']:.3f} | {r['train']:.0f} | {r['formula']:.0f} | "
               f"{r['train_ratio']:.3f} | {r['activations']:.1f} |")
        assert row in readme, row
        assert r["setup_ratio"] <= 1.1  # the setup target
    assert f"{bench['activation_cut']:.1f} × fewer activation bytes" in readme and bench["activation_cut"] >= 2


def test_docs_flight_recorder_cost_is_consistent_with_bench_json():
    import json

    readme = " ".join(bench_pages().split())
    bench = json.load(open(os.path.join(ROOT, "bench", "results", "flight_recorder.json")))
    ddp = json.load(open(os.path.join(ROOT, "bench", "results", "ddp.json")))["models"]
    assert f"| cost | {bench['per_call_us']['cpu']:.1f} |" in readme  # µs of CPU per collective
    for name in ("mlp", "transformer"):
        m = bench["models"][name]
        assert m["step_ms"] == ddp[name]["ours_ms"]  # the step bench/ddp.py measured, recorder on
        assert f"{m['share_of_step']:.2%}" in readme and m["share_of_step"] <= 0.01  # the recorder's target: 1 % of a step


def test_docs_gpu_table_is_consistent_with_gpu_check_json():
    import json

    readme = bench_pages()
    gpu = json.load(open(os.path.join(ROOT, "bench", "results", "gpu.json")))
    assert not gpu["dry_run"] and "H200" in gpu["device"] and "H200" in readme
    labels = {"gpt-11m": "GPT 10.8 M", "gpt-85m": "GPT 85.9 M"}
    for r in gpu["session"]["rows"]:
        kind = r.get("optimizer", "foreach")  # runs before --optimizers stepped torch's default, foreach
        assert (f"| {labels[r['model']]} | {r['case']} | {kind} | {r['plain_ms']:.2f} | {r['session_ms']:.2f} | "
                f"{r['ratio']:.3f} | {r['session_unchecked_ms'] / r['plain_ms']:.3f} | "
                f"{r['plain_again_ms'] / r['plain_ms']:.3f} |") in readme
    met = sum(r["target_met"] for r in gpu["session"]["rows"])
    assert f"{met} of {len(gpu['session']['rows'])} rows meet the 2 % target" in readme
    mfu = gpu["mfu"]["mfu_single"]
    assert f"{100 * mfu['gpt-11m']:.1f} % (gpt-11m), {100 * mfu['gpt-85m']:.1f} % (gpt-85m)" in readme
    assert all(gpu[part]["ok"] for part in ("tests", "session", "mfu", "parity", "nccl"))
    assert max(gpu["parity"]["max_param_diff"].values()) < 3e-8 * 1.01  # "within 3e-8"


def plan_accuracy_row(r: dict) -> str:
    """A case of bench/plan_accuracy.py's JSON as the README's tables print it."""
    model = {"mlp": "MLP", "transformer": "GPT"}[r["model"]]
    return (f"| {model} | {r['strategy']} | {r['world']} | {r['measured_step_s']:.3f} | {r['predicted_step_s']:.3f} | "
            f"{r['step_error'] * 100:+.0f} % | {r['measured_peak_mb']:.0f} | {r['predicted_peak_mb']:.0f} | "
            f"{r['peak_error'] * 100:+.0f} % |").replace("+0 %", "0 %").replace("-0 %", "0 %")


@pytest.mark.parametrize("name,cases", [("plan_accuracy", 28), ("plan_accuracy_accumulate", 10)])
def test_docs_plan_accuracy_tables_are_consistent_with_bench_json(name, cases):
    import json

    readme = bench_pages()
    bench = json.load(open(os.path.join(ROOT, "bench", "results", f"{name}.json")))
    assert not bench["settings"]["quick"] and len(bench["cases"]) == cases
    for r in bench["cases"]:
        assert plan_accuracy_row(r) in readme, plan_accuracy_row(r)
    within = sum(abs(r["step_error"]) <= 0.15 and abs(r["peak_error"]) <= 0.10 for r in bench["cases"])
    assert f"{within} of {cases}" in readme
