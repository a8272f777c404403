"""plan/cost/step_time.py against timelines worked out by hand.

The link is α = 0, β = 1 GB/s unless a case says otherwise, so a message of S bytes costs S ns
per unit of volume; times are in seconds."""

import dataclasses

import pytest

from paratrain.errors import ConfigError
from paratrain.plan.cluster.cluster import Cluster, Link
from paratrain.plan.cost import step_time as st
from paratrain.plan.cost.comm_model import Group


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


def test_on_a_cpu_every_collective_is_exposed_and_ranks_sharing_a_core_communicate_slower():
    hidden = st.StepTime(3.0, 0.25, comm=1.0)  # 0.75 s of the 1 s hidden behind the backward
    assert st.on_cores(hidden, 1.0) == st.StepTime(3.0, 1.0, comm=1.0)
    assert st.on_cores(hidden, 2.0) == st.StepTime(3.0, 2.0, comm=2.0)  # four ranks on two cores
    assert st.sharing(cluster(gpus_per_node=2), world=4) == 2.0 and st.sharing(cluster(), world=4) == 1.0


def test_gradients_copied_into_buckets_take_a_read_and_a_write_at_the_traffic_rate():
    hand = dataclasses.replace(cluster(gpus_per_node=2), traffic_rate=1e9)
    assert st.gradient_copy(10**9, hand, world=2) == pytest.approx(2.0)
    assert st.gradient_copy(10**9, hand, world=4) == pytest.approx(4.0)  # two ranks to a core
    assert st.gradient_copy(10**9, cluster(), world=2) == 0.0  # no traffic rate (the presets)


def test_zero3_copies_its_shard_into_each_gather_and_its_slice_into_the_shards_gradient():
    hand = dataclasses.replace(cluster(gpus_per_node=4), traffic_rate=1e9)
    # world 1: the whole unit copied in by each of two gathers (2 × 2 GB), zero-filled (1), its
    # slice (all of it) copied to the shard's gradient (2): 7 GB at 1 GB/s
    assert st.zero3_local_copies(10**9, hand, world=1) == pytest.approx(7.0)
    assert st.zero3_local_copies(10**9, hand, world=4) == pytest.approx(1 + 4 / 4 + 2 / 4)
    assert st.zero3_local_copies(10**9, hand, world=4, accumulate=2) == pytest.approx(1 + 8 / 4 + 2 / 4)
    assert st.zero3_local_copies(10**9, cluster(), world=4) == 0.0


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


def test_accumulation_synchronises_once_and_zero3_gathers_in_every_micro_batch():
    micro = st.Compute(1.0, 2.0)
    last = st.data_parallel(micro, [10**9], [100], Group(2), cluster())  # the 1 s all-reduce, exposed
    three = st.accumulated(last, st.StepTime(3.0, 0.0), 3)
    assert (three.compute, three.exposed_comm, three.comm) == (9.0, pytest.approx(1.0), pytest.approx(1.0))
    mb = 10**6
    units = st.Compute(3.0, 6.0), [1, 1, 1], [mb] * 3, [mb] * 3, Group(2), cluster()
    synced, local = st.zero3(*units, scatter=True), st.zero3(*units, scatter=True, sync=False)
    assert synced.comm - local.comm == pytest.approx(3 * 0.0005)  # the three reduce-scatters, only
    assert local.comm == pytest.approx(5 * 0.0005)  # gathers: three forward, two backward (not the root)


def test_a_pipeline_step_is_m_plus_p_minus_one_slots():
    compute = st.Compute(8.0, 16.0)  # one replica's batch over the whole model
    # 2 stages × 4 micro-batches: a slot is 1 s forward and 2 s backward; no message cost (0 bytes, α = 0)
    step = st.pipeline(compute, stages=2, microbatches=4, cut_bytes=0, replicas_group=Group(1),
                       stage_bucket_bytes=[], stage_bucket_elements=[], cluster=cluster())
    assert step.compute == 12.0 and step.bubble == 3.0 and step.total == (4 + 2 - 1) * 3.0


@pytest.mark.parametrize("schedule,virtual,slots", [("1f1b", 1, 3), ("gpipe", 1, 3), ("interleaved-1f1b", 2, 1.5),
                                                     ("zb-h1", 1, 1)])
def test_each_schedule_idles_for_its_own_slots(schedule, virtual, slots):
    """p = 4, m = 8 on uniform stages: 1F1B's p − 1 idle slots, interleaved's (p − 1)/v, ZB-H1's
    (p − 1)/3, from the checked action lists (check.bubble_slots); the planner scales the bubble by
    them, and a rank holds the activations its list keeps alive."""
    from paratrain.parallel.pipeline import Pipeline
    from paratrain.parallel.pipeline.check import bubble_slots, peak_alive

    strategy = Pipeline(stages=4, schedule=schedule, microbatches=8, virtual=virtual)
    assert bubble_slots(strategy.action_lists(), 4) == slots
    compute = st.Compute(32.0, 64.0)  # a slot is 1 s forward and 2 s backward per stage per micro-batch
    step = st.pipeline(compute, stages=4, microbatches=8, cut_bytes=0, replicas_group=Group(1),
                       stage_bucket_bytes=[], stage_bucket_elements=[], cluster=cluster(), bubble_slots=slots,
                       virtual=virtual)
    assert step.compute == 24.0 and step.bubble == pytest.approx(3.0 * slots)
    alive = peak_alive(strategy.action_lists())
    assert {"1f1b": alive == [4, 3, 2, 1], "gpipe": alive == [8] * 4, "zb-h1": alive == [4] * 4,
            "interleaved-1f1b": alive == [11, 9, 7, 5]}[schedule], alive


def test_unequal_pipeline_stages_run_at_the_slowest_ones_pace():
    """Shares 1/4 and 3/4 (a GPT's head on the last stage): slots of 1.5 s and 4.5 s. The
    slowest stage runs all 4 micro-batches (18 s); the other's one slot is the bubble."""
    compute = st.Compute(8.0, 16.0)
    step = st.pipeline(compute, stages=2, microbatches=4, cut_bytes=0, replicas_group=Group(1),
                       stage_bucket_bytes=[], stage_bucket_elements=[], cluster=cluster(), shares=[0.25, 0.75])
    assert step.compute == 4 * 4.5 and step.bubble == 1.5 and step.total == 19.5
    even = st.pipeline(compute, stages=2, microbatches=4, cut_bytes=0, replicas_group=Group(1),
                       stage_bucket_bytes=[], stage_bucket_elements=[], cluster=cluster(), shares=[0.5, 0.5])
    assert even.total == (4 + 2 - 1) * 3.0  # equal shares: the even split


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


def test_a_matmul_table_times_each_shape_at_its_rate_on_a_ranks_share_of_the_batch():
    """Grid 64 and 256 on every axis; m = 256 runs at 2e11 FLOP/s, m = 64 at 1e11 (log-rate
    interpolated between: 128 at √2·1e11); everything else at the flat 0.5e12."""
    import dataclasses
    import math

    from paratrain.plan.model.matmuls import Matmul

    rows = [[m, k, n, 2e11 if m == 256 else 1e11] for m in (64, 256) for k in (64, 256) for n in (64, 256)]
    hand = dataclasses.replace(cluster(), matmul_rates={"fp32": rows})
    rate = hand.matmul_rate("fp32")
    assert rate(256, 64, 64) == 2e11 and rate(64, 256, 256) == 1e11
    assert rate(128, 100, 200) == pytest.approx(math.sqrt(2) * 1e11)
    assert rate(4096, 64, 64) == 2e11 and rate(8, 64, 64) == 1e11  # clamped to the grid
    # one forward matmul of 256 × 256 × 256 whose m is the batch; 1e9 FLOPs of attention besides
    mm = Matmul("forward", 1, 256, 256, 256, (False, True, False, False))
    flops = mm.flops + 1e9
    whole = st.Compute.of(flops, 0.0, hand, "fp32", world=1, matmuls=((mm, 1),))
    assert whole.forward == pytest.approx(mm.flops / 2e11 + 1e9 / 0.5e12)
    # a quarter of the batch at once (4 ranks): four products of 64 × 256 × 256, at m = 64's rate
    quarter = st.Compute.of(flops, 0.0, hand, "fp32", world=1, matmuls=((mm, 1),), fraction=0.25)
    assert quarter.forward == pytest.approx(mm.flops / 1e11 + 1e9 / 0.5e12)
    # without a table for the dtype, every FLOP at the flat rate, as before
    assert st.Compute.of(flops, 0.0, cluster(), "fp32", world=1, matmuls=((mm, 1),)).forward == \
        pytest.approx(flops / 0.5e12)
    with pytest.raises(ConfigError, match="every"):
        dataclasses.replace(cluster(), matmul_rates={"fp32": rows[:-1]}).matmul_rate("fp32")


def test_the_optimizer_steps_each_tensor_at_its_sizes_calibrated_rate():
    """Tensors of 10³ elements step at 1e6 elements/s, of 10⁶ at 1e5 (out of cache): log-
    interpolated between, clamped outside; a pipeline stage stepping half the elements, half."""
    import dataclasses

    hand = dataclasses.replace(cluster(gpus_per_node=2), optimizer_rate=5e5,
                               optimizer_rates=[[10**3, 1e6], [10**6, 1e5]])
    assert hand.optimizer_rate_for(10**3) == 1e6 and hand.optimizer_rate_for(10**6) == 1e5
    assert hand.optimizer_rate_for(10**4) == pytest.approx(10**(6 - 1 / 3))  # a third of the way in log size
    assert hand.optimizer_rate_for(10) == 1e6 and hand.optimizer_rate_for(10**8) == 1e5
    both = [10**3, 10**6]
    seconds = 10**3 / 1e6 + 10**6 / 1e5
    assert st.optimizer_seconds(sum(both), hand, world=2, tensors=both) == pytest.approx(seconds)
    assert st.optimizer_seconds(sum(both) // 2, hand, world=2, tensors=both) == pytest.approx(seconds / 2)
    assert st.optimizer_seconds(sum(both), hand, world=4, tensors=both) == pytest.approx(2 * seconds)
    assert st.optimizer_seconds(sum(both), hand, world=2) == pytest.approx(sum(both) / 5e5)  # no sizes: the flat rate


def test_offload_steps_on_the_host_and_copies_each_shard_down_once_and_up_at_each_gather():
    host = dataclasses.replace(cluster(), host_link=Link(1e9, 1e-5), host_optimizer_rate=1e6)
    # 30 elements of 4 bytes in two shards: down once, up once (zero1, 2) or at 4 gathers (zero3,
    # 2 micro-batches); each copy of each shard pays the link's latency
    assert st.offload([10, 20], 4, host, gathers=1) == pytest.approx((30e-6, 2 * (120e-9 + 2e-5)))
    assert st.offload([10, 20], 4, host, gathers=4) == pytest.approx((30e-6, 5 * (120e-9 + 2e-5)))
    # no host link (a CPU cluster: its memory is the host's), or no host rate: nothing to add
    assert st.offload([10, 20], 4, cluster(), gathers=1) == (0.0, 0.0)
    assert st.offload([10, 20], 4, dataclasses.replace(host, host_optimizer_rate=0.0), gathers=1) == (0.0, 0.0)
