"""What the benchmarks share: the two models and their data, one training step, interleaved
timing, peak-memory measurement on CPU, bytes held counted from tensors, and the results table.

The models, data, training step, `time_interleaved` and the memory readers run inside the ranks
(started by `paratrain.testing.run_on_ranks`); `slowest_rank`, `summarize_times`, `print_table`
and `write_json`/`write_results` (which refuse a busy machine) in the launching process. Linux only: peak memory reads /proc and calls glibc's
mallopt.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import time
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.launch.cpu_malloc import set_thresholds

SEQ = 64  # tokens per transformer sequence
VOCAB = 8192


def mlp() -> nn.Module:
    """1024 → 2048 → 4 × (2048 → 2048) → 10, ReLU between: 18,905,098 parameters."""
    widths = [1024, 2048, 2048, 2048, 2048, 2048]
    layers: list[nn.Module] = []
    for d_in, d_out in zip(widths, widths[1:]):
        layers += [nn.Linear(d_in, d_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], 10))


class TinyGPT(nn.Module):
    """Token + position embedding, 7 pre-norm causal encoder layers (d 256, 4 heads, MLP 1024, no
    dropout), final LayerNorm, untied head to an 8192-token vocabulary: 9,739,520 parameters.
    The causal mask is a buffer (as in nanoGPT), which DDP broadcasts from rank 0 at every forward."""

    def __init__(self, d: int = 256, layers: int = 7, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(SEQ),
                             persistent=False)

    def example_inputs(self, batch: int, seq: int | None = None) -> tuple[torch.Tensor]:
        """What `paratrain plan` feeds it (plan/model/source.py)."""
        return (torch.zeros(batch, seq or SEQ, dtype=torch.long),)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, SEQ) → (B, SEQ, VOCAB)
        h = self.embed(tokens) + self.pos
        return self.head(self.norm(self.blocks(h, mask=self.causal, is_causal=True)))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "transformer": TinyGPT}


def make_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def make_batches(name: str, batch: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of `batch` samples: MLP rows (x: (batch, 1024), y: (batch,) in 0..9), or
    transformer tokens (x, y: (batch // SEQ, SEQ) in 0..VOCAB-1, y the next token)."""
    g = torch.Generator().manual_seed(seed)
    if name == "mlp":
        return [(torch.randn(batch, 1024, generator=g), torch.randint(0, 10, (batch,), generator=g))
                for _ in range(count)]
    if batch % SEQ:
        raise ValueError(f"the transformer takes the batch in tokens, a multiple of {SEQ}; got {batch}")
    out = []
    for _ in range(count):
        tokens = torch.randint(0, VOCAB, (batch // SEQ, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's logits (..., classes) against y (...)."""
    return F.cross_entropy(model(x).flatten(0, -2), y.flatten())


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One plain step as a user writes it: forward, loss, backward, step, zero_grad (to None)."""
    loss = loss_of(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def interleave(run_block: Callable[[str, int], list[float]], impls: list[str], rounds: int,
               steps: int) -> dict[str, list[float]]:
    """`rounds` rounds; in each, every implementation runs `steps` timed steps, the order rotated
    by one each round (with two: alternating which goes first). Returns every step's time."""
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for r in range(rounds):
        for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
            times[impl] += run_block(impl, steps)
    return times


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """A step ends when its slowest rank ends: the per-step maximum over ranks."""
    return [max(step) for step in zip(*per_rank)]


def time_interleaved(step_of: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
                     batches: list[tuple[torch.Tensor, torch.Tensor]], *, warmup: int, rounds: int,
                     steps: int) -> dict:
    """In a rank: `warmup` untimed steps of each implementation, then `rounds` interleaved rounds
    of `steps` timed steps each (see `interleave`). `step_of[impl](x, y)` runs one training step
    and returns its loss; every implementation walks the same batch sequence, and the ranks meet
    at a barrier before each block. Returns each step's wall time (perf_counter) and this
    thread's CPU time (thread_time: leaves out waiting for collectives and for other processes)."""
    done = {impl: 0 for impl in step_of}
    cpu: dict[str, list[float]] = {impl: [] for impl in step_of}
    losses: dict[str, torch.Tensor] = {}

    def run_block(impl: str, n: int) -> list[float]:
        dist.barrier()
        times = []
        for _ in range(n):
            x, y = batches[done[impl] % len(batches)]
            start, start_cpu = time.perf_counter(), time.thread_time()
            losses[impl] = step_of[impl](x, y)
            times.append(time.perf_counter() - start)
            cpu[impl].append(time.thread_time() - start_cpu)
            done[impl] += 1
        return times

    interleave(run_block, list(step_of), 1, warmup)
    for warm in cpu.values():
        warm.clear()  # keep the timed steps only
    times = interleave(run_block, list(step_of), rounds, steps)
    if len(set(done.values())) != 1 or not all(map(torch.isfinite, losses.values())):
        raise RuntimeError(f"runs diverged: steps {done}, last losses {losses}")
    return dict(times=times, cpu=cpu)


def summarize_times(per_rank: list[dict], impls: list[str], steps: int) -> dict:
    """In the launching process, from each rank's `time_interleaved` result: per implementation,
    `<impl>_ms` the median step (each step as long as its slowest rank), `<impl>_cpu_ms` the
    median thread CPU time per step (the larger rank), `<impl>_round_ms` each round's median."""
    out = {}
    for impl in impls:
        wall = slowest_rank([r["times"][impl] for r in per_rank])
        out[f"{impl}_ms"] = 1e3 * statistics.median(wall)
        out[f"{impl}_cpu_ms"] = 1e3 * max(statistics.median(r["cpu"][impl]) for r in per_rank)
        out[f"{impl}_round_ms"] = [1e3 * statistics.median(wall[i:i + steps])
                                   for i in range(0, len(wall), steps)]
    return out


# -- bytes held, counted from tensors -----------------------------------------------------------

def distinct_storage_bytes(groups: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes of the storages behind each group's tensors. A storage shared by several tensors
    (views, tied weights, a gradient that views a bucket) counts once, in the first group that
    holds it; a freed storage (resized to 0 bytes) counts nothing; None is skipped."""
    seen: set[int] = set()
    out = {}
    for group, tensors in groups.items():
        out[group] = 0
        for t in tensors:
            storage = None if t is None else t.untyped_storage()
            if storage is None or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            out[group] += storage.nbytes()
    return out


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector sees in this process
    (a cross-check of an explicit count; tensors held only from C++, by DDP's reducer or saved
    by autograd, are not seen)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated objects warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and _has_storage(o)]
    return distinct_storage_bytes({"all": tensors})["all"]


def _has_storage(t: torch.Tensor) -> bool:
    try:  # wrapper subclasses (DTensor) have none; their local tensors are seen on their own
        t.untyped_storage().data_ptr()  # and meta/fake tensors none with data
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


# -- peak memory on CPU -------------------------------------------------------------------------
# glibc serves blocks above a threshold with mmap and gives them back with munmap; below it, from
# a heap that keeps freed memory. The threshold starts at 128 KiB but rises to the size of any
# mmapped block freed (up to 32 MiB), so after torch has freed a few tensors, freed gradients and
# activations stay in the heap: RSS then neither falls nor shows what is live. Fixing the
# threshold (which also stops it moving) makes RSS follow the live tensors: the opposite of what
# paratrain run sets for training (paratrain/launch/cpu_malloc.py), with the same mallopt.


def return_freed_memory_to_os(threshold: int = 64 * 1024) -> None:
    """Make this process's freed blocks above `threshold` bytes go back to the OS, and check it."""
    if not set_thresholds(threshold):
        raise RuntimeError("mallopt refused to set the mmap threshold; peak memory would be wrong")
    before = rss_mb()
    for _ in range(3):  # with a moving threshold the second and third blocks stay in the heap
        block = torch.ones(4 * 2**20)
        del block
    if rss_mb() - before > 4:
        raise RuntimeError(f"freed 16 MiB blocks stayed in RSS ({rss_mb() - before:.1f} MiB)")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def rss_mb() -> float:
    return _status_mb("VmRSS")


def reset_peak_rss() -> None:
    """Set the kernel's high-water mark (VmHWM) back to the current RSS (proc(5), clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb() -> float:
    return _status_mb("VmHWM")


def file_rss_mb() -> float:
    """Resident pages that files back (the libraries' code) or shared memory: not tensors. They
    grow as a run first executes each kernel: the bench GPT's first step paged in ~25 MiB of
    libtorch. Once in, they stay, so VmHWM minus this figure at the end of a run is at most the
    anonymous memory's peak, and short of it only by pages first read after that peak."""
    return _status_mb("RssFile") + _status_mb("RssShmem")


# -- output -------------------------------------------------------------------------------------

def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """columns: (key, header, format spec)."""
    widths = [max(len(h), 10) for _, h, _ in columns]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)))
    for row in rows:
        print("  ".join(format(row[k], spec).rjust(w) for (k, _, spec), w in zip(columns, widths)))


def write_json(path: str | os.PathLike, payload: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


# A machine whose 1-minute load average exceeds this many runnable processes per core is busy:
# the timings would measure other work too (1.5 on the 2-core development machines).
BUSY_LOAD_PER_CORE = 0.75


def refuse_busy_machine(args: argparse.Namespace, ranks: int = 0, **loads: tuple) -> None:
    """Stop (SystemExit) when any of `loads` (os.getloadavg() tuples, by when they were taken) has
    a 1-minute average above BUSY_LOAD_PER_CORE × cores, unless --force was given. The load taken
    `after` the run counts the benchmark's own `ranks` too, each busy the whole run: only the load
    beyond them is other work."""
    cores = os.cpu_count() or 1
    limit = BUSY_LOAD_PER_CORE * cores
    busy = []
    for when, load in loads.items():
        own = ranks if when == "after" else 0  # before the run nothing of the benchmark's is running
        if load[0] - own > limit:
            busy.append(f"{when} {load[0]:.2f}" + (f" ({load[0] - own:.2f} beyond its {own} ranks)" if own else ""))
    if busy and not args.force:
        raise SystemExit(f"not writing {args.out}: the machine is busy (1-minute load average "
                         f"{', '.join(busy)}; above {limit:.2f}, {BUSY_LOAD_PER_CORE} per core on "
                         f"{cores} cores), so the timings would measure other work too. Run it on a "
                         "quiet machine, or pass --force to write them anyway (the JSON records the loads)")


def load_at_start(args: argparse.Namespace) -> tuple:
    """The load averages before a run; refuses a busy machine at once (`refuse_busy_machine`)
    rather than after minutes of timing."""
    load = os.getloadavg()
    refuse_busy_machine(args, before=load)
    return load


def provenance() -> dict:
    """Where and when results were measured, for the benchmark pages (tools/bench_pages.py): the
    commit (with "+dirty" when the tree had changes), the host and its cores, the UTC date."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=os.path.dirname(os.path.abspath(__file__)),
                              capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return dict(commit=commit + ("+dirty" if dirty else ""), host=f"{platform.node()} ({os.cpu_count()} cores)",
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def write_results(args: argparse.Namespace, settings: dict, load_before: tuple, *, ranks: int,
                  **results) -> None:
    """Write `settings` (with torch's version, --quick, --force and the load averages before and
    after the run) and `results` to `args.out` as JSON, and say so; refuse when the machine was
    busy before, or after beyond the benchmark's own `ranks` (the most processes it keeps busy
    at once), unless --force (`refuse_busy_machine`)."""
    load_after = os.getloadavg()
    refuse_busy_machine(args, ranks, before=load_before, after=load_after)
    settings = dict(settings, torch=torch.__version__, quick=args.quick, forced=args.force,
                    load_average_before=load_before, load_average_after=load_after, busy_ranks=ranks,
                    **provenance())
    write_json(args.out, dict(settings=settings, **(results if getattr(args, "raw", False) else drop_rounds(results))))
    print(f"wrote {args.out}; load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(its own {ranks} ranks included)")


def add_write_options(parser: argparse.ArgumentParser) -> None:
    """--force: write results even from a busy machine (see `refuse_busy_machine`); --raw: keep
    the per-round timings in them (see `drop_rounds`)."""
    parser.add_argument("--force", action="store_true",
                        help=f"write the results even when the 1-minute load average exceeds "
                             f"{BUSY_LOAD_PER_CORE} x cores before or after the run")
    parser.add_argument("--raw", action="store_true",
                        help="keep each round's timings (*_round_ms) in the JSON, for a local look: "
                             "the committed results hold the summaries")


def drop_rounds(value):
    """`value` without its per-round timings: every key ending in _round_ms, at any depth. The
    summaries (medians, ratios, their errors) are computed from them before."""
    if isinstance(value, dict):
        return {k: drop_rounds(v) for k, v in value.items() if not k.endswith("_round_ms")}
    if isinstance(value, list):
        return [drop_rounds(v) for v in value]
    return value


def bench_parser(doc: str, *, out_name: str, rounds: int, steps: int, warmup: int,
                 batch: int) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark takes, with its own defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per implementation per round")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per implementation first")
    parser.add_argument("--batch", type=int, default=batch,
                        help=f"samples per rank: MLP rows, transformer tokens (a multiple of {SEQ})")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", out_name),
                        help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true",
                        help="tiny settings for a smoke check (options given explicitly still win)")
    add_write_options(parser)
    return parser


def parse_bench_args(parser: argparse.ArgumentParser, argv, quick: dict) -> argparse.Namespace:
    """Parse; under --quick the `quick` defaults apply (options given explicitly still win)."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    if args.batch <= 0 or args.batch % SEQ or min(args.rounds, args.steps) < 1 or args.warmup < 0:
        parser.error(f"--batch must be a positive multiple of {SEQ} (the transformer's sequence "
                     "length), --rounds and --steps at least 1, --warmup at least 0")
    return args
