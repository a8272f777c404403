"""bench/: timings taken on a busy machine are refused unless --force, and say what the load was."""

import argparse
import importlib.util
import json
import os
import sys

import pytest

from tests.support import ROOT_DIR

BENCH = os.path.join(ROOT_DIR, "bench")
sys.path.insert(0, BENCH)
import common  # noqa: E402


def _args(tmp_path, force=False):
    return argparse.Namespace(out=str(tmp_path / "results.json"), quick=False, force=force)


def _loads(monkeypatch, now, cores=2):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "getloadavg", lambda: (now, 1.0, 1.0))
    monkeypatch.setattr(common, "provenance", lambda: dict(commit="abc1234", host="h", date="d"))  # no git here


def test_results_record_their_commit_host_and_date(tmp_path, monkeypatch):
    import subprocess

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH, capture_output=True, text=True)
    found = common.provenance()
    assert found["commit"].removesuffix("+dirty") == (head.stdout.strip() or "unknown")
    assert f"({os.cpu_count()} cores)" in found["host"] and found["date"].endswith(" UTC")
    _loads(monkeypatch, 1.0)
    common.write_results(_args(tmp_path), {}, (0.3, 1.0, 1.0), ranks=0, models={})
    settings = json.loads((tmp_path / "results.json").read_text())["settings"]
    assert (settings["commit"], settings["host"], settings["date"]) == ("abc1234", "h", "d")


@pytest.mark.parametrize("before,after,busy", [
    (3.1, 0.4, r"before 3\.10"), (0.4, 3.6, r"after 3\.60 \(1\.60 beyond its 2 ranks\)"),
    (8.5, 10.7, r"before 8\.50, after 10\.70 \(8\.70 beyond its 2 ranks\)")])
def test_results_of_a_busy_machine_are_refused_naming_the_load(tmp_path, monkeypatch, before, after, busy):
    _loads(monkeypatch, after)  # 2 cores: busy above 1.5, after: beyond the benchmark's own 2 ranks
    with pytest.raises(SystemExit, match=rf"busy \(1-minute load average {busy}; above 1\.50.*--force"):
        common.write_results(_args(tmp_path), {}, (before, 1.0, 1.0), ranks=2, models={})
    assert not (tmp_path / "results.json").exists()


def test_the_load_after_counts_the_benchmarks_own_ranks(tmp_path, monkeypatch):
    _loads(monkeypatch, 3.4)  # its 2 busy ranks and 1.4 of other work: quiet enough on 2 cores
    common.write_results(_args(tmp_path), {}, (0.3, 1.0, 1.0), ranks=2, models={})
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["busy_ranks"] == 2


def test_a_quiet_machine_or_force_writes_the_results_with_their_loads(tmp_path, monkeypatch):
    _loads(monkeypatch, 1.5)
    common.write_results(_args(tmp_path), {}, (0.3, 1.0, 1.0), ranks=0, models={})
    settings = json.loads((tmp_path / "results.json").read_text())["settings"]
    assert settings["load_average_before"][0] == 0.3 and settings["load_average_after"][0] == 1.5
    assert settings["forced"] is False
    _loads(monkeypatch, 6.0, cores=4)  # the limit scales with the cores: 3.0 on 4
    common.write_results(_args(tmp_path, force=True), {}, (0.3, 1.0, 1.0), ranks=0, models={})
    assert json.loads((tmp_path / "results.json").read_text())["settings"]["forced"] is True


def test_a_busy_machine_is_refused_before_the_run_starts(tmp_path, monkeypatch):
    _loads(monkeypatch, 2.0)
    with pytest.raises(SystemExit, match="before 2.00"):
        common.load_at_start(_args(tmp_path))
    assert common.load_at_start(_args(tmp_path, force=True))[0] == 2.0


@pytest.mark.parametrize("name", ["ddp", "zero", "pipeline", "hierarchical", "session", "plan_accuracy", "launch",
                                  "tensor_parallel", "context_parallel"])
def test_every_benchmark_takes_force(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench._parse_args(["--quick", "--force"]).force
    assert not bench._parse_args(["--quick"]).force
