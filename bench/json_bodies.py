"""What refusing duplicate JSON keys costs (SPEC §22 T5, corrallm/proxy/jsonbody.py):
`jsonbody.parse` against orjson's parse alone, in the same run, on chat bodies as SDKs
send them (compact) and spaced ones (the exact fallback).

    .venv/bin/python bench/json_bodies.py
"""

from __future__ import annotations

import json
import timeit
from collections.abc import Callable
from typing import Any

import orjson

from corrallm.proxy import jsonbody


def small() -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def with_tools() -> dict[str, Any]:
    """20 turns with colons in their text, 10 tools, one tool call (JSON in a string)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    tools = [
        {
            "type": "function",
            "function": {"name": f"t{i}", "description": "does: this", "parameters": schema},
        }
        for i in range(10)
    ]
    turns = [
        {"role": "user" if i % 2 else "assistant", "content": "at 12:30 see http://x: ok " * 5}
        for i in range(20)
    ]
    call = {"id": "c", "type": "function", "function": {"name": "t1", "arguments": '{"a": "x"}'}}
    turns.append({"role": "assistant", "tool_calls": [call]})
    return {"model": "m", "messages": turns, "tools": tools, "stream": True}


def long_chat() -> dict[str, Any]:
    turns = [{"role": "user", "content": "Lorem ipsum dolor sit amet: " * 20} for _ in range(200)]
    return {"model": "m", "messages": turns}


def best(fn: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main() -> None:
    print(f"{'body':<22}{'bytes':>8}{'orjson us':>11}{'checked us':>12}{'ratio':>7}")
    for make in (small, with_tools, long_chat):
        for spaced in (False, True):
            body = json.dumps(make(), separators=(",", " : ") if spaced else (", ", ": ")).encode()
            number = 20000 if len(body) < 1000 else 500
            base = best(lambda b=body: orjson.loads(b), number)
            checked = best(lambda b=body: jsonbody.parse(b), number)
            name = make.__name__ + (" spaced" if spaced else "")
            print(f"{name:<22}{len(body):>8}{base:>11.1f}{checked:>12.1f}{checked / base:>7.1f}")


if __name__ == "__main__":
    main()
