"""The rank grid's index arithmetic, with no processes: every combination of pp, replicate, cp
and tp that fits worlds of 8 and 16 (and 12, whose 3 is not a power of two)."""

import itertools

import pytest

from paratrain.distributed.grid import ProcessGrid
from paratrain.distributed.topology import Topology
from paratrain.errors import ConfigError


def grid(world, rank=0, nodes=1, **sizes):
    topology = Topology.from_env({}, rank=rank, world_size=world, local_world_size=world // nodes)
    return ProcessGrid(topology, **sizes)


def combinations(world):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for pp, tp, cp in itertools.product(divisors, repeat=3):
        if world % (pp * tp * cp) == 0:
            dp = world // (pp * tp * cp)
            for replicate in (d for d in divisors if dp % d == 0):
                yield dict(pp=pp, tp=tp, cp=cp, replicate=replicate)


CASES = [(world, sizes) for world in (8, 12, 16) for sizes in combinations(world)]


@pytest.mark.parametrize("world,sizes", CASES, ids=[f"{w}-" + "-".join(f"{k}{v}" for k, v in s.items())
                                                   for w, s in CASES])
def test_every_dimension_partitions_the_world_and_crosses_the_others_once(world, sizes):
    g = grid(world, **sizes)
    assert g.pp * g.dp * g.cp * g.tp == world and g.dp == g.replicate * g.shard
    dims = ("pp", "dp", "replicate", "shard", "cp", "tp")
    widths = dict(pp=g.pp, dp=g.dp, replicate=g.replicate, shard=g.shard, cp=g.cp, tp=g.tp)
    for dim in dims:
        lines = g.lines(dim)
        assert sorted(r for line in lines for r in line) == list(range(world)), dim
        assert all(len(line) == widths[dim] and line == sorted(line) for line in lines), dim
    # tp innermost: adjacent ranks; pp outermost: a stage is a block of world / pp ranks
    assert all(line == list(range(line[0], line[0] + g.tp)) for line in g.lines("tp"))
    assert all(line == [line[0] + s * (world // g.pp) for s in range(g.pp)] for line in g.lines("pp"))
    for rank in range(world):
        r = grid(world, rank, **sizes)
        mine = {dim: r.ranks(dim) for dim in dims}
        assert mine["pp"][r.stage] == rank and mine["dp"][r.replica] == rank and mine["tp"][r.tp_rank] == rank
        c = r.coords()
        assert mine["shard"][c["shard"]] == rank and mine["replicate"][c["replicate"]] == rank
        assert mine["cp"][c["cp"]] == rank
        for a, b in itertools.combinations(("pp", "dp", "cp", "tp"), 2):
            assert set(mine[a]) & set(mine[b]) == {rank}, (a, b)
        assert set(mine["shard"]) | set(mine["replicate"]) <= set(mine["dp"])
        both = r.ranks("dp", "tp")
        assert set(both) == {x for d in mine["dp"] for x in grid(world, d, **sizes).ranks("tp")}


def test_the_documented_example():
    """world 4 on 2 nodes, pp=2 (the module docstring's): rank 3 is stage 1 of replica 1."""
    g = grid(4, rank=3, nodes=2, pp=2)
    assert (g.stage, g.replica) == (1, 1)
    assert (g.ranks("pp"), g.ranks("dp"), g.ranks("local"), g.ranks("node")) == ((1, 3), (2, 3), (2, 3), (1, 3))


def test_tensor_parallel_ranks_of_a_node_are_one_group():
    """world 16 on 2 nodes of 8, tp=4 × dp=4: each tp group lies inside one node."""
    for rank in range(16):
        g = grid(16, rank, nodes=2, tp=4)
        assert set(g.ranks("tp")) <= set(g.ranks("local"))


@pytest.mark.parametrize("sizes,words", [
    (dict(tp=3), "tp=3"), (dict(tp=2, cp=3), "cp=3 × tp=2"), (dict(pp=3), "stages=3"),
    (dict(tp=2, replicate=3), "replicate=3"), (dict(tp=0), "positive"),
])
def test_sizes_that_do_not_fit_the_world_are_refused_by_name(sizes, words):
    with pytest.raises(ConfigError, match=words.replace("×", ".").replace("(", r"\(")):
        grid(8, **sizes)


def test_unknown_dimension_is_refused():
    with pytest.raises(ConfigError, match="unknown grid dimension"):
        grid(8, tp=2).lines("ep")
