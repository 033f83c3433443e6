"""K6: which conversation a request belongs to (`session_key`) and the bounded memory of
where conversations ran (`Affinity`), by example and by property. Pure: no I/O."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from corrallm.routing.affinity import Affinity, conversation_opening, session_key

SYSTEM = {"role": "system", "content": "You are terse."}
USER1 = {"role": "user", "content": "What is a GGUF file?"}
ANSWER1 = {"role": "assistant", "content": "A model file for llama.cpp."}
USER2 = {"role": "user", "content": "Who reads it?"}


def key(messages: list[object] | None = None, *headers: tuple[bytes, bytes], **fields: object):
    payload = {"model": "m", **fields}
    if messages is not None:
        payload["messages"] = messages
    return session_key(list(headers), payload)


# -- the key ----------------------------------------------------------------------------


@pytest.mark.parametrize("system", [[], [SYSTEM]], ids=["no system", "system"])
def test_K6_turn_one_and_its_follow_up_share_the_key(system):
    first, follow_up = key([*system, USER1]), key([*system, USER1, ANSWER1, USER2])
    assert (first == follow_up, first is None) == (True, False)


def test_K6_conversations_with_one_system_prompt_and_different_questions_differ():
    assert key([SYSTEM, USER1]) != key([SYSTEM, USER2])


def test_K6_the_session_header_comes_first_then_user_then_the_opening():
    header = (b"X-Corrallm-Session", b"chat-42")
    keys = [
        key([USER1], header, user="ann"),
        key([USER2], (b"x-corrallm-session", b"chat-42")),
        key([USER1], user="ann"),
        key([USER2], user="ann"),
        key([USER1]),
    ]
    assert [keys[0] == keys[1], keys[2] == keys[3], len(set(keys))] == [True, True, 3]


def test_K6_a_header_and_a_user_of_the_same_name_are_different_sessions():
    assert key(None, (b"x-corrallm-session", b"ann")) != key(None, user="ann")


@pytest.mark.parametrize(
    "payload",
    [
        {"model": "m"},  # an upload: only the model is known
        {"model": "m", "prompt": "Once upon"},  # completions
        {"model": "m", "messages": []},
        {"model": "m", "messages": "not a list"},
        {"model": "m", "messages": [ANSWER1, USER1]},  # nothing before the model's words
        {"model": "m", "user": "", "messages": None},
        {"model": "m", "user": 7},
    ],
)
def test_K6_no_conversation_named_no_key(payload):
    assert session_key([(b"x-corrallm-session", b"  ")], payload) is None


def test_K6_the_opening_is_two_messages_cut_before_the_models_first():
    openings = [
        conversation_opening([SYSTEM, USER1, ANSWER1, USER2]),
        conversation_opening([USER1, ANSWER1, USER2]),
        conversation_opening([USER1, {"role": "tool", "content": "42"}]),
        conversation_opening([USER1, USER2, ANSWER1]),
    ]
    assert openings == [[SYSTEM, USER1], [USER1], [USER1], [USER1, USER2]]


def test_K6_the_key_does_not_depend_on_the_order_of_fields():
    reordered = {"content": USER1["content"], "role": "user"}
    assert key([reordered]) == key([USER1])


def test_K6_every_key_is_small_whatever_the_client_sends():
    huge = "x" * 100_000
    keys = [key([{"role": "user", "content": huge}]), key(None, user=huge)]
    keys.append(key(None, (b"x-corrallm-session", huge.encode())))
    assert [len(k) <= 40 for k in keys if k] == [True, True, True]


# -- the memory -------------------------------------------------------------------------


def test_K6_the_memory_drops_the_least_recently_used_past_its_bound():
    memory = Affinity(2)
    memory.put("a", "b1"), memory.put("b", "b2")
    memory.get("a")  # a is used again: b is now the oldest
    memory.put("c", "b1")
    assert [memory.get("a"), memory.get("b"), memory.get("c"), len(memory)] == [
        "b1",
        None,
        "b1",
        2,
    ]


def test_K6_the_memory_follows_a_conversation_that_moved_and_ignores_no_key():
    memory = Affinity()
    memory.put("a", "b1"), memory.put("a", "b2"), memory.put(None, "b3")
    assert [memory.get("a"), memory.get(None), len(memory)] == ["b2", None, 1]


def test_K6_a_memory_needs_room_for_one():
    with pytest.raises(ValueError, match="at least 1"):
        Affinity(0)


operations = st.lists(
    st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 12), st.sampled_from("xyz")),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(bound=st.integers(1, 8), ops=operations)
def test_K6_the_memory_never_exceeds_its_bound_and_is_an_lru(bound, ops):
    memory, model = Affinity(bound), OrderedDict[int, str]()
    for op, k, backend in ops:
        if op == "put":
            memory.put(k, backend)
            model[k] = backend
            model.move_to_end(k)
            if len(model) > bound:
                model.popitem(last=False)
        else:
            want = model.get(k)
            if want is not None:
                model.move_to_end(k)
            assert memory.get(k) == want
        assert len(memory) == len(model) <= bound
