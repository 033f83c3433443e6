"""Test tiers that need a system part the Python environment cannot bring: Debian's
chromium (the browser tests), Debian's espeak-ng (the reference TTS backend), a built
llama-server. On a developer's machine without one, its tier is skipped with a loud
reason saying how to get it; under `.ci/run` (CORRALLM_REQUIRE_TIERS=1, which installs
them all) a missing part fails the tier instead, so CI never passes by skipping."""

from __future__ import annotations

import os
import shutil

import pytest

REQUIRED = os.environ.get("CORRALLM_REQUIRE_TIERS") == "1"
CHROMIUM = "/usr/bin/chromium"


def tier(missing: str | None) -> pytest.MarkDecorator:
    """Skip when `missing` says what is absent, unless tiers are required."""
    return pytest.mark.skipif(missing is not None and not REQUIRED, reason=missing or "")


def without_chromium() -> str | None:
    if shutil.which(CHROMIUM):
        return None
    return "NO CHROMIUM: the browser tests drive Debian's chromium (apt-get install chromium)"


def without_espeak() -> str | None:
    if shutil.which("espeak-ng"):
        return None
    return (
        "NO ESPEAK-NG: the reference text-to-speech backend runs Debian's espeak-ng "
        "(apt-get install espeak-ng)"
    )
