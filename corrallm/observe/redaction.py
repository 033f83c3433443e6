"""The gateway's log redacts what must never be shown (SPEC §22 T5): the admin token,
every peer's token, every backend's `env` values and configured header values (the
same values captures redact, `captures.Secrets`), wherever a line carries them: a
backend's output quoted in an error, an exception's text.

`corrallm serve` installs one `Redactor` on the handlers of corrallm's log (the root
logger's, which corrallm's loggers reach, and uvicorn's). It reads the secrets in force
at each record (a config reload changes them) and costs one `in` test per secret on the
record's final text; a record that holds none is passed on untouched.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Sequence

REDACTED = "[redacted]"


class Redactor(logging.Filter):
    def __init__(self, secrets: Callable[[], Sequence[str]]) -> None:
        super().__init__()
        self._secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = self._secrets()
        if not secrets:
            return True
        message = record.getMessage()
        clean = scrub(message, secrets)
        if clean is not message:
            record.msg, record.args = clean, None  # formatted once, here
        if record.exc_info and not record.exc_text:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, secrets)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info, secrets)
        return True


def scrub(text: str, secrets: Sequence[str]) -> str:
    """`text` with each secret replaced (longest first, as given); `text` itself, the
    same object, when it holds none."""
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def install(redactor: Redactor, loggers: Sequence[str] = ("", "uvicorn")) -> int:
    """Put `redactor` on every handler of these loggers ("" is the root); how many."""
    installed = 0
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if redactor not in handler.filters:
                handler.addFilter(redactor)
                installed += 1
    return installed
