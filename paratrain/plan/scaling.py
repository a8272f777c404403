"""`paratrain plan ... --png FILE`: predicted throughput and per-rank memory against the number of
devices, 1 → 1,024 (powers of two), for the strategies that lead at `--gpus`.

Each point is recommend.plan_rows at that many devices (the same model and cluster), each device
keeping the batch it has at `--gpus` (weak scaling: the global batch grows with the devices, as
data-parallel training is scaled). The step's FLOPs and activations are linear in the batch, so
the counts of the fake step are scaled rather than run again. Each count is spread over the
fewest nodes that hold it evenly, at most `per_node` devices on each (with `--nodes`: the node
size it gives at `--gpus`; default: the cluster's). A strategy is drawn where it can run the
model; a point past the device memory is drawn hollow. matplotlib is needed for the picture
only (`pip install matplotlib`).
"""

from __future__ import annotations

import dataclasses

from paratrain.errors import ConfigError
from paratrain.plan.cluster.cluster import Cluster
from paratrain.plan.model.probe import ModelFacts
from paratrain.plan.model.source import ModelSource
from paratrain.plan.recommend import plan_rows, spread

COUNTS = tuple(2**k for k in range(11))  # 1 … 1,024 devices


def scaling(source: ModelSource, facts: ModelFacts, cluster: Cluster, *, optimizer: str, per_device: int,
            counts: tuple[int, ...] = COUNTS, per_node: int | None = None, accumulate: int = 1
            ) -> dict[int, list[dict]]:
    """The rows plan_rows gives at each device count, `per_device` samples on each, at most
    `per_node` devices on a node (default: the cluster's gpus_per_node)."""
    per_node = per_node or cluster.gpus_per_node
    return {n: plan_rows(source, at_batch(facts, per_device * n), cluster, gpus=n, optimizer=optimizer,
                         nodes=spread(n, per_node), accumulate=accumulate) for n in counts}


def at_batch(facts: ModelFacts, batch: int) -> ModelFacts:
    """`facts` for another batch: FLOPs and saved bytes scale with it (the parameters do not)."""
    k = batch / facts.batch

    def scaled(step):
        if step is None:
            return None
        return dataclasses.replace(
            step, flops_forward=round(step.flops_forward * k), flops_backward=round(step.flops_backward * k),
            activation_bytes=round(step.activation_bytes * k), transient_bytes=round(step.transient_bytes * k),
            block_activation_bytes={n: round(b * k) for n, b in step.block_activation_bytes.items()},
            block_output_bytes={n: round(b * k) for n, b in step.block_output_bytes.items()},
            block_flops={n: round(f * k) for n, f in step.block_flops.items()}, lead_flops=round(step.lead_flops * k),
            lead_activation_bytes=round(step.lead_activation_bytes * k))
    return dataclasses.replace(facts, batch=batch, step=scaled(facts.step), checkpointed=scaled(facts.checkpointed))


def leaders(rows: list[dict], how_many: int = 3) -> list[str]:
    """The strategies with the most throughput per device among these rows (fitting first)."""
    ranked = sorted((r for r in rows if "error" not in r),
                    key=lambda r: (r["fits"], r["per_device_per_second"]), reverse=True)
    return [line_name(r) for r in ranked[:how_many]]


def line_name(row: dict) -> str:
    """What one line of the picture follows from count to count: the strategy (a pipeline's
    stages and micro-batches change with the count), ZeRO with offload apart from without."""
    return row["strategy"] + ("+offload" if row["label"].endswith("+offload") else "")


def draw(points: dict[int, list[dict]], chosen: list[str], path: str, *, title: str, per: str,
         device_memory: int) -> None:
    """Two panels against the device count: throughput per device, and each device's peak."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--png draws with matplotlib, which is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only: training machines have no display
    import matplotlib.pyplot as plt

    fig, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in chosen:
        line = [(n, r) for n, rows in sorted(points.items()) for r in rows
                if "error" not in r and line_name(r) == name]
        if not line:
            continue
        xs = [n for n, _ in line]
        drawn = speed.plot(xs, [r["per_device_per_second"] for _, r in line], marker="o", label=name)[0]
        memory.plot(xs, [r["device_peak"] / 2**30 for _, r in line], marker="o", color=drawn.get_color(), label=name)
        for axis, key, scale in ((speed, "per_device_per_second", 1), (memory, "device_peak", 2**30)):
            misses = [(n, r[key] / scale) for n, r in line if not r["fits"]]
            if misses:
                axis.scatter(*zip(*misses), s=60, facecolors="white", edgecolors=drawn.get_color(), zorder=3)
    memory.axhline(device_memory / 2**30, color="grey", linestyle="--", linewidth=1, label="device memory")
    for axis, label in ((speed, f"{per}s per second per device"), (memory, "peak GiB per device")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("devices")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    memory.set_yscale("log")
    speed.legend(fontsize=8)
    fig.suptitle(f"{title} (hollow: does not fit)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
