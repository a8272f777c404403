"""The alpha-beta model of plan/cost/comm_model.py against costs worked out by hand, and the cluster
presets and files of plan/cluster/cluster.py.

Hand values use a link of α = 10 µs and β = 1 GB/s and a message of S = 1 MB, so S/β = 1 ms:
    ring all-reduce, n = 5:  2·4·10 µs + 2·4/5·1 ms = 80 µs + 1.6 ms   = 1.68 ms
    ring all-reduce, n = 3:  2·2·10 µs + 2·2/3·1 ms = 40 µs + 1.333 ms
    reduce-scatter,  n = 5:    4·10 µs +   4/5·1 ms = 40 µs + 0.8 ms    = 0.84 ms
    tree all-reduce, n = 5:  2·⌈log2 5⌉ = 6 steps: 60 µs + 2 ms       = 2.06 ms
    tree all-reduce, n = 2:  2 steps: 20 µs + 2 ms
    broadcast,       n = 3:    2·10 µs + 1 ms
    any of them,     n = 1:  0 (nothing moves)
"""

import dataclasses
import json
import math

import pytest

from paratrain.errors import ConfigError
from paratrain.plan.cluster.cluster import Cluster, Link, save_cluster
from paratrain.plan.cluster.presets import PRESETS, load_cluster, preset
from paratrain.plan.cost import comm_model as cm

S = 1e6
ALPHA, BETA = 10e-6, 1e9


def cluster(intra=Link(BETA, ALPHA), inter=Link(BETA / 10, 10 * ALPHA)) -> Cluster:
    return Cluster(name="hand", gpus_per_node=8, peak_flops={"fp32": 1e12}, matmul_efficiency=0.5,
                   device_memory=2**30, host_memory=2**34, intra=intra, inter=inter)


# (n, ring all-reduce, reduce-scatter = all-gather, tree all-reduce, broadcast), in seconds
HAND = [
    (1, 0.0, 0.0, 0.0, 0.0),
    (2, 2 * 10e-6 + 1e-3, 10e-6 + 0.5e-3, 2 * 10e-6 + 2e-3, 10e-6 + 1e-3),
    (3, 4 * 10e-6 + 4 / 3 * 1e-3, 2 * 10e-6 + 2 / 3 * 1e-3, 4 * 10e-6 + 2e-3, 2 * 10e-6 + 1e-3),
    (5, 80e-6 + 1.6e-3, 40e-6 + 0.8e-3, 60e-6 + 2e-3, 40e-6 + 1e-3),
]


@pytest.mark.parametrize("n,ring,one_pass,tree,bcast", HAND)
def test_collectives_inside_a_node_match_the_hand_values(n, ring, one_pass, tree, bcast):
    group, c = cm.Group(n), cluster()
    assert cm.ring_all_reduce(S, group, c) == pytest.approx(ring, abs=1e-12)
    assert cm.reduce_scatter(S, group, c) == pytest.approx(one_pass, abs=1e-12)
    assert cm.all_gather(S, group, c) == pytest.approx(one_pass, abs=1e-12)
    assert cm.tree_all_reduce(S, group, c) == pytest.approx(tree, abs=1e-12)
    assert cm.broadcast(S, group, c) == pytest.approx(bcast, abs=1e-12)
    assert cm.all_reduce(S, group, c) == pytest.approx(min(ring, tree), abs=1e-12)


def test_the_tree_wins_small_messages_and_the_ring_large_ones():
    group, c = cm.Group(64, 8), cluster()
    assert cm.all_reduce(1e3, group, c) == cm.tree_all_reduce(1e3, group, c) < cm.ring_all_reduce(1e3, group, c)
    assert cm.all_reduce(1e9, group, c) == cm.ring_all_reduce(1e9, group, c) < cm.tree_all_reduce(1e9, group, c)


def test_a_ring_across_nodes_is_paced_by_the_inter_node_links_of_its_ranks():
    c = cluster()
    # 4 ranks on 4 nodes: 6 steps of the inter-node α (100 µs), 1.5 MB through one NIC, 0.1 GB/s
    assert cm.ring_all_reduce(S, cm.Group(4, 4), c) == pytest.approx(6 * 100e-6 + 1.5 * S / (BETA / 10))
    # 4 ranks on 2 nodes: the same, but 2 NICs leave each node (a ring per NIC): 0.2 GB/s
    assert cm.ring_all_reduce(S, cm.Group(4, 2), c) == pytest.approx(6 * 100e-6 + 1.5 * S / (2 * BETA / 10))
    # 16 on 2 nodes: 8 NICs a node would carry 0.8 GB/s, but the node's own link (1 GB/s) is not
    # the limit either way; 20 per node: 2 GB/s of NICs, paced by the intra-node 1 GB/s
    assert cm.group_link(c, cm.Group(16, 2)).bandwidth == pytest.approx(8 * BETA / 10)
    assert cm.group_link(c, cm.Group(40, 2)).bandwidth == pytest.approx(BETA)
    assert cm.send_recv(S, c, same_node=True) == pytest.approx(ALPHA + S / BETA)
    assert cm.send_recv(S, c, same_node=False) == pytest.approx(10 * ALPHA + S / (BETA / 10))


@pytest.mark.parametrize("name", ["h100-8x", "a100-8x"])
@pytest.mark.parametrize("op", [cm.ring_all_reduce, cm.tree_all_reduce, cm.reduce_scatter, cm.all_gather,
                                cm.broadcast])
def test_intra_node_beats_inter_node_on_the_presets(name, op):
    c = preset(name)
    for nbytes in (1e3, 1e6, 1e9):
        assert op(nbytes, cm.Group(8), c) < op(nbytes, cm.Group(8, 8), c)
        assert op(nbytes, cm.Group(8), c) < op(nbytes, cm.Group(8, 2), c)


def test_hierarchical_all_reduce_is_its_three_phases():
    c = cluster()
    # one node: reduce-scatter + all-gather is the ring all-reduce itself
    assert cm.hierarchical_all_reduce(S, cm.Group(4), c) == pytest.approx(cm.ring_all_reduce(S, cm.Group(4), c))
    # 2 nodes of 4: 3 steps of 10 µs and 3/4 ms, twice, plus 2 inter-node steps of 100 µs and S/4 at 0.1 GB/s
    want = 2 * (3 * ALPHA + 0.75 * S / BETA) + 2 * 100e-6 + (S / 4) / (BETA / 10)
    assert cm.hierarchical_all_reduce(S, cm.Group(8, 2), c) == pytest.approx(want)
    # and it beats a flat ring over the slow link
    assert cm.hierarchical_all_reduce(S, cm.Group(8, 2), c) < cm.ring_all_reduce(S, cm.Group(8, 2), c)


def test_a_calibrated_link_of_one_collective_serves_that_collective_only():
    c = dataclasses.replace(cluster(), collective_links={"reduce_scatter": Link(BETA / 4, 2 * ALPHA)})
    assert cm.reduce_scatter(S, cm.Group(2), c) == pytest.approx(2 * ALPHA + 0.5 * S / (BETA / 4))
    assert cm.all_gather(S, cm.Group(2), c) == pytest.approx(ALPHA + 0.5 * S / BETA)
    # across nodes, the slower of it and the inter-node link (0.1 GB/s, 100 µs)
    assert cm.reduce_scatter(S, cm.Group(2, 2), c) == pytest.approx(100e-6 + 0.5 * S / (BETA / 10))


def test_groups_that_cannot_be_spread_are_refused():
    with pytest.raises(ConfigError, match="evenly"):
        cm.Group(6, 4)
    with pytest.raises(ConfigError, match="not negative"):
        cm.ring_all_reduce(-1, cm.Group(2), cluster())


def test_presets_state_their_sources_and_achievable_flops():
    for name in PRESETS:
        c = preset(name)
        assert c.name == name and c.sources
        assert "assumption" in json.dumps(c.sources) or name == "cpu-here"
        assert 0 < c.flops("fp32") <= c.peak_flops["fp32"]
    h100 = preset("h100-8x")
    assert h100.inter.bandwidth == 400e9 / 8  # 400 Gb/s per GPU
    assert h100.flops("bf16") == pytest.approx(989.4e12 * h100.matmul_efficiency)


def test_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError) as e:
        load_cluster("h100-16x")
    assert all(name in str(e.value) for name in PRESETS)
    with pytest.raises(ConfigError, match="no peak FLOP/s for fp8"):
        preset("a100-8x").flops("fp8")


def test_a_cluster_file_round_trips_and_bad_ones_are_named(tmp_path):
    path = tmp_path / "c.json"
    save_cluster(preset("h100-8x"), path)
    assert load_cluster(path) == preset("h100-8x")
    raw = json.loads(path.read_text())
    raw["nvlink"] = 1
    del raw["intra"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"unknown fields \['nvlink'\] and missing fields \['intra'\]"):
        load_cluster(path)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not JSON"):
        load_cluster(path)


def test_a_cluster_with_impossible_figures_is_refused():
    with pytest.raises(ConfigError, match="matmul_efficiency"):
        Cluster(name="x", gpus_per_node=1, peak_flops={"fp32": 1.0}, matmul_efficiency=1.5,
                device_memory=1, host_memory=1, intra=Link(1, 0), inter=Link(1, 0))
    with pytest.raises(ConfigError, match="inter"):
        cluster(inter=Link(0, 1e-6))
    assert math.isfinite(cm.all_reduce(S, cm.Group(1024, 128), preset("h100-8x")))
