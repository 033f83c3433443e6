"""T5: the gateway's log redacts its secrets (observe/redaction.py): in a message's
arguments, in an exception's text; a record without any is left as it was."""

from __future__ import annotations

import io
import logging

from corrallm.observe.redaction import Redactor, install

SECRET = "peer-token-abcdef"


def logger_with(secrets: list[str]) -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = logging.getLogger(f"test.redaction.{id(out)}")
    log.propagate = False
    log.setLevel(logging.DEBUG)
    log.handlers = [handler]
    assert install(Redactor(lambda: secrets), [log.name]) == 1
    return log, out


def test_T5_a_secret_in_a_message_or_its_arguments_is_replaced() -> None:
    log, out = logger_with([SECRET])
    log.warning("backend said: %s", f"token={SECRET} ok")
    log.warning(f"inline {SECRET}")
    assert (
        out.getvalue() == "WARNING backend said: token=[redacted] ok\nWARNING inline [redacted]\n"
    )


def test_T5_a_secret_in_an_exception_is_replaced() -> None:
    log, out = logger_with([SECRET])
    try:
        raise RuntimeError(f"cannot reach http://x with {SECRET}")
    except RuntimeError:
        log.exception("failed")
    text = out.getvalue()
    assert "RuntimeError: cannot reach http://x with [redacted]" in text and SECRET not in text


def test_T5_a_record_without_secrets_is_untouched_and_the_secrets_are_read_each_time() -> None:
    secrets: list[str] = []
    log, out = logger_with(secrets)
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "n=%d", (3,), None)
    assert Redactor(lambda: [SECRET]).filter(record) and record.args == (3,)
    log.info("before %s", SECRET)
    secrets.append(SECRET)  # a reload brought a new one
    log.info("after %s", SECRET)
    assert out.getvalue() == f"INFO before {SECRET}\nINFO after [redacted]\n"
