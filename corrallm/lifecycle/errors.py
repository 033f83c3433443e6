"""What callers of a supervisor can be told about a backend's lifecycle, as exceptions
whose message is meant for a person."""

from __future__ import annotations

RETIRED = "backend_retired"  # a reload took the backend away before the request reached it


class LifecycleError(Exception):
    """Something a caller can be told about a backend's lifecycle, in words.

    Each kind says what it means on every surface (http/errors.py `lifecycle_failure`):
    its status on the inference surfaces, its status on the management API, its code."""

    status = 502
    management_status = 502
    code = "backend_error"


class BackendFailed(LifecycleError):
    """The backend could not be started; the message carries its log tail."""

    code = "backend_start_failed"


class BackendRetired(BackendFailed):
    """A config reload removed or replaced the backend: it is never started again."""

    code = RETIRED


class BackendPaused(LifecycleError):
    # F3: a pause is a decision, not congestion (no Retry-After); an explicit load: 423.
    status = 503
    management_status = 423
    code = "paused"


class LifecycleBusy(LifecycleError):
    """Another lifecycle action on this process is under way (an explicit load gets 409)."""

    status = 503
    management_status = 409
    code = "lifecycle_busy"


class PeerDown(LifecycleError):
    """The peer node serving this backend stopped answering (SPEC §19 X4)."""

    status = 503
    management_status = 503
    code = "peer_down"
