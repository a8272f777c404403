"""CPU ranks: keep freed large blocks for the next step instead of returning them to the OS.

glibc's malloc serves a block above its mmap threshold (which moves with what the process freed
before, up to 32 MiB) with a fresh mmap, and unmaps it when freed; the heap's top is trimmed
above its trim threshold too. A training step allocates the same large tensors every time —
Adam's temporaries, the size of each tensor it steps; ZeRO-2's gradient buckets, freed after
each reduction; the gradients autograd makes after zero_grad(set_to_none=True) — so every step
pays a page fault per 4 KiB of them, and how many depends on what the process allocated
before. `python bench/cpu_malloc.py` measures both ways (README, "Launching"): a ZeRO-2 step
of the bench MLP at world 1 went from 67,600 page faults to 16, and 0.78 × the time.

Raised to `THRESHOLD`, freed blocks go back to the heap and the next step reuses them: no
faults, and times that do not depend on the allocation history (which `paratrain plan` relies
on). The price: the process's resident memory stays at its peak rather than shrinking between
steps, which a training process reaches every step anyway.

`paratrain run` sets the environment variables glibc reads at start (`ENV`) for its ranks,
unless they are set already: set them yourself to choose other values (131072 is glibc's
starting threshold for both). `keep_freed_blocks()` does the same in a running process
(mallopt), for processes the launcher did not start: `paratrain plan --calibrate`'s and
bench/plan_accuracy.py's ranks, so that the planner measures and predicts ranks as
`paratrain run` starts them.
"""

from __future__ import annotations

import ctypes
import ctypes.util

THRESHOLD = 1 << 30  # bytes: blocks up to 1 GiB come from (and go back to) the heap
ENV = {"MALLOC_MMAP_THRESHOLD_": str(THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(THRESHOLD)}
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def launch_env(environ: dict) -> None:
    """Set `ENV` in `environ` where it is not set already (the launcher's, before the ranks start)."""
    for name, value in ENV.items():
        environ.setdefault(name, value)


def keep_freed_blocks() -> bool:
    """Raise this process's mmap and trim thresholds to THRESHOLD (glibc); False where there is
    no glibc or it refused."""
    return set_thresholds(THRESHOLD)


def set_thresholds(threshold: int) -> bool:
    """Set this process's mmap and trim thresholds (mallopt) to `threshold` bytes, which also
    stops the mmap threshold moving; False where there is no glibc or it refused."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, threshold))
