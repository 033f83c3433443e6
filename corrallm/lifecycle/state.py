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
    # READY -> STOPPED: the process exited on its own (crash); the next request restarts it.
    State.READY: frozenset({State.DRAINING, State.STOPPING, State.STOPPED}),
    State.DRAINING: frozenset({State.STOPPING, State.STOPPED}),
    State.STOPPING: frozenset({State.STOPPED, State.PAUSED}),
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
