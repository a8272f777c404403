"""docs/benchmarks/ is what tools/bench_pages.py makes of bench/results/*.json, byte for byte, and the
tool's key figures agree with the same figures derived here from the JSON, independently of it."""

import json
import os
import re
import shutil
import sys
from pathlib import Path

from tests.support import ROOT_DIR

ROOT = ROOT_DIR
RESULTS = os.path.join(ROOT, "bench", "results")
PAGES = os.path.join(ROOT, "docs", "benchmarks")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import bench_pages  # noqa: E402


def result(name: str) -> dict:
    with open(os.path.join(RESULTS, f"{name}.json")) as f:
        return json.load(f)


def committed(file: str) -> str:
    with open(os.path.join(PAGES, file)) as f:
        return f.read()


def test_committed_pages_are_what_the_json_gives():
    pages = bench_pages.render_all(RESULTS)
    on_disk = sorted(f for f in os.listdir(PAGES) if f.endswith(".md"))
    assert sorted(pages) == on_disk  # no page without its JSON, no JSON's page missing
    for file, text in pages.items():
        assert committed(file) == text, f"{file} is stale: run python tools/bench_pages.py"


def test_every_result_has_a_page_and_holds_no_raw_rounds():
    assert bench_pages.unpaged(RESULTS) == []
    for name in bench_pages.result_names(RESULTS):  # per-round timings stay local (bench --raw)
        assert "_round_ms" not in (Path(RESULTS) / f"{name}.json").read_text(), name
    assert {p.file for p in bench_pages.PAGES} >= {"ddp.md", "zero.md", "pipeline.md", "session.md"}


def test_check_names_a_page_that_differs(tmp_path, capsys):
    shutil.copytree(PAGES, tmp_path / "pages")
    assert bench_pages.main(["--check", "--out", str(tmp_path / "pages")]) == 0
    page = tmp_path / "pages" / "ddp.md"
    page.write_text(page.read_text().replace("| MLP |", "| MLP (edited) |"))
    capsys.readouterr()
    assert bench_pages.main(["--check", "--out", str(tmp_path / "pages")]) == 1
    assert "ddp.md: differs" in capsys.readouterr().out


def test_provenance_is_what_the_json_records_and_nothing_else():
    zero = committed("zero.md")
    assert f"commit {result('zero')['settings']['source']}; torch 2.13.0+cpu; host not recorded;" in zero
    assert "commit not recorded; torch not recorded; host not recorded; date not recorded; load average not " \
           "recorded." in committed("plan_published.md")
    before = result("ddp")["settings"]["load_average_before"]
    assert f"load average {before[0]:.2f} / {before[1]:.2f} / {before[2]:.2f} before" in committed("ddp.md")
    recorded = {data.get("settings", {}).get("date", "")[:10] for data in (result(f[:-5]) for f in os.listdir(RESULTS) if f.endswith(".json"))} - {""}
    for file in os.listdir(PAGES):  # a date on a page is one a run recorded, never written by hand
        assert set(re.findall(r"\b20\d\d-\d\d-\d\d\b", committed(file))) <= recorded, file


# -- the tool's figures, derived again here ---------------------------------------------------------

def test_ddp_ratios_and_peaks():
    page = committed("ddp.md")
    for m in result("ddp")["models"].values():
        assert (f"| {m['ours_ms']:.1f} | {m['torch_ms']:.1f} | {m['ours_ms'] / m['torch_ms']:.3f} | 0e+00 | "
                f"{m['ours_peak_mb']:.0f} | {m['torch_peak_mb']:.0f} |") in page
        assert f"| {m['params'] / 1e6:.1f} M |" in page


def test_zero_bytes_against_the_formula():
    page = committed("zero.md")
    rows = 0
    for stage, models in result("zero")["results"].items():
        for r in models.values():
            ours, formula = r["ours_bytes"] / 2**20, r["formula_bytes"] / 2**20
            assert f"| {r['ours_ms'] / r['reference_ms']:.3f} | {ours:.1f} | {formula:.1f} | " \
                   f"{r['ours_bytes'] / r['formula_bytes']:.3f} |" in page
            rows += 1
    assert rows == len(re.findall(r"^\| [123] \|", page, re.M)) == 6


def test_pipeline_peaks_are_the_larger_stage():
    bench = result("pipeline")
    page = committed("pipeline.md")
    for r in bench["results"]:
        ours, theirs = max(r["ours_peak_mb"]), max(r["torch_peak_mb"])
        assert (f"| {r['schedule']} | {r['microbatches']} | {r['ours_ms']:.1f} | {r['torch_ms']:.1f} | "
                f"{r['ours_ms'] / r['torch_ms']:.3f} | {ours:.1f} | {theirs:.1f} |") in page
    g = bench["gpt"]
    assert f"| {g['split_at'][0]} | {g['schedule']} | {g['microbatches']} | {g['ours_ms']:.1f} |" in page


def test_session_ratios_from_the_added_time():
    """The ratio is 1 + the median added time per step over the plain step, and the added time per
    micro-batch is that over the accumulation: both re-derived from the JSON's summaries."""
    page = committed("session.md")
    off = {(r["model"], r["case"]): r for r in result("session_no_nan_check")["results"]}
    for r in result("session")["results"]:
        added = r["added_ms_per_microbatch"] * r["accumulate"]
        per_microbatch = r["added_ms_per_microbatch"]
        o = off[(r["model"], r["case"])]
        o_added = o["added_ms_per_microbatch"] * o["accumulate"]
        assert (f"| {r['case']} | {r['plain_ms']:.2f} | {r['session_ms']:.2f} | {1 + added / r['plain_ms']:.3f} ± "
                f"{r['ratio_error']:.3f} | {per_microbatch:.3f} | {1 + o_added / o['plain_ms']:.3f} ± ") in page


def test_launch_and_plan_accuracy_figures():
    launch = result("launch")["results"]
    torchrun = next(r for r in launch if r["launcher"] == "torchrun")
    for r in launch:
        assert f"| {r['total_s']:.2f} | {r['total_s'] / torchrun['total_s']:.3f} |" in committed("launch.md")
    page = committed("plan_accuracy.md")
    for name in ("plan_accuracy", "plan_accuracy_accumulate"):
        cases = result(name)["cases"]
        within = sum(abs(r["predicted_step_s"] / r["measured_step_s"] - 1) <= 0.15
                     and abs(r["predicted_peak_mb"] / r["measured_peak_mb"] - 1) <= 0.10 for r in cases)
        assert f"{within} of {len(cases)} cases within both targets" in page


def test_context_parallel_ratios_and_memory():
    r = result("context_parallel")["llama"]
    page = committed("context_parallel.md")
    assert f"| {r['ring_ms']:.1f} | {r['all_gather_ms']:.1f} | {r['ring_ms'] / r['all_gather_ms']:.3f} |" in page
    one = r["memory"]["one_process"]
    ring = r["memory"]["ring"]
    assert f"| ring, per rank | {ring['peak_mb']:.1f} | {ring['saved_bytes'] / 2**20:.1f} | " \
           f"{ring['peak_mb'] / one['peak_mb']:.3f} | {ring['saved_bytes'] / one['saved_bytes']:.3f} |" in page
