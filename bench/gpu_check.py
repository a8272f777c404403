"""The GPU check: what only a GPU can show, in one command, for the session that gets one lent.

    python bench/gpu_check.py [--out bench/results/gpu.json]     on a machine with a CUDA device
    python bench/gpu_check.py --dry-run --out /tmp/gpu.json      anywhere: the same code on CPU, tiny

1. tests    the CUDA-marked tests (`pytest -m cuda`; dry run: only collected)
2. session  `Session.train_step` against the plain loop it replaces with the same wrapper (CASES:
            single, ddp, ddp with 4 micro-batches, zero2, zero3; the wrapped ones at world 1 on
            nccl), examples/gpt.py's model at two sizes (SHAPES) in bf16 autocast on one GPU,
            with AdamW fused (the session's NaN check then runs on the device: step.py,
            DeviceCheck) and AdamW as torch defaults it on CUDA (foreach: the check waits for
            the device once per step), interleaved rounds, medians (target: ratio <= 1.02);
            beside them, to say where a difference goes, the session without its NaN checks and
            a second plain loop (the noise)
3. mfu      the single rows' model FLOPs utilisation: FLOPs of one step counted by torch's
            FlopCounterMode, over the device's peak dense bf16 FLOP/s (from a table by name, else a
            measured matmul)
4. parity   two processes sharing the GPU over gloo with CUDA tensors: DDP, ZeRO 1/2/3 and
            ZeRO 2/3 with offload (pinned CPU shards) equal to one process within 1e-5
5. nccl     a Session("ddp") on the nccl backend at world 1 trains (dry run: gloo)

Each part that fails is recorded with its error, and the others still run. Writes JSON, prints
one line per part, exits 1 when a part failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
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
sys.path.insert(0, str(ROOT))  # tests/support/models.py: the parity models and their reference
import paratrain as pt  # noqa: E402
from paratrain.testing import max_param_diff, run_on_ranks  # noqa: E402

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}  # dense, SXM where both


@functools.lru_cache(maxsize=None)
def gpt_example():
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cuda_tests(dry: bool) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", str(ROOT / "tests")] + (["--collect-only"] if dry else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    return dict(ok=done.returncode == 0, summary=done.stdout.strip().splitlines()[-1:], command=" ".join(cmd[2:]))


# the session's cases, each against the loop a user writes with the wrapper it uses, on one GPU
# (ddp and zero at world 1 on nccl: their buckets, hooks and shards, with no peer to wait for)
CASES = {"single": ("single", 1), "ddp": ("ddp", 1), "ddp-acc4": ("ddp", 4), "zero2": ("zero2", 1),
         "zero3": ("zero3", 1)}
SHAPES = {"gpt-11m": dict(block=256, layers=6, width=384, heads=6, batch=32),  # host-bound on an H200
          "gpt-85m": dict(block=1024, layers=12, width=768, heads=12, batch=16)}  # GPT-2 small's blocks
DRY_SHAPE = dict(block=32, layers=2, width=64, heads=4, batch=4)


def session_overhead(dry: bool, device: torch.device, rounds: int, steps: int, optimizers: list[str]) -> dict:
    # the larger model's step is about 3 x longer: half the steps per round
    rows = [one_case(dry, device, shape, case, rounds, steps if shape != "gpt-85m" else max(2, steps // 2), kind)
            for kind in optimizers for shape in (["dry"] if dry else SHAPES) for case in CASES]
    return dict(ok=True, target_met=all(r["target_met"] for r in rows), rows=rows)


def adamw(params, kind: str) -> torch.optim.AdamW:
    """"fused": one kernel per step, which takes found_inf; "foreach": torch's default on CUDA."""
    return torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if kind == "fused" else {"foreach": True}))


def one_case(dry: bool, device: torch.device, shape_name: str, case: str, rounds: int, steps: int,
             kind: str) -> dict:
    """Plain loop and train_step on copies of one model, same batch, bf16 autocast. Beside them,
    to say where a difference goes: the session without its NaN checks, and a second plain loop
    (built last: how far two identical loops differ here)."""
    gpt, (strategy, accumulate) = gpt_example(), CASES[case]
    shape = DRY_SHAPE if dry else SHAPES[shape_name]
    torch.manual_seed(0)
    make = lambda: gpt.GPT(len(gpt.ALPHABET), shape["block"], shape["layers"], shape["width"], shape["heads"])  # noqa: E731
    x = torch.randint(0, len(gpt.ALPHABET), (shape["batch"], shape["block"]), device=device)
    topo = pt.Topology.from_env(backend="gloo" if dry else "nccl") if strategy != "single" else None
    sessions = [pt.Session(strategy, accumulate=accumulate, precision="bf16", progress_bar=False, topology=topo,
                           nan_check=check) for check in (True, False)]
    ours = []
    for session in sessions:
        model = make()
        session.setup(model, adamw(model.parameters(), kind))
        ours.append(lambda s=session: [s.train_step((x, x), gpt.next_token_loss) for _ in range(accumulate)])
    cases = {"plain": _plain_loop(make, strategy, accumulate, x, device, kind), "session": ours[0],
             "session_unchecked": ours[1], "plain_again": _plain_loop(make, strategy, accumulate, x, device, kind)}
    times = _interleaved(cases, device, rounds, steps)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    model = make().to(device)
    flops = accumulate * _step_flops(model, x, gpt.next_token_loss)
    for session in sessions:
        session.close()
    ratio = ms["session"] / ms["plain"]
    return dict(model=shape_name, case=case, optimizer=kind, plain_ms=ms["plain"], session_ms=ms["session"], ratio=ratio,
                target_met=ratio <= 1.02, session_unchecked_ms=ms["session_unchecked"],
                plain_again_ms=ms["plain_again"], flops_per_step=flops,
                params=sum(p.numel() for p in model.parameters()), **shape)


def _plain_loop(make, strategy: str, accumulate: int, x: torch.Tensor, device: torch.device, kind: str):
    gpt = gpt_example()
    model = make().to(device)
    if strategy == "single" or strategy == "ddp":
        model = pt.DistributedDataParallel(model) if strategy == "ddp" else model
        opt = adamw(model.parameters(), kind)
    else:
        model, opt = pt.shard(model, adamw(model.parameters(), kind), stage=int(strategy[-1]))

    def step():
        for micro in range(accumulate):
            with model.no_sync() if micro < accumulate - 1 else contextlib.nullcontext():
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = gpt.next_token_loss(model(x), x) / accumulate
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _interleaved(steps_of: dict, device: torch.device, rounds: int, steps: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in steps_of}
    names = list(steps_of)
    for r in range(rounds + 1):  # round 0 warms up; each round starts with another case
        for name in names[r % len(names):] + names[:r % len(names)]:
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
    first = overhead["rows"][0]["optimizer"]  # the first optimizer's rows
    mfus = {row["model"]: row["flops_per_step"] / (row["session_ms"] / 1e3) / peak
            for row in overhead["rows"] if row["case"] == "single" and row["optimizer"] == first}
    return dict(ok=True, mfu_single=mfus, peak_flops=peak, peak_source=source)


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


PARITY = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3",
          "zero2-offload": dict(stage=2, offload=True), "zero3-offload": dict(stage=3, offload=True)}


def _parity_rank(topo, case: str, device: str):
    from tests.support.models import make_batches, make_model

    topo = dataclasses.replace(topo, device=torch.device(device))  # gloo, CUDA tensors
    strategy = PARITY[case] if isinstance(PARITY[case], str) else pt.ZeRO(**PARITY[case])  # offload: pinned
    session = pt.Session(strategy, topology=topo, progress_bar=False)
    model = make_model("mlp")
    model, _ = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    xs, ys = make_batches(3, 16)
    for x, y in zip(xs, ys):
        session.train_step((x.chunk(2)[topo.rank], y.chunk(2)[topo.rank]), F.cross_entropy)
    return {k: v.cpu() for k, v in session.full_state_dict().items()}


def parity(device: torch.device) -> dict:
    from tests.support.models import reference

    expected = reference("mlp", "sgd", world=2, accumulate=1, steps=3, global_batch=16)
    diffs = {}
    for case in PARITY:
        states = run_on_ranks(_parity_rank, 2, case, str(device), timeout=600)
        diffs[case] = max(max_param_diff({k: s[k] for k in expected}, expected) for s in states)
    # On the CPU (the dry run) the reference's arithmetic is the ranks': 1e-6 as in tests/. On a GPU
    # the ranks' cuBLAS kernels sum in another order than the CPU reference's, so 1e-5 there.
    tolerance = 1e-6 if device.type == "cpu" else 1e-5
    return dict(ok=all(d < tolerance for d in diffs.values()), max_param_diff=diffs, tolerance=tolerance)


def nccl_world_one(dry: bool) -> dict:
    from tests.support.models import make_batches, make_model

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
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--optimizers", default="fused,foreach", help="AdamW kinds to time the session with, "
                        "comma-separated (fused, foreach; each a full set of rows)")
    args = parser.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a machine with one, or pass --dry-run")
    device = torch.device("cpu" if dry else "cuda", 0 if not dry else None)
    results: dict = {"device": torch.cuda.get_device_name(0) if not dry else "cpu (dry run)",
                     "torch": torch.__version__, "dry_run": dry}
    parts = [("tests", lambda: run_cuda_tests(dry)),
             ("session", lambda: session_overhead(dry, device, 2 if dry else args.rounds, 2 if dry else args.steps,
                                                 args.optimizers.split(","))),
             ("mfu", lambda: mfu(results["session"], device, dry)),
             ("parity", lambda: parity(device)), ("nccl", lambda: nccl_world_one(dry))]
    for name, part in parts:
        try:
            results[name] = part()
        except Exception as e:  # record it, go on: each part tells something of its own
            results[name] = dict(ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-3000:])
        pt.destroy()
        print(f"{name:8s} {'ok' if results[name].get('ok') else 'FAILED'}  "
              f"{ {k: v for k, v in results[name].items() if k not in ('trace', 'ok', 'rows')} }", flush=True)
        for row in results[name].get("rows", []):
            print(f"         {row['model']:8s} {row['optimizer']:7s} {row['case']:9s} plain {row['plain_ms']:7.2f} ms  session "
                  f"{row['session_ms']:7.2f} ms  ratio {row['ratio']:.3f}  unchecked "
                  f"{row['session_unchecked_ms'] / row['plain_ms']:.3f}  plain again "
                  f"{row['plain_again_ms'] / row['plain_ms']:.3f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(results[name].get("ok") for name, _ in parts) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
