"""The GPU check: what only a GPU can show, in one command, for the session that gets one lent.

    python bench/gpu_check.py [--out bench/results/gpu.json]     on a machine with a CUDA device
    python bench/gpu_check.py --dry-run --out /tmp/gpu.json      anywhere: the same code on CPU, tiny

1. tests    the CUDA-marked tests (`pytest -m cuda`; dry run: only collected)
2. session  `Session.train_step` against the plain loop it replaces, examples/gpt.py's model in bf16
            autocast on one GPU, interleaved rounds, medians (target: ratio <= 1.02)
3. mfu      that run's model FLOPs utilisation: FLOPs of one step counted by torch's FlopCounterMode,
            over the device's peak dense bf16 FLOP/s (from a table by name, else a measured matmul)
4. parity   two processes sharing the GPU over gloo with CUDA tensors: DDP and ZeRO 1/2/3 equal to
            one process within 1e-5
5. nccl     a Session("ddp") on the nccl backend at world 1 trains (dry run: gloo)

Each part that fails is recorded with its error, and the others still run. Writes JSON, prints
one line per part, exits 1 when a part failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # models.py: the parity models and their reference
import paratrain as pt  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}  # dense, SXM where both


def gpt_example():
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cuda_tests(dry: bool) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(ROOT / "tests")] + (["--collect-only"] if dry else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    return dict(ok=done.returncode == 0, summary=done.stdout.strip().splitlines()[-1:], command=" ".join(cmd[2:]))


def session_overhead(dry: bool, device: torch.device, rounds: int, steps: int) -> dict:
    """Plain loop and train_step on two copies of one model, same batches, bf16 autocast."""
    gpt = gpt_example()
    shape = dict(block=32, layers=2, width=64, heads=4) if dry else dict(block=256, layers=6, width=384, heads=6)
    batch = 4 if dry else 32
    torch.manual_seed(0)
    make = lambda: gpt.GPT(len(gpt.ALPHABET), shape["block"], shape["layers"], shape["width"], shape["heads"])  # noqa: E731
    x = torch.randint(0, len(gpt.ALPHABET), (batch, shape["block"]), device=device)
    session = pt.Session("single", precision="bf16", progress_bar=False)
    plain_model = make().to(device)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-4)
    model = make()
    model, _ = session.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def plain():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = gpt.next_token_loss(plain_model(x), x)
        loss.backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    def ours():
        session.train_step((x, x), gpt.next_token_loss)

    times = _interleaved({"plain": plain, "session": ours}, device, rounds, steps)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    flops = _step_flops(plain_model, x, gpt.next_token_loss)
    session.close()
    return dict(ok=True, plain_ms=ms["plain"], session_ms=ms["session"], ratio=ms["session"] / ms["plain"],
                target_met=ms["session"] / ms["plain"] <= 1.02, flops_per_step=flops,
                params=sum(p.numel() for p in plain_model.parameters()), batch=batch, **shape)


def _interleaved(steps_of: dict, device: torch.device, rounds: int, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in steps_of}
    for r in range(rounds + 1):  # round 0 warms up
        for name in list(steps_of)[r % 2:] + list(steps_of)[:r % 2]:
            for _ in range(steps):
                _sync(device)
                start = time.perf_counter()
                steps_of[name]()
                _sync(device)
                if r:
                    out[name].append(time.perf_counter() - start)
    return out


def _step_flops(model, x, loss_fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), x).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mfu(overhead: dict, device: torch.device, dry: bool) -> dict:
    peak, source = _peak(device, dry)
    achieved = overhead["flops_per_step"] / (overhead["session_ms"] / 1e3)
    return dict(ok=True, achieved_flops=achieved, peak_flops=peak, peak_source=source, mfu=achieved / peak)


def _peak(device: torch.device, dry: bool) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_BF16.items():
            if key in name:
                return value, f"table: {name}"
    n = 256 if dry else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    a @ a
    _sync(device)
    start = time.perf_counter()
    for _ in range(5):
        a @ a
    _sync(device)
    return 5 * 2 * n ** 3 / (time.perf_counter() - start), f"measured {n}x{n} matmul"


def _parity_rank(topo, strategy: str, device: str):
    from models import make_batches, make_model

    topo = dataclasses.replace(topo, device=torch.device(device))  # gloo, CUDA tensors
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    xs, ys = make_batches(3, 16)
    for x, y in zip(xs, ys):
        session.train_step((x.chunk(2)[topo.rank], y.chunk(2)[topo.rank]), F.cross_entropy)
    return {k: v.cpu() for k, v in session.full_state_dict().items()}


def parity(device: torch.device) -> dict:
    from models import reference

    expected = reference("mlp", "sgd", world=2, accumulate=1, steps=3, global_batch=16)
    diffs = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        states = run_on_ranks(_parity_rank, 2, strategy, str(device), timeout=600)
        diffs[strategy] = max(max_param_diff({k: s[k] for k in expected}, expected) for s in states)
    # On the CPU (the dry run) the reference's arithmetic is the ranks': 1e-6 as in tests/. On a GPU
    # the ranks' cuBLAS kernels sum in another order than the CPU reference's, so 1e-5 there.
    tolerance = 1e-6 if device.type == "cpu" else 1e-5
    return dict(ok=all(d < tolerance for d in diffs.values()), max_param_diff=diffs, tolerance=tolerance)


def nccl_world_one(dry: bool) -> dict:
    from models import make_batches, make_model

    backend = "gloo" if dry else "nccl"
    session = pt.Session("ddp", topology=pt.Topology.from_env(backend=backend), progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    xs, ys = make_batches(3, 8)
    losses = [session.train_step((x, y), F.cross_entropy).item() for x, y in zip(xs, ys)]
    session.close()
    return dict(ok=all(map(lambda v: v == v, losses)), backend=backend, losses=losses)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    parser.add_argument("--dry-run", action="store_true", help="the same code on CPU, tiny sizes, no GPU needed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a machine with one, or pass --dry-run")
    device = torch.device("cpu" if dry else "cuda", 0 if not dry else None)
    results: dict = {"device": torch.cuda.get_device_name(0) if not dry else "cpu (dry run)",
                     "torch": torch.__version__, "dry_run": dry}
    parts = [("tests", lambda: run_cuda_tests(dry)),
             ("session", lambda: session_overhead(dry, device, 2 if dry else args.rounds, 2 if dry else args.steps)),
             ("mfu", lambda: mfu(results["session"], device, dry)),
             ("parity", lambda: parity(device)), ("nccl", lambda: nccl_world_one(dry))]
    for name, part in parts:
        try:
            results[name] = part()
        except Exception as e:  # record it, go on: each part tells something of its own
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
        pt.destroy()
        print(f"{name:8s} {'ok' if results[name].get('ok') else 'FAILED'}  "
              f"{ {k: v for k, v in results[name].items() if k not in ('trace', 'ok')} }", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(results[name].get("ok") for name, _ in parts) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
