"""Back-off and restart budget of `serve` (pagedserve/launch/restart_policy.py), on a clock the test moves."""

from __future__ import annotations

import pytest

from pagedserve.launch.restart_policy import RestartBudget, RestartPolicy, RestartPolicyError


def test_back_off_doubles_from_one_second_up_to_thirty():
    policy = RestartPolicy(max_restarts=8)
    assert [policy.delay(n) for n in range(8)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert policy.delay(10_000) == 30


def test_the_budget_is_spent_one_crash_at_a_time_then_refused():
    budget = RestartBudget(RestartPolicy(max_restarts=3))
    assert [budget.take(now) for now in (0.0, 5.0, 10.0)] == [1, 2, 4]
    assert budget.num_left(11.0) == 0
    assert budget.take(12.0) is None


def test_a_healthy_period_refills_the_budget_and_resets_the_back_off():
    budget = RestartBudget(RestartPolicy(max_restarts=2, reset_after_s=600))
    assert budget.take(0.0) == 1
    budget.note_ready(10.0)
    assert budget.take(100.0) == 2  # ready for 90 s only: no refill
    budget.note_ready(110.0)
    budget.note_ready(500.0)  # still the same healthy period
    assert budget.num_left(709.0) == 0
    assert budget.take(710.0) == 1  # ready for 600 s: full budget, back-off from the start
    assert budget.num_left(711.0) == 1


def test_being_not_ready_ends_the_healthy_period():
    budget = RestartBudget(RestartPolicy(max_restarts=1, reset_after_s=60))
    assert budget.take(0.0) == 1
    budget.note_ready(10.0)
    budget.note_not_ready()
    budget.note_ready(50.0)
    assert budget.take(100.0) is None  # ready since 50 s: 50 s healthy, not 60
    budget.note_ready(100.0)
    assert budget.take(160.0) == 1


def test_a_crash_every_day_never_runs_out():
    budget = RestartBudget(RestartPolicy(max_restarts=3, reset_after_s=600))
    day = 86_400.0
    for n in range(30):
        budget.note_ready(n * day + 60)
        assert budget.take((n + 1) * day) == 1


@pytest.mark.parametrize("fields", [{"max_restarts": -1}, {"max_restarts": 1.5}, {"reset_after_s": -1},
                                    {"initial_delay_s": float("nan")}, {"initial_delay_s": 5, "max_delay_s": 1}])
def test_invalid_policies_are_refused(fields):
    with pytest.raises(RestartPolicyError):
        RestartPolicy(**fields)
