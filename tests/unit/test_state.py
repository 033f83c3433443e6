"""L4: the lifecycle state machine allows exactly the moves of its one table."""

import pytest

from corrallm.lifecycle.state import BUSY, TRANSITIONS, IllegalTransition, State, check_transition


def test_L4_every_state_has_a_row_and_only_table_moves_are_legal():
    assert set(TRANSITIONS) == set(State)
    for old in State:
        for new in State:
            if new in TRANSITIONS[old]:
                check_transition(old, new)
            else:
                with pytest.raises(IllegalTransition):
                    check_transition(old, new)


def test_L4_a_replacement_is_never_started_from_a_running_or_stopping_process():
    for state in (State.READY, State.DRAINING, State.STOPPING):
        assert State.STARTING not in TRANSITIONS[state]
    assert frozenset({State.STARTING, State.WAKING, State.DRAINING, State.STOPPING}) == BUSY


def test_W1_asleep_is_left_only_by_a_wake_or_a_stop_and_a_wake_is_a_lifecycle_action():
    assert TRANSITIONS[State.ASLEEP] == {State.WAKING, State.STOPPING}
    assert State.ASLEEP in TRANSITIONS[State.DRAINING]  # a sleep drains first
    assert State.ASLEEP not in TRANSITIONS[State.READY]
    for state in (State.ASLEEP, State.WAKING):
        assert State.STARTING not in TRANSITIONS[state]  # the same process is woken
    assert State.WAKING in BUSY
