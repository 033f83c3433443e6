"""What callers of a supervisor can be told about a backend's lifecycle, as exceptions
whose message is meant for a person."""

from __future__ import annotations


class LifecycleError(Exception):
    """Something a caller can be told about a backend's lifecycle, in words."""


class BackendFailed(LifecycleError):
    """The backend could not be started; the message carries its log tail."""


class BackendRetired(BackendFailed):
    """A config reload removed or replaced the backend: it is never started again."""


class BackendPaused(LifecycleError):
    pass


class LifecycleBusy(LifecycleError):
    """Another lifecycle action on this process is under way (an explicit load gets 409)."""


class PeerDown(LifecycleError):
    """The peer node serving this backend stopped answering (SPEC §19 X4)."""
