"""T5: a JSON body that repeats a key in one object, at any depth, is refused naming the
key (corrallm/proxy/jsonbody.py); every other body parses as orjson parses it.

Hypothesis builds nested JSON (keys and strings full of colons, quotes, backslashes and
escapes, written compactly or spaced) and writes it out with one key of one object
repeated, or not: whichever counting step decides, the verdict must be the truth."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corrallm.http.errors import ApiError
from corrallm.proxy import jsonbody

# Text that stresses the byte counts: colons, quotes, backslashes, white space, escapes.
TRICKY = st.text(alphabet=st.sampled_from([*'ab:"\\ \n\t{}u0x', "é", "\u2028"]), max_size=8)
SCALARS = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | TRICKY


def objects(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=4) | st.dictionaries(TRICKY, children, max_size=4)


VALUES = st.recursive(SCALARS, objects, max_leaves=25)
LAYOUTS = st.sampled_from([(",", ":"), (", ", ": "), (",", " : "), (",\n", ":\t")])


def write(value: Any, layout: tuple[str, str], ascii_only: bool, dup: list[int] | None) -> str:
    """`value` as JSON text; with `dup` = [n], the n-th object with a key (children
    before their parent) has its first key written twice, the second time with 0."""
    item, colon = layout

    def out(v: Any) -> str:
        if isinstance(v, dict):
            pairs = [
                f"{json.dumps(k, ensure_ascii=ascii_only)}{colon}{out(x)}" for k, x in v.items()
            ]
            if dup is not None and v:
                if dup[0] == 0:
                    first = next(iter(v))
                    pairs.append(f"{json.dumps(first, ensure_ascii=ascii_only)}{colon}0")
                dup[0] -= 1
            return "{" + item.join(pairs) + "}"
        if isinstance(v, list):
            return "[" + item.join(out(x) for x in v) + "]"
        return json.dumps(v, ensure_ascii=ascii_only)

    return out(value)


def objects_with_keys(value: Any) -> int:
    if isinstance(value, dict):
        return (1 if value else 0) + sum(objects_with_keys(v) for v in value.values())
    if isinstance(value, list):
        return sum(objects_with_keys(v) for v in value)
    return 0


@settings(max_examples=400, deadline=None)
@given(VALUES, LAYOUTS, st.booleans())
def test_T5_a_body_without_a_repeated_key_parses_as_orjson_does(
    value: Any, layout: tuple[str, str], ascii_only: bool
) -> None:
    body = write(value, layout, ascii_only, None).encode()
    assert jsonbody.parse(body) == orjson.loads(body)


@settings(max_examples=400, deadline=None)
@given(VALUES.filter(lambda v: objects_with_keys(v) > 0), LAYOUTS, st.booleans(), st.data())
def test_T5_a_key_repeated_at_any_depth_is_refused_by_name(
    value: Any, layout: tuple[str, str], ascii_only: bool, data: st.DataObject
) -> None:
    which = data.draw(st.integers(0, objects_with_keys(value) - 1))
    # Objects are counted children first, so the top object is the last: `which` lands
    # inside `value`, at depth 1 or more.
    body = write({"model": "m", "nested": value}, layout, ascii_only, [which]).encode()
    with pytest.raises(ApiError) as refused:
        jsonbody.parse(body)
    error = refused.value
    assert (error.status, error.code, error.type) == (400, "duplicate_key", "invalid_request_error")
    repeated = error.param
    assert repeated is not None and f"'{repeated}'" in error.message
    # The named key is one that the body does repeat in some object.
    assert body.count(json.dumps(repeated, ensure_ascii=ascii_only).encode()) >= 2


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "a", "model": "b"}',
        b'{"model":"m","messages":[{"role":"user","role":"system","content":"x"}]}',
        b'{"a": {"b": {"c": 1, "c": 2}}}',
        b'[{"x": 1}, {"y": 1, "y": 1}]',
        b'{"a" : 1 , "a" : 2}',  # spaced
        b'{"a": 1, "\\u0061": 2}',  # the same key, escaped
        b'{"t": "no: colon: here: \\": \\":", "k": 1, "k": 2}',  # colons and \": in strings
        b'{"k\\\\": 1, "k\\\\": 2}',  # a key ending in a backslash
        # spaced keys, and a `\\\":` in a string making the `":` count come out even
        b'{"k" : 1, "k" : 2, "s":"x\\\\\\":"}',
    ],
)
def test_T5_duplicates_the_counts_could_miss_are_found(body: bytes) -> None:
    with pytest.raises(ApiError) as refused:
        jsonbody.parse(body)
    assert refused.value.code == "duplicate_key"


def test_T5_the_message_names_the_key_and_why() -> None:
    with pytest.raises(ApiError) as refused:
        jsonbody.parse(b'{"model": "cheap", "max_tokens": 5, "max_tokens": 90000}')
    assert refused.value.param == "max_tokens"
    assert "'max_tokens' more than once" in refused.value.message


def test_T5_not_json_is_still_400_invalid_request() -> None:
    with pytest.raises(ApiError) as refused:
        jsonbody.parse(b'{"model": ')
    assert refused.value.status == 400 and "not valid JSON" in refused.value.message
