"""plan/step_time.py against timelines worked out by hand.

The link is α = 0, β = 1 GB/s unless a case says otherwise, so a message of S bytes costs S ns
per unit of volume; times are in seconds."""

import pytest

from paratrain.plan import step_time as st
from paratrain.plan.cluster import Cluster, Link
from paratrain.plan.comm_model import Group


def cluster(latency: float = 0.0, gpus_per_node: int = 8) -> Cluster:
    return Cluster(name="hand", gpus_per_node=gpus_per_node, peak_flops={"fp32": 1e12}, matmul_efficiency=0.5,
                   device_memory=2**30, host_memory=2**34, intra=Link(1e9, latency), inter=Link(1e8, latency))


def test_buckets_reduced_during_the_backward_expose_only_what_runs_past_it():
    # backward 10 s, two buckets of equal size ready at 5 s and 10 s
    assert st.bucket_overlap(10.0, [1, 1], [3.0, 3.0]) == pytest.approx(3.0)  # 5-8, 10-13
    assert st.bucket_overlap(10.0, [1, 1], [6.0, 6.0]) == pytest.approx(7.0)  # 5-11, 11-17
    assert st.bucket_overlap(10.0, [3, 1], [1.0, 1.0]) == pytest.approx(1.0)  # ready 7.5 and 10
    assert st.bucket_overlap(10.0, [1], [0.0]) == 0.0


def test_prefetch_keeps_one_unit_ahead():
    # gathers faster than compute: only the first gather is exposed
    assert st.prefetch_schedule([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == pytest.approx(7.0)
    # gathers slower: g0 0-3, c0 3-5; g1 3-6, c1 6-8; g2 6-9, c2 9-11
    assert st.prefetch_schedule([2.0, 2.0, 2.0], [3.0, 3.0, 3.0]) == pytest.approx(11.0)
    # a gather waits for the unit two back to be freed: g2 cannot start before c0 ends (at 11)
    assert st.prefetch_schedule([10.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == pytest.approx(13.0)
    # with a reduction after each unit's compute, on the same queue: g0 0-1 c0 1-3 g1 1-2 c1 3-5,
    # r0 3-4, g2 4-5, c2 5-7, r1 5-6, r2 7-8
    assert st.prefetch_schedule([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == pytest.approx(8.0)


def test_ranks_beyond_a_nodes_devices_compute_slower():
    hand = cluster(gpus_per_node=2)
    assert st.Compute.of(1e12, 2e12, hand, "fp32", world=2) == st.Compute(2.0, 4.0)  # 0.5 TFLOP/s each
    assert st.Compute.of(1e12, 2e12, hand, "fp32", world=4) == st.Compute(4.0, 8.0)  # two per core
    assert st.Compute.of(1e12, 2e12, hand, "fp32", world=4, nodes=2) == st.Compute(2.0, 4.0)


def test_ddp_at_world_one_communicates_nothing_and_at_two_all_reduces_each_bucket():
    compute = st.Compute(1.0, 2.0)
    alone = st.data_parallel(compute, [10**9], [100], Group(1), cluster())
    assert alone.total == 3.0 and alone.comm == 0.0
    # two ranks: a 1 GB bucket all-reduced takes 2·(1/2)·1 s = 1 s (ring), ready at the end of backward
    two = st.data_parallel(compute, [10**9], [100], Group(2), cluster())
    assert two.comm == pytest.approx(1.0) and two.exposed_comm == pytest.approx(1.0) and two.total == pytest.approx(4.0)


def test_zero12_gathers_the_updated_slices_after_the_step():
    compute = st.Compute(1.0, 2.0)
    # nccl's way: reduce-scatter 1 GB (0.5 s) hidden behind nothing (ready at the end), all-gather 0.5 s
    scattered = st.zero12(compute, [10**9], [100], [10**9], Group(2), cluster(), scatter=True)
    assert scattered.exposed_comm == pytest.approx(1.0)
    # gloo's way: all-reduce (1 s), then a broadcast of each owner's half (2 × 0.5 s)
    gloo = st.zero12(compute, [10**9], [100], [10**9], Group(2), cluster(), scatter=False)
    assert gloo.exposed_comm == pytest.approx(2.0)


def test_zero3_hides_gathers_behind_the_previous_units_compute():
    compute = st.Compute(3.0, 6.0)  # three equal units: 1 s forward, 2 s backward each
    mb = 10**6  # a 1 MB unit gathers in 0.5 ms at world 2: almost all hidden
    fast = st.zero3(compute, [1, 1, 1], [mb] * 3, [mb] * 3, Group(2), cluster(), scatter=True)
    assert fast.compute == 9.0 and fast.exposed_comm == pytest.approx(0.0005 + 0.0005 + 0.0005, rel=1e-6)


def test_a_pipeline_step_is_m_plus_p_minus_one_slots():
    compute = st.Compute(8.0, 16.0)  # one replica's batch over the whole model
    # 2 stages × 4 micro-batches: a slot is 1 s forward and 2 s backward; no message cost (0 bytes, α = 0)
    step = st.pipeline(compute, stages=2, microbatches=4, cut_bytes=0, replicas_group=Group(1),
                       stage_bucket_bytes=[], stage_bucket_elements=[], cluster=cluster())
    assert step.compute == 12.0 and step.bubble == 3.0 and step.total == (4 + 2 - 1) * 3.0


def test_elementwise_work_and_the_optimizer_step_take_their_rates():
    import dataclasses

    hand = dataclasses.replace(cluster(gpus_per_node=2), elementwise_rate=3e9, optimizer_rate=1e8)
    # 0.5 TFLOP/s: 1 s forward, 2 s backward of matmuls; 3 GB of saved activations at 3 GB/s: 1 s, a third forward
    got = st.Compute.of(0.5e12, 1e12, hand, "fp32", world=2, activation_bytes=3 * 10**9)
    assert (got.forward, got.backward) == pytest.approx((1.0 + 1 / 3, 2.0 + 2 / 3))
    assert st.optimizer_seconds(10**8, hand, world=2) == pytest.approx(1.0)
    assert st.optimizer_seconds(10**8, hand, world=4) == pytest.approx(2.0)  # two ranks per core
    assert st.optimizer_seconds(10**8, cluster(), world=2) == 0.0  # no rate: not timed
    assert st.StepTime(1.0, 0.5, bubble=0.25, optimizer=0.125).total == 1.875
