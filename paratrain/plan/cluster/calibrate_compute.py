"""Phase 1 of `paratrain plan --calibrate` (calibrate.py): how fast this machine computes, and
the settings of both phases.

Square matmuls (`Settings.matmul_size`) in fp32, and in bf16 where the device has it, back to back
after a warm-up: FLOP/s = 2·n³ per product. A table of (m × k) @ (k × n) products over
`Settings.matmul_grid` per dtype, operands out of cache (cluster.matmul_rates: the planner times
each of a model's matmuls at its own shape, plan/model/matmuls.py). Adam's rate over tensors of
several sizes (cluster.optimizer_rates), and the element-wise work of a transformer block per
byte it saves and per byte it moves (cluster.elementwise_rate, traffic_rate). On the CPU with one
thread: a device is one core.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from paratrain.plan.model.matmuls import Recorder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Settings:
    """How long and how finely to measure (the defaults take about a minute on a 2-core CPU)."""

    sizes: tuple[int, ...] = (2**12, 2**15, 2**18, 2**20, 2**22)  # message bytes
    gpu_sizes: tuple[int, ...] = (2**12, 2**16, 2**20, 2**24, 2**28)  # NVLink needs large ones to show β
    repeats: int = 5  # calls timed together, per trial
    trials: int = 5  # the fastest trial counts
    world: int = 2  # ranks taking part in the collectives
    matmul_size: int = 1024  # n of the n×n products
    gpu_matmul_size: int = 8192  # a GPU's tensor cores reach their rate only on large ones
    matmul_seconds: float = 1.0  # time spent on each dtype's products, about
    # the shape table (plan/model/matmuls.py): every (m, k, n) of these, each the fastest of 3 trials
    # of about `shape_seconds` / 3 (and at least 1 product); a shape of more than `shape_cap`
    # multiply-adds is timed with its largest dimensions halved until it is under: large shapes'
    # rates have levelled off by then
    matmul_grid: tuple[int, ...] = (16, 32, 128, 512, 2048, 8192)
    gpu_matmul_grid: tuple[int, ...] = (256, 2048, 16384)
    shape_seconds: float = 0.06
    shape_cap: int = 2**32
    gpu_shape_cap: int = 2**40  # a GPU multiplies 2^32 in microseconds: its large shapes are timed whole
    optimizer_sizes: tuple[int, ...] = (2**14, 2**17, 2**20, 2**22, 2**24)  # elements per tensor
    cold_bytes: int = 256 * 2**20  # operands cycled through per shape, beyond any cache


def matmul_rates(settings: Settings, device: torch.device) -> dict[str, float]:
    """Achieved FLOP/s of n×n matmuls per dtype the device can multiply (on the CPU: with the
    threads torch has now)."""
    rates = {}
    for dtype_name, dtype in DTYPES.items():
        if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            continue
        rate = _matmul_rate(settings, device, dtype)
        if rate is not None:
            rates[dtype_name] = rate
    return rates


def matmul_table(settings: Settings, device: torch.device, dtype: torch.dtype) -> list[list[float]]:
    """[m, k, n, FLOP/s] for every shape of the grid (cluster.py's matmul_rate interpolates them),
    each product's operands out of cache, as in a training step (each layer's input and weight
    were last touched long before): the products cycle through copies of the operands cut from
    `Settings.cold_bytes` of random values. The same product repeated on one pair of operands ran
    10-25 % faster here at the bench GPT's shapes.

    Each shape's rate is the fastest of 3 trials, taken in 3 passes over the whole grid rather
    than back to back: on this shared machine a slow spell of some seconds had made the 512-row
    shapes of one calibration 38-49 % slower than another's, and the predictions with them."""
    grid = settings.gpu_matmul_grid if device.type == "cuda" else settings.matmul_grid
    cap = settings.gpu_shape_cap if device.type == "cuda" else settings.shape_cap
    size = torch.finfo(dtype).bits // 8
    pool = torch.randn(settings.cold_bytes // size, device=device).to(dtype)
    outs = torch.zeros_like(pool)  # its pages touched now, not by the first trials
    timed = {}  # each shape of the grid → the product timed for it
    for shape in itertools.product(grid, repeat=3):
        dims = list(shape)
        while dims[0] * dims[1] * dims[2] > cap:
            dims[dims.index(max(dims))] //= 2
        timed[shape] = tuple(dims)
    best = dict.fromkeys(timed, float("inf"))  # seconds per FLOP
    for _ in range(3):
        for shape, (m, k, n) in timed.items():
            seconds = _cold_matmul_seconds(settings, device, pool, outs, m, k, n)
            best[shape] = min(best[shape], seconds / (2 * m * k * n))
    return [[m, k, n, 1 / best[(m, k, n)]] for m, k, n in timed]


def _cold_matmul_seconds(settings: Settings, device: torch.device, pool: torch.Tensor, outs: torch.Tensor,
                         m: int, k: int, n: int) -> float:
    """Seconds of one (m × k) @ (k × n) over about a third of `Settings.shape_seconds`, cycling
    through the copies of its operands `pool` holds."""
    copies = min(pool.numel() // (m * k + k * n), outs.numel() // (m * n), 1024)  # small sets: few MB
    if copies < 1:  # operands larger than the pool: one set, out of cache by its size alone
        return _cold_matmul_seconds(settings, device, torch.randn(m * k + k * n, device=device).to(pool.dtype),
                                    torch.zeros(m * n, device=device, dtype=pool.dtype), m, k, n)
    stride = m * k + k * n  # copy i: a then b, from element i · stride of the pool
    pairs = [(pool[i * stride:][:m * k].view(m, k), pool[i * stride + m * k:][:k * n].view(k, n),
              outs[i * m * n:][:m * n].view(m, n)) for i in range(copies)]
    turn = itertools.count()

    def call() -> None:
        a, b, out = pairs[next(turn) % copies]
        torch.mm(a, b, out=out)

    call()  # warm-up
    return _seconds_per_call(call, device, settings.shape_seconds / 3)


def _seconds_per_call(call, device: torch.device, seconds: float, at_least: int = 1) -> float:
    """Mean seconds of `call()` repeated for about `seconds` (at least `at_least` times); on a
    GPU the host waits for the device every 10 calls, so the time measured is the device's."""
    sync_device(device)
    count, start = 0, time.perf_counter()
    while count < at_least or time.perf_counter() - start < seconds:
        call()
        count += 1
        if device.type == "cuda" and count % 10 == 0:
            sync_device(device)
    sync_device(device)
    return (time.perf_counter() - start) / count


def _matmul_rate(settings: Settings, device: torch.device, dtype: torch.dtype) -> float | None:
    n = settings.gpu_matmul_size if device.type == "cuda" else settings.matmul_size
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    try:
        a @ b  # warm-up (and: can this device multiply this dtype?)
    except RuntimeError:
        return None
    return 2 * n**3 / _seconds_per_call(lambda: a @ b, device, settings.matmul_seconds, at_least=2)


def optimizer_rate(settings: Settings, device: torch.device) -> float:
    """Elements per second torch.optim.Adam (its default implementation for the device:
    single-tensor on the CPU, foreach on CUDA) steps: eight parameters of 2^20 elements, as a
    model's many tensors."""
    return _adam_rate(settings, device, 2**20, 8)


def optimizer_table(settings: Settings, device: torch.device) -> list[list[float]]:
    """[elements per tensor, elements/s] of the same Adam at each of `Settings.optimizer_sizes`,
    over enough tensors of that size to make 2^23 elements: one large tensor (ZeRO's flat
    shards) steps slower than many that each fit in cache (bench MLP's 4M-element weights)."""
    return [[size, _adam_rate(settings, device, size, max(1, 2**23 // size))] for size in settings.optimizer_sizes]


def _adam_rate(settings: Settings, device: torch.device, size: int, count: int) -> float:
    """Elements per second Adam steps `count` parameters of `size` elements at."""
    params = [torch.nn.Parameter(torch.randn(size, device=device)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    adam = torch.optim.Adam(params, lr=1e-3)
    return size * count / _seconds(adam.step, settings, device)


def elementwise_rate(settings: Settings, device: torch.device) -> float:
    """Saved-activation bytes per second through the element-wise work of a transformer block's
    forward and backward without its matmuls (LayerNorm, GELU, softmax over rows, residual adds), on
    (4096, 1024) floats; the bytes are what autograd saves, as probe counts them."""
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    step = _elementwise_step(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(saved.values()) / _seconds(step, settings, device)


def traffic_rate(settings: Settings, device: torch.device) -> float:
    """Bytes per second the same element-wise work reads and writes, counted by the probe's
    Recorder (plan/model/matmuls.py) as it counts a model's."""
    step = _elementwise_step(device)
    with Recorder() as counted:
        step()
    return counted.traffic / _seconds(step, settings, device)


def _elementwise_step(device: torch.device):
    """A transformer block's forward and backward without its matmuls, on (4096, 1024) floats."""
    x = torch.randn(4096, 1024, device=device, requires_grad=True)
    norm = torch.nn.LayerNorm(1024).to(device)

    def step() -> None:
        h = x + torch.nn.functional.gelu(norm(x))
        y = h + torch.softmax(h, dim=-1)
        y.sum().backward()
    return step


def _seconds(call, settings: Settings, device: torch.device) -> float:
    """The fastest of a few timings of `call()`, after one untimed."""
    call()
    best = float("inf")
    for _ in range(max(3, settings.trials)):
        sync_device(device)
        start = time.perf_counter()
        call()
        sync_device(device)
        best = min(best, time.perf_counter() - start)
    return best


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
