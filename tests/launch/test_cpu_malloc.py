"""paratrain/launch/cpu_malloc.py: with the thresholds raised, a large block freed and allocated again
comes back from the heap with no page faults; by default glibc maps it afresh each time. Each
case runs in a process of its own (the setting is process-wide)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import resource, sys
    import torch
    from paratrain.launch.cpu_malloc import keep_freed_blocks
    if sys.argv[1] == "keep":
        assert keep_freed_blocks()
    torch.set_num_threads(1)
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    counts = []
    for _ in range(12):  # as a step's temporaries: the same size, allocated, written, freed
        before = faults()
        torch.ones(2**24).sum()  # 64 MiB, above glibc's largest automatic threshold (32 MiB)
        counts.append(faults() - before)
    # the median of the last five: with thresholds set after start-up the heap may first grow a
    # few times (aligned blocks, and what the imports left on top of it) before a freed block fits
    print(sorted(counts[-5:])[2])
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_blocks_reuses_a_freed_large_block_without_page_faults():
    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    pages = 2**26 // 4096
    assert faults("default") > pages // 2  # mapped afresh, every 4 KiB page touched again
    assert faults("keep") < pages // 100


def test_the_launcher_sets_the_thresholds_unless_the_user_did():
    from paratrain.launch.cpu_malloc import ENV, launch_env

    env = {"MALLOC_TRIM_THRESHOLD_": "0"}
    launch_env(env)
    assert env == {"MALLOC_MMAP_THRESHOLD_": ENV["MALLOC_MMAP_THRESHOLD_"], "MALLOC_TRIM_THRESHOLD_": "0"}
    assert ENV["MALLOC_MMAP_THRESHOLD_"] == str(2**30)
