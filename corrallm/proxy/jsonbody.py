"""JSON request bodies, parsed once for every /v1 surface (SPEC §22 T5): a body with a
duplicate key, at any depth, is refused.

Parsers disagree on `{"model": "a", "model": "b"}`: orjson (corrallm) keeps the last,
others the first or either. A body corrallm judged by one value could reach a backend
that reads the other (a model the key may not use, a `max_tokens` past the spend
estimate), so such a body is a 400 naming the key.

orjson says nothing of duplicates, so they are found by counting. The keys the parsed
body holds (`keys`, a walk over its objects and lists) fall short of the keys its text
has exactly when a key repeats, and the text's keys are bounded from above by cheap
counts of its bytes:

1. its colons: equal, no duplicate (a body with no colon inside a string);
2. else, for a body up to `COUNTED` bytes, its `":` pairs, less those whose quote is
   escaped by one backslash (`\\":`, JSON inside a string: tool-call arguments),
   provided no key is spaced from its colon (compact JSON, what every SDK sends; one
   search): equal, no duplicate;
3. else (a larger body, a key spaced from its colon, a `":` inside a string) the body is
   parsed again by the standard library with a hook that sees every key of every object,
   which names the repeated key or finds none.

bench/json_bodies.py measures it against orjson's parse alone: a small chat body costs
about 1 us more in all (step 1); one of 5 kB with tools and colons in its text (step 2)
about 30 us more, 4-5x orjson's parse; a 120 kB conversation (step 3) about 4-5x too.
Past `COUNTED` step 2's byte counts cost more than the standard library's parse, so
step 3 comes at once. Small against a request's forwarding either way.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from corrallm.http.errors import ApiError, bad_request

COUNTED = 32 * 1024
# A string's closing quote, white space, a colon: a key not written compactly (or such
# text inside a string), where step 2's bound does not hold.
_SPACED_KEY = re.compile(rb'"[ \t\r\n]+:')


class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def parse(body: bytes) -> Any:
    """The body's JSON value; ApiError 400 when it is not JSON or repeats a key."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(
            f"The request body is not valid JSON ({exc}). Send a JSON object."
        ) from None
    if type(value) is dict or type(value) is list:
        try:
            check_unique(body, value)
        except DuplicateKey as exc:
            raise ApiError(
                400,
                f"The request body has the key '{exc.key[:128]}' more than once in one "
                "object; send each key once (parsers disagree on which one counts).",
                code="duplicate_key",
                param=exc.key[:128],
            ) from None
    return value


def check_unique(body: bytes, value: dict[str, Any] | list[Any]) -> None:
    """Raise `DuplicateKey` if some object of `body` (whose parse is `value`) repeats a
    key. The counting steps of the module's docstring, then the exact check if needed."""
    held = keys(value)
    if held == body.count(b":"):
        return
    if len(body) > COUNTED:
        return _exact(body)
    quoted = body.count(b'":')
    if held != quoted:
        # `\":` preceded by another backslash may end a key (`"a\\":`): only quotes
        # escaped by exactly one backslash are left out, so this stays a bound.
        quoted -= body.count(b'\\":') - body.count(b'\\\\":')
    if held == quoted and _SPACED_KEY.search(body) is None:
        return
    _exact(body)


def keys(value: dict[str, Any] | list[Any]) -> int:
    """How many keys the objects in `value` hold, all depths together."""
    n = 0
    stack: list[Any] = [value]
    pop, push = stack.pop, stack.append
    while stack:
        container = pop()
        if type(container) is dict:
            n += len(container)
            items = container.values()
        else:
            items = container
        for item in items:
            if type(item) is dict or type(item) is list:
                push(item)
    return n


def _exact(body: bytes) -> None:
    json.loads(body, object_pairs_hook=_unique)


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    made = dict(pairs)
    if len(made) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return made
