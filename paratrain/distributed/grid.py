"""Every process group of a job, sliced from one grid of ranks (picotron's layout; torchtitan's
`ParallelDims`): the dimensions are named and checked once, and nobody else builds groups.

The same ranks are seen two ways:

    logical   arange(world).view(pp, replicate, shard, cp, tp)    outermost first
    physical  arange(world).view(nodes, local)                    a row is one node

tp is innermost, so a tensor-parallel group is adjacent ranks (one node: its collectives are on
the critical path of every layer); then cp; then the data-parallel ranks, `replicate × shard`
(hybrid sharding shards within a group of `shard` ranks and all-reduces across the
`replicate` groups; otherwise replicate is 1); pp is outermost, its point-to-point sends the
cheapest to carry between nodes (torchtitan orders its mesh so).

A group is named by the dimension(s) it runs along: "pp" (this pipeline's stages), "dp" (this
stage's data-parallel ranks: replicate × shard), "replicate", "shard", "cp", "tp", "local" (the
ranks of this node), "node" (one rank per node, the same local rank). `group("dp", "tp")` is the
ranks along both at once. So world 4 on 2 nodes with pp=2: rank 3 is stage 1 of replica 1, its
"pp" group is {1, 3}, "dp" {2, 3}, "local" {2, 3}, "node" {1, 3}.

`new_group` is collective: every rank creates every line of a dimension, in the same order, the
first time any code asks for that dimension (all ranks run the same setup, so they ask in the
same order). A line that spans the whole world is the default group (WORLD): nothing is created.
Every group gets the job's timeout here (torch's default for new groups would be 30 minutes).
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from paratrain.distributed.topology import Topology, resolve_timeout
from paratrain.errors import ConfigError

LOGICAL = ("pp", "replicate", "shard", "cp", "tp")  # the logical grid's axes, outermost first
COMPOSITE = {"dp": ("replicate", "shard")}  # a dimension that spans several axes
DIMS = ("pp", "dp", "replicate", "shard", "cp", "tp", "local", "node")

Group = tuple[dist.ProcessGroup, tuple[int, ...]]  # (the group, its global ranks in order)


def new_group(ranks: Sequence[int], *, timeout: float | None = None,
              backend: str | None = None) -> dist.ProcessGroup:
    """A group of the given global ranks. Collective: every rank of the job calls it, members or
    not, in the same order. `timeout` in seconds (default: PARATRAIN_TIMEOUT or 600, as the
    default group's; torch's own default for new groups would be 30 minutes)."""
    world = dist.get_world_size()
    if len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
        raise ConfigError(f"new_group needs distinct ranks in 0…{world - 1}; got {list(ranks)}")
    delta = datetime.timedelta(seconds=resolve_timeout(timeout))
    return dist.new_group(ranks=sorted(ranks), timeout=delta, backend=backend)


@dataclass(frozen=True)
class NodeGroups:
    """The groups that hierarchical strategies need, each holding this rank."""

    intra_node: dist.ProcessGroup | None  # the ranks of this node
    inter_node: dist.ProcessGroup | None  # the ranks with this local rank, one per node
    intra_ranks: tuple[int, ...]
    inter_ranks: tuple[int, ...]


@dataclass
class ProcessGrid:
    """The job's ranks as named dimensions; `group(dim)` builds each group once, on first use.
    Each size is the ranks along that dimension; dp is what the world leaves:
    world / (pp · cp · tp), of which `replicate` groups of `shard` ranks."""

    topology: Topology
    pp: int = 1  # ranks per pipeline (stages)
    tp: int = 1  # ranks that split each layer (tensor parallel)
    cp: int = 1  # ranks that split each sequence (context parallel)
    replicate: int = 1  # hybrid sharding: data-parallel groups that each hold a whole sharded model
    _groups: dict[str, Group] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        world = self.topology.world_size
        sizes = dict(pp=self.pp, tp=self.tp, cp=self.cp, replicate=self.replicate)
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v < 1}
        if bad:
            raise ConfigError(f"grid sizes must be positive integers; got {bad}")
        model = self.pp * self.tp * self.cp
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        if world % model:
            if self.tp == self.cp == 1:
                raise ConfigError(f"Pipeline(stages={self.pp}) does not divide the world size {world}: "
                                  f"start a multiple of {self.pp} processes (stages × replicas), or choose "
                                  f"stages among {divisors}")
            raise ConfigError(f"pp={self.pp} × cp={self.cp} × tp={self.tp} = {model} ranks hold one copy of the "
                              f"model, which does not divide the world size {world}: start a multiple of "
                              f"{model} processes, or choose sizes whose product is among {divisors}")
        if (world // model) % self.replicate:
            raise ConfigError(f"replicate={self.replicate} does not divide the {world // model} data-parallel "
                              f"ranks (world {world} / (pp·cp·tp = {model})): choose replicate among "
                              f"{[d for d in divisors if (world // model) % d == 0]}")

    @property
    def dp(self) -> int:
        """Data-parallel ranks: world / (pp · cp · tp)."""
        return self.topology.world_size // (self.pp * self.tp * self.cp)

    @property
    def shard(self) -> int:
        """Ranks one data-parallel group shards over (all of dp unless replicate > 1)."""
        return self.dp // self.replicate

    @property
    def sizes(self) -> dict[str, int]:
        """The logical grid's axes and their sizes, outermost first."""
        return dict(pp=self.pp, replicate=self.replicate, shard=self.shard, cp=self.cp, tp=self.tp)

    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Where `rank` (default this one) sits along each logical axis."""
        rank, out = self.topology.rank if rank is None else rank, {}
        for axis in reversed(LOGICAL):
            rank, out[axis] = divmod(rank, self.sizes[axis])
        return {axis: out[axis] for axis in LOGICAL}

    @property
    def stage(self) -> int:
        """This rank's place along "pp"."""
        return self.coords()["pp"]

    @property
    def replica(self) -> int:
        """This rank's place along "dp"."""
        c = self.coords()
        return c["replicate"] * self.shard + c["shard"]

    @property
    def tp_rank(self) -> int:
        """This rank's place along "tp"."""
        return self.coords()["tp"]

    def lines(self, *dims: str) -> list[list[int]]:
        """Every line of ranks along `dims` (together), each in order: the groups of that name."""
        t = self.topology
        if dims in (("local",), ("node",)):
            grid = torch.arange(t.world_size).view(t.num_nodes, t.local_world_size)
            return (grid if dims == ("local",) else grid.T).tolist()
        axes = [axis for dim in dims for axis in COMPOSITE.get(dim, (dim,))]
        unknown = [d for d in dims if d not in DIMS or d in ("local", "node")]
        if unknown or not dims or len(set(axes)) != len(axes):
            raise ConfigError(f"unknown grid dimension(s) {dims!r}; choose one of {DIMS} (local and node alone)")
        grid = torch.arange(t.world_size).view(*self.sizes.values())
        along = [LOGICAL.index(a) for a in axes]
        rest = [i for i in range(len(LOGICAL)) if i not in along]
        width = math.prod(self.sizes[a] for a in axes)
        return grid.permute(*rest, *along).reshape(-1, width).tolist()

    def group(self, *dims: str) -> Group:
        """The group along `dims` holding this rank, and its ranks (collective on first use)."""
        key = "+".join(dims)
        if key not in self._groups:
            self._groups[key] = self._build(self.lines(*dims))
        return self._groups[key]

    def data_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group, None when it is the whole world (collective on first use):
        what data-parallel wrappers take as `process_group`."""
        group, ranks = self.group("dp")
        return None if len(ranks) == self.topology.world_size else group

    def ranks(self, *dims: str) -> tuple[int, ...]:
        """The global ranks of this rank's line along `dims`; builds nothing."""
        return next(tuple(line) for line in self.lines(*dims) if self.topology.rank in line)

    def stages_group(self, stages: tuple[int, ...]) -> Group:
        """The ranks of these pipeline stages in this rank's pipeline (e.g. the first and the last,
        which hold a weight tied across stages). Collective on first use, for every pipeline."""
        key = f"stages{stages}"
        if key not in self._groups:
            self._groups[key] = self._make([[line[s] for s in stages] for line in self.lines("pp")])
        return self._groups[key]

    def node_groups(self) -> NodeGroups:
        """The intra-node ("local") and inter-node ("node") groups (collective on first use)."""
        (intra, intra_ranks), (inter, inter_ranks) = self.group("local"), self.group("node")
        return NodeGroups(intra, inter, intra_ranks, inter_ranks)

    def data_node_groups(self) -> NodeGroups:
        """The node groups of this rank's data-parallel ranks (hierarchical data parallelism under a
        mesh): those of them on this node, and those at the same place on every node (collective on
        first use). Every node must hold as many of them."""
        if "dp-local" not in self._groups:
            local = self.topology.local_world_size
            intra, inter = [], []
            for line in self.lines("dp"):
                nodes: dict[int, list[int]] = {}
                for r in line:
                    nodes.setdefault(r // local, []).append(r)
                if len({len(n) for n in nodes.values()}) > 1:
                    raise ConfigError(f"data-parallel ranks {line} sit unevenly on the nodes "
                                      f"({ {n: len(r) for n, r in nodes.items()} }): hierarchical data parallelism "
                                      "needs as many on each")
                intra += nodes.values()
                inter += [list(column) for column in zip(*nodes.values())]
            self._groups["dp-local"], self._groups["dp-node"] = self._make(intra), self._make(inter)
        (intra_group, intra_ranks), (inter_group, inter_ranks) = self._groups["dp-local"], self._groups["dp-node"]
        return NodeGroups(intra_group, inter_group, intra_ranks, inter_ranks)

    def _build(self, lines: list[list[int]]) -> Group:
        if len(lines) == 1:  # the whole world: the default group
            return dist.group.WORLD, tuple(lines[0])
        return self._make(lines)

    def _make(self, lines: list[list[int]]) -> Group:
        """One new group per line (every rank makes every one, in order); this rank's."""
        mine: Group = (None, ())
        for line in lines:
            group = new_group(line, timeout=self.topology.timeout_s)
            if self.topology.rank in line:
                mine = (group, tuple(line))
        return mine


def node_groups(topology: Topology) -> NodeGroups:
    """Intra-node and inter-node groups for this rank, from a grid of their own (collective).
    Inside a Session use `session.grid.node_groups()`, which shares the strategy's groups."""
    return ProcessGrid(topology).node_groups()
