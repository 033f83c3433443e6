"""OpenAI-shaped errors, now in http/errors.py (every surface shares them); named here too
for the /v1 modules that import them from proxy."""

from corrallm.http.errors import (
    QUOTED_CHARS,
    ApiError,
    bad_gateway,
    bad_request,
    internal,
    lifecycle_failure,
    not_found,
    quoted,
    unavailable,
)
from corrallm.lifecycle.errors import RETIRED

__all__ = [
    "QUOTED_CHARS",
    "RETIRED",
    "ApiError",
    "bad_gateway",
    "bad_request",
    "internal",
    "lifecycle_failure",
    "not_found",
    "quoted",
    "unavailable",
]
