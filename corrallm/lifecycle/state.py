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
    ASLEEP = "asleep"
    WAKING = "waking"


# Best first: the state a model shows is the best among its backends' (K3).
BEST_FIRST = {
    state: rank
    for rank, state in enumerate(
        (
            State.READY,
            State.WAKING,
            State.STARTING,
            State.ASLEEP,
            State.DRAINING,
            State.STOPPING,
            State.STOPPED,
            State.FAILED,
            State.PAUSED,
        )
    )
}

# Every legal transition, as h11 keeps them: one table, checked on every move.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STOPPED: frozenset({State.STARTING, State.PAUSED}),
    # STARTING -> STOPPING: unload or shutdown while loading, or the health timeout kill.
    # STARTING -> STOPPED: no room could be made in the memory pools; nothing was spawned.
    # STARTING -> ASLEEP: a process re-adopted after a restart of corrallm was asleep (W1).
    State.STARTING: frozenset(
        {State.READY, State.FAILED, State.STOPPING, State.STOPPED, State.ASLEEP}
    ),
    # READY/DRAINING -> STOPPING: an unload or shutdown, or a failure (M4: the process
    # exited on its own, or `health.failures` liveness probes in a row failed) whose
    # teardown ends in FAILED.
    State.READY: frozenset({State.DRAINING, State.STOPPING}),
    # DRAINING -> ASLEEP: drained for a sleep (W1) whose call succeeded; a failed one stops.
    State.DRAINING: frozenset({State.STOPPING, State.ASLEEP}),
    # STOPPING -> FAILED: the end of a failure's teardown (M4); a persistent backend is
    # then restarted after the start back-off, any other by the next request, at once.
    State.STOPPING: frozenset({State.STOPPED, State.PAUSED, State.FAILED}),
    State.PAUSED: frozenset({State.STOPPED}),
    State.FAILED: frozenset({State.STARTING, State.STOPPED, State.PAUSED}),
    # Asleep (W1): the process lives and holds its sleepUsage. A request wakes it; an
    # eviction, unload, pause, shutdown or its own exit stops it.
    State.ASLEEP: frozenset({State.WAKING, State.STOPPING}),
    # WAKING -> ASLEEP: no room could be made for its full footprint; nothing was called.
    # WAKING -> STOPPING: the wake failed (then it is restarted) or was cancelled.
    State.WAKING: frozenset({State.READY, State.STOPPING, State.ASLEEP}),
}

# On the way to READY under a start task (a start, or a wake): callers wait on the task.
COMING = frozenset({State.STARTING, State.WAKING})

# While in one of these, a lifecycle action is under way and an explicit load is refused.
BUSY = frozenset({State.STARTING, State.WAKING, State.DRAINING, State.STOPPING})


class IllegalTransition(RuntimeError):
    pass


def check_transition(old: State, new: State) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"{old} -> {new} is not a legal lifecycle transition")
