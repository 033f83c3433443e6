"""The per-process state machine (SPEC §4 L4): states and the one table of legal moves."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPING = "stopping"
    PAUSED = "paused"
    FAILED = "failed"


# Every legal transition, as h11 keeps them: one table, checked on every move.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING, State.PAUSED}),
    # STARTING -> STOPPING: unload or shutdown while loading, or the health timeout kill.
    # STARTING -> STOPPED: no room could be made in the memory pools; nothing was spawned.
    State.STARTING: frozenset({State.READY, State.FAILED, State.STOPPING, State.STOPPED}),
    # READY/DRAINING -> STOPPING: an unload or shutdown, or a failure (M4: the process
    # exited on its own, or `health.failures` liveness probes in a row failed) whose
    # teardown ends in FAILED.
    State.READY: frozenset({State.DRAINING, State.STOPPING}),
    State.DRAINING: frozenset({State.STOPPING}),
    # STOPPING -> FAILED: the end of a failure's teardown (M4); a persistent backend is
    # then restarted after the start back-off, any other by the next request, at once.
    State.STOPPING: frozenset({State.STOPPED, State.PAUSED, State.FAILED}),
    State.PAUSED: frozenset({State.STOPPED}),
    State.FAILED: frozenset({State.STARTING, State.STOPPED, State.PAUSED}),
}

# While in one of these, a lifecycle action is under way and an explicit load is refused.
BUSY = frozenset({State.STARTING, State.DRAINING, State.STOPPING})


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: State, new: State) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old} -> {new} is not a legal lifecycle transition")
