"""Pipeline schedules as data (no processes): every schedule's action lists pass the checker at
many sizes, idle for the fraction their theory gives, hold the activations their theory bounds,
and run in the order their papers define; hand-broken lists are refused by rank and action."""

from fractions import Fraction

import pytest

from paratrain.errors import ConfigError
from paratrain.parallel.pipeline import Pipeline
from paratrain.parallel.pipeline.actions import Action, Op, with_comm
from paratrain.parallel.pipeline.check import ScheduleError, check, idle_fraction
from paratrain.parallel.pipeline.check import peak_alive as check_peaks
from paratrain.parallel.pipeline.schedules import SCHEDULES

SIZES = [(name, p, v, m) for name in SCHEDULES for p in (1, 2, 3, 4, 5)
         for v in ((1,) if name != "interleaved-1f1b" else (1, 2, 3)) if p > 1 or v == 1
         for m in range(1, 13) if name != "interleaved-1f1b" or m <= p or m % p == 0]


def lists_of(name, p, v, m):
    return with_comm(SCHEDULES[name].order(p, v, m), p, v)


@pytest.mark.parametrize("name,p,v,m", SIZES)
def test_every_schedule_passes_the_checker_and_idles_as_its_theory_says(name, p, v, m):
    timed = check(lists_of(name, p, v, m), p, v, m, name=name)
    expected = {"gpipe": Fraction(p - 1, m + p - 1), "1f1b": Fraction(p - 1, m + p - 1),
                "interleaved-1f1b": Fraction(p - 1, v * m + p - 1) if m % p == 0 else None,
                "zb-h1": Fraction(p - 1, 3 * m + p - 1) if m >= p else None}[name]
    assert SCHEDULES[name].bubble(p, v, m) == expected
    if expected is not None:
        assert idle_fraction(timed, p) == expected
    else:  # fewer micro-batches than stages: still less idle than 1F1B at the same p and m
        assert idle_fraction(timed, p) <= Fraction(p - 1, m + p - 1)


def peak_alive(actions):
    return check_peaks([actions])[0]


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 3, 4, 5) for m in (1, 2, p, 2 * p + 1, 3 * p)])
def test_activations_alive_are_what_each_schedule_promises(p, m):
    peaks = {name: [peak_alive(a) for a in lists_of(name, p, 1, m)] for name in ("gpipe", "1f1b", "zb-h1")}
    assert peaks["gpipe"] == [m] * p
    assert peaks["1f1b"] == [min(p - s, m) for s in range(p)]
    # zero-bubble keeps an input's activations until its W: never more than 1F1B's most
    assert all(peak <= min(p, m) for peak in peaks["zb-h1"]) and max(peaks["zb-h1"]) == max(peaks["1f1b"])
    # interleaved: chunks of 1/v of a stage; (v-1)·p + 2(p-1-r) + 1 at most on rank r
    for v in (2, 3):
        if m <= p or m % p == 0:
            for r, actions in enumerate(lists_of("interleaved-1f1b", p, v, m)):
                assert peak_alive(actions) <= min((v - 1) * min(m, p) + 2 * (p - 1 - r) + 1, v * m)


def test_interleaved_order_is_narayanan_et_al_s():
    """p = 2, v = 2, m = 4: rank r holds stages r and r + 2; forwards go in rounds of p
    micro-batches chunk by chunk, backwards the chunks in reverse; warm-up (v-1)·p + 2(p-1-r)."""
    orders = SCHEDULES["interleaved-1f1b"].order(2, 2, 4)
    short = [[f"{a.op.value}{a.microbatch}.{a.stage}" for a in order] for order in orders]
    assert short[0] == ["F0.0", "F1.0", "F0.2", "F1.2",                      # warm-up: 2 + 2
                        "F2.0", "B0.2", "F3.0", "B1.2", "F2.2", "B0.0", "F3.2", "B1.0",
                        "B2.2", "B3.2", "B2.0", "B3.0"]
    assert short[1] == ["F0.1", "F1.1",                                      # warm-up: 2
                        "F0.3", "B0.3", "F1.3", "B1.3", "F2.1", "B0.1", "F3.1", "B1.1",
                        "F2.3", "B2.3", "F3.3", "B3.3", "B2.1", "B3.1"]


def test_zero_bubble_defers_one_weight_pass_per_stage_below():
    """ZB-H1 at p = 3, m = 4: stage s runs 1F1B's order with B split in I and W, and its first
    s weight passes deferred until s more inputs' gradients are done."""
    orders = SCHEDULES["zb-h1"].order(3, 1, 4)
    short = [" ".join(f"{a.op.value}{a.microbatch}" for a in order) for order in orders]
    assert short == ["F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
                     "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
                     "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3"]


def test_every_send_is_posted_after_the_compute_that_makes_it_and_each_receive_before_use():
    for a_list in lists_of("interleaved-1f1b", 4, 2, 8):
        seen = set()
        for a in a_list:
            if a.op is Op.SEND_F:
                assert (Op.F, a.microbatch, a.stage - 1) in seen
            if a.op is Op.F and a.stage > 0:
                assert (Op.RECV_F, a.microbatch, a.stage) in seen
            if a.op is Op.B and a.stage < 7:
                assert (Op.RECV_B, a.microbatch, a.stage + 1) in seen
            seen.add((a.op, a.microbatch, a.stage))


def _broken(name, p, v, m, edit):
    lists = [list(actions) for actions in lists_of(name, p, v, m)]
    edit(lists)
    return lists


def test_a_swapped_send_is_refused_naming_the_link_and_the_ranks():
    """GPipe, p = 2, m = 3: rank 0 sends its activations after all its forwards, 2, 1, 0."""
    def reverse(ls):
        moved = [a for a in ls[0] if a.op is Op.SEND_F][::-1] + [a for a in ls[0] if a.op is Op.RECV_B]
        ls[0] = [a for a in ls[0] if a not in moved]
        at = ls[0].index(Action(Op.F, 2, 0)) + 1
        ls[0][at:at] = moved
    with pytest.raises(ScheduleError, match=r"rank 0 sends the activations into stage 1 for micro-batches "
                                            r"\[2, 1, 0\], but rank 1 receives \[0, 1, 2\]"):
        check(_broken("gpipe", 2, 1, 3, reverse), 2, 1, 3)


def test_a_missing_weight_pass_is_refused_naming_the_rank_and_the_action():
    lists = _broken("zb-h1", 3, 1, 4, lambda ls: ls[1].remove(Action(Op.W, 2, 1)))
    with pytest.raises(ScheduleError, match=r"rank 1 never runs W\(micro-batch 2, stage 1\): every weight "
                                            r"gradient must be done before the step ends"):
        check(lists, 3, 1, 4)


def test_a_backward_before_its_gradient_arrives_is_refused():
    def early(ls):
        b = next(a for a in ls[0] if a.op is Op.B)
        ls[0].remove(b)
        ls[0].insert(1, b)
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 B\(micro-batch 0, stage 0\): comes before "
                                            r"RECV_B\(micro-batch 0, stage 1\)"):
        check(_broken("gpipe", 2, 1, 2, early), 2, 1, 2)


def test_lists_that_wait_on_each_other_are_refused_naming_every_waiting_rank():
    """Rank 0 takes micro-batch 0's backward before it runs micro-batch 1's forward; rank 1
    runs both forwards before any backward: each waits for the other, for ever."""
    r0 = [Action(Op.F, 0, 0), Action(Op.SEND_F, 0, 1), Action(Op.RECV_B, 0, 1), Action(Op.B, 0, 0),
          Action(Op.F, 1, 0), Action(Op.SEND_F, 1, 1), Action(Op.RECV_B, 1, 1), Action(Op.B, 1, 0)]
    r1 = [Action(Op.RECV_F, 0, 1), Action(Op.F, 0, 1), Action(Op.RECV_F, 1, 1), Action(Op.F, 1, 1),
          Action(Op.B, 0, 1), Action(Op.SEND_B, 0, 1), Action(Op.B, 1, 1), Action(Op.SEND_B, 1, 1)]
    with pytest.raises(ScheduleError, match=r"would hang in its first step: rank 0 at action 3 B\(micro-batch 0, "
                                            r"stage 0\) waits for rank 1 to send the gradient of micro-batch 0 out of "
                                            r"stage 1; rank 1 at action 2 RECV_F\(micro-batch 1, stage 1\) waits for "
                                            r"rank 0 to send the activation of micro-batch 1"):
        check([r0, r1], 2, 1, 2)
    r1[2:4], r1[4:6] = r1[4:6], r1[2:4]  # rank 1 in 1F1B's order: sound
    check([r0, r1], 2, 1, 2)


def test_settings_the_schedules_cannot_run_are_refused_with_what_to_pass():
    with pytest.raises(ConfigError, match="microbatches=6 is neither a multiple of 4 nor fewer than 4; pass "
                                          "microbatches=4 or 8"):
        Pipeline(stages=4, virtual=2, schedule="interleaved-1f1b", microbatches=6)
    with pytest.raises(ConfigError, match="virtual=2 needs schedule='interleaved-1f1b'"):
        Pipeline(stages=2, virtual=2, schedule="1f1b")
    with pytest.raises(ConfigError, match="more than one needs stages >= 2"):
        Pipeline(stages=1, virtual=2, schedule="interleaved-1f1b")
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'zbv'"):
        Pipeline(stages=2, schedule="zbv")


def test_on_nccl_the_lists_must_also_keep_each_pairs_order():
    """NCCL ignores p2p tags: messages between two ranks meet their receives in the order sent.
    GPipe, 1F1B and ZB-H1 keep that order; interleaved 1F1B's lists do not, and are refused."""
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p, m in ((2, 4), (4, 8), (3, 5)):
            check(lists_of(name, p, 1, m), p, 1, m, ordered_pairs=True)
    with pytest.raises(ScheduleError, match="in another order than they are sent, which NCCL"):
        check(lists_of("interleaved-1f1b", 2, 2, 4), 2, 2, 4, ordered_pairs=True)
