import math

import pytest

from flaxstate.run_record import cadence


def test_young_daly_balances_a_save_s_cost_against_the_work_a_failure_loses():
    assert cadence.young_daly(2.0, 3600.0) == pytest.approx(120.0)  # sqrt(2 x 2 x 3600)
    # The interval it gives makes the time lost an hour least: saves' cost plus half an interval a failure.
    cost, mtbf = 2.0, 3600.0

    def lost_an_hour(interval):
        return 3600.0 / interval * cost + 3600.0 / mtbf * interval / 2

    best = cadence.young_daly(cost, mtbf)
    assert all(lost_an_hour(best) <= lost_an_hour(best * factor) for factor in (0.5, 0.9, 1.1, 2.0))
    assert cadence.young_daly(0.0, 3600.0) == 0.0  # a save that costs nothing: save all the time


def test_the_mean_time_between_failures_comes_from_the_prior_until_failures_are_seen():
    assert cadence.mtbf(0, 100.0, prior=3600.0) == pytest.approx(3700.0)  # no failure yet: the prior rules
    assert cadence.mtbf(3, 3000.0, prior=3600.0) == pytest.approx(1650.0)  # it fades as failures come
    assert cadence.mtbf(4, 2000.0) == pytest.approx(500.0)  # without a prior: the failures seen
    assert cadence.mtbf(0, 900.0) == pytest.approx(900.0)  # none seen in 900 s: at least that long


def test_a_failure_is_expected_to_lose_half_an_interval_and_the_save_in_flight():
    assert cadence.expected_loss(120.0, 2.0) == pytest.approx(62.0)


def steady(start, steps, step_time, n=4):
    """`n` consecutive intervals of `steps` steps at `step_time` seconds a step, from `start`."""
    length = steps * step_time
    return [cadence.Interval(start + i * length, start + (i + 1) * length, length, steps) for i in range(n)]


def test_the_drag_of_saves_is_the_step_time_beyond_the_clean_one_while_they_run():
    clean = steady(0.0, 10, 1.0)  # 0-40 s: 1 s a step
    slow = steady(40.0, 10, 1.5, n=2)  # 40-70 s: a save in flight, 1.5 s a step
    after = steady(70.0, 10, 1.0)
    drags = cadence.save_drag(clean + slow + after, [(40.0, 70.0)])
    assert drags == pytest.approx([0.0] * 4 + [5.0, 5.0] + [0.0] * 4)
    # A save's window that covers only part of an interval: the interval's excess is the drag.
    drags = cadence.save_drag(clean + slow + after, [(45.0, 50.0), (60.0, 62.0)])
    assert sum(drags) == pytest.approx(10.0)


def test_saves_that_cost_nothing_or_nothing_to_compare_with_give_no_drag():
    clean = steady(0.0, 10, 1.0)
    noisy = [
        cadence.Interval(40.0, 51.0, 11.0, 10),  # 10% slower while a save ran,
        cadence.Interval(51.0, 60.0, 9.0, 10),  # 10% faster while the next one ran: noise, not drag
    ]
    assert sum(cadence.save_drag(clean + noisy, [(40.0, 51.0), (51.0, 60.0)])) == pytest.approx(0.0)
    faster = steady(40.0, 10, 0.9, n=2)
    assert cadence.save_drag(clean + faster, [(40.0, 58.0)]) == [0.0] * 6
    # Every interval overlapped: no clean step time to compare with.
    assert cadence.save_drag(steady(0.0, 10, 2.0), [(0.0, 80.0)]) == [0.0] * 4
    assert cadence.save_drag([], []) == []


def test_a_window_counts_once_however_it_falls_on_the_intervals():
    assert cadence.overlap(10.0, 20.0, [(0.0, 12.0), (15.0, 16.0), (19.0, 30.0)]) == pytest.approx(4.0)
    assert cadence.overlap(10.0, 20.0, [(20.0, 30.0), (0.0, 10.0)]) == 0.0
    assert math.isclose(cadence.overlap(0.0, 1.0, [(0.0, 1.0)]), 1.0)
