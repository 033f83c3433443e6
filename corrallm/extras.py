"""Optional extras (pyproject.toml's optional-dependencies): what a feature asked for says
when its extra is not installed. One line naming the extra and how to install it, never
a traceback (`corrallm serve` prints it and exits): the PostgreSQL store (X5) and the
OpenTelemetry traces (E2) both go through `missing_extra`."""

from __future__ import annotations


class MissingExtra(Exception):
    """A feature asked for needs an optional extra that is not installed; the message is
    the one line to show, naming the extra and how to install it."""


def missing_extra(exc: ImportError, modules: str, needs: str, extra: str) -> MissingExtra | None:
    """The `MissingExtra` for `exc`, raised importing a feature, when the module it could
    not load is one of the extra's (its name starts with `modules`); None when it is
    another module (a bug to let through, not an extra to install). `needs`: what asked
    for it and what it needs ("--db postgresql://… needs the PostgreSQL driver psycopg")."""
    if not (exc.name or modules).startswith(modules):
        return None
    reason = (str(exc).splitlines() or [type(exc).__name__])[0]
    return MissingExtra(
        f"{needs}, which could not be loaded ({reason}): install the {extra} extra, "
        f"pip install 'corrallm[{extra}]'"
    )
