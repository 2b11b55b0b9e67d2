"""Pipeline schedules as data: dependencies, matching, deadlock freedom, bubble and memory.

No torch: the schedules, the checker and the drawing must work without it.
"""

import subprocess
import sys
from dataclasses import FrozenInstanceError, replace

import pytest

from fivefold.parallel.pipeline.check import (
    Costs,
    ScheduleError,
    bubble_fraction,
    peak_inflight,
    simulate,
    validate,
)
from fivefold.parallel.pipeline.schedules import (
    RECV_F,
    SEND_F,
    Action,
    Schedule,
    afab,
    build_schedule,
    dualpipe_v,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
)

PPS = (1, 2, 4, 8)
F_EQUALS_B = Costs(forward=1, backward_input=1, backward_weight=0)  # full backward = F


def _microbatch_counts(pp: int, multiples_only: bool) -> list[int]:
    counts = {pp, 2 * pp, 3 * pp}
    if not multiples_only:
        counts |= {pp + 1, max(1, pp - 1)}
    return sorted(counts)


CASES = [
    (name, pp, m, virtual)
    for name, virtual, multiples_only in (
        ("afab", 1, False),
        ("1f1b", 1, False),
        ("interleaved", 2, True),
        ("interleaved", 4, True),
        ("zb-h1", 1, False),
    )
    for pp in PPS
    for m in _microbatch_counts(pp, multiples_only)
] + [("dualpipev", pp, m, 2) for pp in PPS for m in (2 * pp, 2 * pp + 1, 3 * pp)]


@pytest.mark.parametrize("name, pp, m, virtual", CASES)
def test_every_schedule_is_valid_and_deadlock_free(name, pp, m, virtual):
    schedule = build_schedule(name, pp, m, virtual)
    assert schedule.num_stages == pp * virtual
    simulation = simulate(schedule)  # raises on any broken rule or deadlock
    per_chunk = 3 if schedule.split_backward else 2
    assert sum(len(schedule.compute_actions(r)) for r in range(pp)) == per_chunk * m * pp * virtual
    if pp <= 4:  # latency only stretches time; it must not create a deadlock
        assert simulate(schedule, Costs(latency=0.25)).makespan >= simulation.makespan


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("build", [afab, one_f_one_b])
def test_afab_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(build, pp):
    # GPipe (Huang et al. 2019) and PipeDream-Flush (Narayanan et al. 2021): the bubble is
    # (p-1)(t_f+t_b), so its share of the step is (p-1)/(m+p-1) whatever t_f : t_b is.
    for m in _microbatch_counts(pp, multiples_only=False):
        expected = (pp - 1) / (m + pp - 1)
        schedule = build(pp, m)
        assert bubble_fraction(schedule, F_EQUALS_B) == pytest.approx(expected)
        assert bubble_fraction(schedule) == pytest.approx(expected)  # F=1, full B=2


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("virtual", [2, 4])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(pp, virtual):
    # Narayanan et al. 2021 (Megatron-LM, sec. 2.2.2): the bubble shrinks by v.
    for m in (pp, 2 * pp, 3 * pp):
        expected = (pp - 1) / (virtual * m + pp - 1)
        schedule = interleaved_1f1b(pp, m, virtual)
        assert bubble_fraction(schedule, F_EQUALS_B) == pytest.approx(expected)
        assert bubble_fraction(schedule) == pytest.approx(expected)


@pytest.mark.parametrize("pp", PPS)
def test_zero_bubble_h1_leaves_a_third_of_1f1b_idle_time(pp):
    # Qi et al. 2023: with T_F = T_B = T_W, ZB-H1 idles (p-1)T_F per rank against 1F1B's
    # (p-1)(T_F+T_B+T_W), so the bubble share is (p-1)/(3m+p-1). That needs m >= p: with
    # fewer micro-batches there are not enough W's to fill the tail.
    for m in [m for m in _microbatch_counts(pp, multiples_only=False) if m >= pp]:
        zb = simulate(zero_bubble_h1(pp, m))
        baseline = simulate(one_f_one_b(pp, m))
        assert zb.bubble == pytest.approx((pp - 1) / (3 * m + pp - 1))
        idle_zb = zb.makespan - zb.busy[0]
        idle_1f1b = baseline.makespan - baseline.busy[0]
        assert idle_zb == pytest.approx(idle_1f1b / 3)


@pytest.mark.parametrize("pp", PPS)
def test_peak_inflight_matches_the_papers(pp):
    for m in _microbatch_counts(pp, multiples_only=False):
        assert peak_inflight(afab(pp, m)) == [m] * pp
        one_f_one_b_peak = [min(m, pp - rank) for rank in range(pp)]
        assert peak_inflight(one_f_one_b(pp, m)) == one_f_one_b_peak
        zb = zero_bubble_h1(pp, m)
        # B frees as 1F1B does; counted until W, no rank holds more than 1F1B's rank 0.
        assert peak_inflight(zb, freed_by_weight=False) == one_f_one_b_peak
        assert max(peak_inflight(zb)) == max(one_f_one_b_peak)
    for virtual in (2, 4):
        for m in (pp, 2 * pp, 3 * pp):
            # Megatron: rank r runs 2(p-r-1) + (v-1)p warm-up chunk-forwards, then holds one more.
            expected = [
                min(m * virtual, 2 * (pp - rank - 1) + (virtual - 1) * pp + 1) for rank in range(pp)
            ]
            assert peak_inflight(interleaved_1f1b(pp, m, virtual)) == expected


def test_dualpipev_beats_1f1b_and_holds_about_pp_micro_batches():
    for pp in (2, 4, 8):
        m = 2 * pp
        dual = simulate(dualpipe_v(pp, m))
        assert dual.bubble < simulate(zero_bubble_h1(pp, m)).bubble
        # Two half-size chunks per rank: 2pp+1 chunk activations = pp + 1/2 micro-batches.
        assert max(dual.peak_inflight) == 2 * pp + 1


def test_stage_layouts():
    schedule = interleaved_1f1b(4, 8, 2)
    assert [schedule.stage_of(1, c) for c in range(2)] == [1, 5]
    assert schedule.rank_of(6) == 2 and schedule.chunk_of(6) == 1
    v_shape = dualpipe_v(4, 8)
    assert [v_shape.stage_of(0, c) for c in range(2)] == [0, 7]
    assert [v_shape.stage_of(3, c) for c in range(2)] == [3, 4]
    # The bottom of the V hands over in memory: no traffic from rank 3 to itself.
    assert all(a.peer != 3 for a in v_shape.actions[3])


def test_steps_batch_adjacent_communication():
    schedule = one_f_one_b(4, 8)
    steps = schedule.steps(1)
    assert steps[0] == (Action(RECV_F, 0, 0, 0),)
    assert all(isinstance(s, Action) or all(a.is_comm for a in s) for s in steps)
    assert any(isinstance(s, tuple) and len(s) == 2 for s in steps)  # send_forward_recv_backward


def test_actions_are_frozen():
    with pytest.raises(FrozenInstanceError):
        Action("F", 0).microbatch = 1


def _edited(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    copy = replace(schedule, actions=[list(a) for a in schedule.actions])
    copy.actions[rank] = actions
    return copy


def test_checker_catches_a_compute_before_its_input():
    schedule = one_f_one_b(2, 2)
    actions = list(schedule.actions[1])
    first_f = next(i for i, a in enumerate(actions) if a.kind == "F")
    actions.insert(0, actions.pop(first_f))  # F before its RECV_F
    with pytest.raises(ScheduleError, match="before its input"):
        validate(_edited(schedule, 1, actions))


def test_checker_catches_unmatched_and_reordered_transfers():
    schedule = one_f_one_b(2, 4)
    dropped = [a for a in schedule.actions[0] if not (a.kind == SEND_F and a.microbatch == 3)]
    with pytest.raises(ScheduleError, match="rank 0 -> rank 1"):
        validate(_edited(schedule, 0, dropped))
    receiving = list(schedule.actions[1])
    spots = [i for i, a in enumerate(receiving) if a.kind == RECV_F][:2]
    receiving[spots[0]], receiving[spots[1]] = receiving[spots[1]], receiving[spots[0]]
    with pytest.raises(ScheduleError):
        validate(_edited(schedule, 1, receiving))


def test_checker_reports_a_deadlock_cycle():
    # Rank 0 waits for a gradient before it sends the activations that would produce it.
    def act(kind, mb, peer=None):
        return Action(kind, mb, 0, peer)

    rank0 = [
        act("F", 0),
        act("RECV_B", 0, 1),
        act("F", 1),
        act("SEND_F", 0, 1),
        act("SEND_F", 1, 1),
        act("B", 0),
        act("RECV_B", 1, 1),
        act("B", 1),
    ]
    rank1 = [
        act("RECV_F", 0, 0),
        act("F", 0),
        act("B", 0),
        act("SEND_B", 0, 0),
        act("RECV_F", 1, 0),
        act("F", 1),
        act("B", 1),
        act("SEND_B", 1, 0),
    ]
    stuck = replace(one_f_one_b(2, 2), actions=[rank0, rank1])
    validate(stuck)  # order, matching and dependencies all hold; only timing fails
    with pytest.raises(ScheduleError, match="deadlock.*rank 0 is blocked.*rank 1 is blocked"):
        simulate(stuck)


@pytest.mark.parametrize(
    "call, fix",
    [
        (lambda: one_f_one_b(0, 4), "pp to 1 or more"),
        (lambda: afab(4, 0), "micro-batch"),
        (lambda: interleaved_1f1b(4, 6, 2), "use 8"),
        (lambda: interleaved_1f1b(4, 2, 2), "use 4"),
        (lambda: interleaved_1f1b(4, 8, 1), "virtual"),
        (lambda: dualpipe_v(4, 7), "at least 8"),
        (lambda: build_schedule("pipedream", 4, 8), "use one of"),
        (lambda: build_schedule("1f1b", 4, 8, virtual_stages=2), "interleaved"),
    ],
)
def test_bad_input_raises_one_line_value_error_naming_the_fix(call, fix):
    with pytest.raises(ValueError, match=fix) as error:
        call()
    assert "\n" not in str(error.value)


def test_draw_cli_writes_a_png(tmp_path):
    from fivefold.parallel.pipeline.draw import draw_side_by_side, main

    out = tmp_path / "x.png"
    assert main(["--schedule", "1f1b", "--pp", "2", "--microbatches", "2", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = [
        "--schedule",
        "interleaved",
        "--pp",
        "4",
        "--microbatches",
        "6",
        "--virtual",
        "2",
        "--out",
        str(tmp_path / "bad.png"),
    ]
    assert main(bad) == 2
    both = tmp_path / "both.png"
    draw_side_by_side([one_f_one_b(2, 4), zero_bubble_h1(2, 4)], str(both))
    assert both.stat().st_size > 0


def test_no_torch_import():
    code = (
        "import sys; import fivefold.parallel.pipeline.schedules, fivefold.parallel.pipeline.check;"
        " import fivefold.parallel.pipeline.draw; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
