"""Durations and sizes as operators write them (SPEC §1)."""

from __future__ import annotations

import pytest

from corrallm.config import load_config_text
from corrallm.config.units import env_value, format_size, parse_duration, parse_size
from corrallm.http.bodies import BodyLimits
from corrallm.observe.events import buffer_from_env


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("30d", 30 * 86400.0),
        ("1.5s", 1.5),
        (" 10s ", 10.0),
        ("45", 45.0),
        (45, 45.0),
        (0.25, 0.25),
        (0, 0.0),
    ],
)
def test_durations_accept_units_and_plain_seconds(text: object, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["", "soon", "5 parsecs", "-5s", "5w", True, None, [5], -1])
def test_bad_durations_are_refused_with_the_accepted_forms(bad: object) -> None:
    with pytest.raises(ValueError, match=r"30s|negative"):
        parse_duration(bad)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MB", 512 * 10**6),
        ("1.5GB", 1_500_000_000),
        ("32GB", 32 * 10**9),
        ("1GiB", 2**30),
        ("512MiB", 512 * 2**20),
        ("2kb", 2000),
        ("100B", 100),
        ("1024", 1024),
        (4096, 4096),
        ("1TB", 10**12),
    ],
)
def test_sizes_accept_units_and_plain_bytes(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "lots", "5XB", "-1GB", False, None, {}, -5])
def test_bad_sizes_are_refused_with_the_accepted_forms(bad: object) -> None:
    with pytest.raises(ValueError, match=r"512MB|negative"):
        parse_size(bad)


def test_format_size_is_short_and_readable() -> None:
    assert format_size(32 * 10**9) == "32GB"
    assert format_size(1_500_000_000) == "1.5GB"
    assert format_size(512 * 10**6) == "512MB"
    assert format_size(12) == "12B"


def test_config_units_are_parsed_to_seconds_and_bytes() -> None:
    config = load_config_text(
        """
        servers: {box: {pools: {gpu0: 1.5GB, system: 1GiB}}}
        realtime: {idleTimeout: 500ms, maxDuration: 2h}
        maxBodySize: 10MB
        """.replace("        ", "")
    )
    assert config.servers["box"].pools == {"gpu0": 1_500_000_000, "system": 2**30}
    assert config.realtime.idle_timeout == 0.5
    assert config.realtime.max_duration == 7200.0
    assert config.max_body_size == 10 * 10**6


def test_max_body_size_defaults_to_64_megabytes() -> None:
    assert load_config_text("").max_body_size == 64 * 10**6


@pytest.mark.parametrize("value", [".inf", ".nan"])
def test_infinite_sizes_and_durations_are_config_problems_not_crashes(value: str) -> None:
    from corrallm.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config_text(
            f"servers: {{box: {{pools: {{gpu0: {value}}}}}}}\nrealtime: {{idleTimeout: {value}}}"
        )
    assert len(caught.value.problems) == 2
    assert all("finite" in p for p in caught.value.problems)


@pytest.mark.parametrize(
    ("read", "name", "bad", "message"),
    [
        (lambda env: BodyLimits.from_env(env).timeout, "CORRALLM_BODY_TIMEOUT", "0",
         "a positive number of seconds"),
        (lambda env: BodyLimits.from_env(env).timeout, "CORRALLM_BODY_TIMEOUT", "inf",
         "a positive number of seconds"),
        (lambda env: BodyLimits.from_env(env).max_memory, "CORRALLM_MAX_BODY_MEMORY", "lots",
         "a size above 0 such as 256MiB or 1GB"),
        (buffer_from_env, "CORRALLM_EVENT_BUFFER_MB", "-1", "a positive number of MB"),
    ],
)  # fmt: skip
def test_T5_a_bad_setting_in_the_environment_names_itself_and_what_it_takes(
    read, name, bad, message
):
    with pytest.raises(ValueError, match=f"^{name} must be {message}, got '{bad}'$"):
        read({name: bad})


def test_T5_settings_from_the_environment_and_their_defaults():
    assert BodyLimits.from_env({}) == BodyLimits(15.0, 256 * 2**20)
    limits = BodyLimits.from_env(
        {"CORRALLM_BODY_TIMEOUT": "2.5", "CORRALLM_MAX_BODY_MEMORY": "1MiB"}
    )
    assert limits == BodyLimits(2.5, 2**20)
    assert (buffer_from_env({}), buffer_from_env({"CORRALLM_EVENT_BUFFER_MB": " 0.5 "})) == (
        8 * 10**6,
        500_000,
    )
    assert env_value({"X": " "}, "X", float, "anything") is None
