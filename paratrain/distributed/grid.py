"""Every process group of a job, sliced from one grid of ranks (picotron's layout; torchtitan's
`ParallelDims`): the dimensions are named and checked once, and nobody else builds groups.

The same ranks are seen two ways:

    logical   arange(world).view(dp, pp)           a row is one pipeline (its ranks are the stages,
                                                   in order), a column one stage's replicas
    physical  arange(world).view(nodes, local)     a row is one node, a column one local rank

A group is named by the dimension it runs along: "pp" (this pipeline's stages), "dp" (this
stage's data-parallel replicas), "local" (the ranks of this node), "node" (one rank per node, the
same local rank). So world 4 on 2 nodes with pp=2: rank 3 is stage 1 of replica 1, its "pp"
group is {2, 3}, "dp" {1, 3}, "local" {2, 3}, "node" {1, 3}.

`new_group` is collective: every rank creates every line of a dimension, in the same order, the
first time any code asks for that dimension (all ranks run the same setup, so they ask in the
same order). A line that spans the whole world is the default group (None): nothing is created.
Every group gets the job's timeout here (torch's default for new groups would be 30 minutes).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from paratrain.distributed.topology import Topology, resolve_timeout
from paratrain.errors import ConfigError

DIMS = ("pp", "dp", "local", "node")

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
    """The job's ranks as named dimensions; `group(dim)` builds each group once, on first use."""

    topology: Topology
    pp: int = 1  # ranks per pipeline (stages); the rest of the world is data-parallel replicas
    _groups: dict[str, Group] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        world = self.topology.world_size
        if self.pp < 1 or world % self.pp:
            raise ConfigError(f"Pipeline(stages={self.pp}) does not divide the world size {world}: "
                              f"start a multiple of {self.pp} processes (stages × replicas), or choose "
                              f"stages among {[d for d in range(1, world + 1) if world % d == 0]}")

    @property
    def dp(self) -> int:
        """Data-parallel replicas: world / pp."""
        return self.topology.world_size // self.pp

    @property
    def stage(self) -> int:
        """This rank's place along "pp"."""
        return self.topology.rank % self.pp

    @property
    def replica(self) -> int:
        """This rank's place along "dp"."""
        return self.topology.rank // self.pp

    def layout(self, dim: str) -> tuple[torch.Tensor, int]:
        """The grid `dim` is a dimension of, and which axis it is."""
        t, world = self.topology, self.topology.world_size
        grids = {"pp": (self.dp, self.pp, 1), "dp": (self.dp, self.pp, 0),
                 "local": (t.num_nodes, t.local_world_size, 1), "node": (t.num_nodes, t.local_world_size, 0)}
        if dim not in grids:
            raise ConfigError(f"unknown grid dimension {dim!r}; choose one of {DIMS}")
        rows, cols, axis = grids[dim]
        return torch.arange(world).view(rows, cols), axis

    def group(self, dim: str) -> Group:
        """The group along `dim` holding this rank, and its ranks (collective on first use)."""
        if dim not in self._groups:
            self._groups[dim] = self._build(dim)
        return self._groups[dim]

    def ranks(self, dim: str) -> tuple[int, ...]:
        """The global ranks of this rank's line along `dim`; builds nothing."""
        grid, axis = self.layout(dim)
        lines = grid.movedim(axis, -1).reshape(-1, grid.shape[axis]).tolist()
        return next(tuple(line) for line in lines if self.topology.rank in line)

    def stages_group(self, stages: tuple[int, ...]) -> Group:
        """The ranks of these pipeline stages in this rank's replica (e.g. the first and the last,
        which hold a weight tied across stages). Collective on first use, for every replica."""
        key = f"stages{stages}"
        if key not in self._groups:
            self._groups[key] = self._make([[replica * self.pp + s for s in stages] for replica in range(self.dp)])
        return self._groups[key]

    def node_groups(self) -> NodeGroups:
        """The intra-node ("local") and inter-node ("node") groups (collective on first use)."""
        (intra, intra_ranks), (inter, inter_ranks) = self.group("local"), self.group("node")
        return NodeGroups(intra, inter, intra_ranks, inter_ranks)

    def _build(self, dim: str) -> Group:
        grid, axis = self.layout(dim)
        lines = grid.movedim(axis, -1).reshape(-1, grid.shape[axis]).tolist()
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
