"""llama-server's slots on the fake backend: `GET /slots`, and with --slot-save-path DIR
`POST /slots/{id}?action=save|restore|erase`, answered as llama-server answers them.

Each slot's "KV cache" is the list of words it last processed (prompt, then the generated
tokens); a request goes to the idle slot sharing the longest prefix with its prompt (else
the least recently used one, or `id_slot` when given) and reuses that prefix, which /slots
shows as `n_prompt_tokens_cache` and `n_prompt_tokens_processed`. A save writes the cache
to DIR/filename as JSON; a restore reads it back into a slot, so a follow-up turn after a
restart reuses it as it would with llama-server.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from corrallm.fake_backend.exchange import FakeExchange, Route
from corrallm.fake_backend.options import Options
from corrallm.fake_backend.responses import error_body, tokens

PREFIX = "/slots/"
FORMAT = "corrallm-fake-slot/1"
NOT_SUPPORTED = "This server does not support slots action. Start it with `--slot-save-path`"
RESTORE_FAILED = "Unable to restore slot: No available space in KV cache or invalid slot save file"
_RESERVED = frozenset('/\\:*?"<>|')


def valid_filename(name: str) -> bool:
    """What llama-server's fs_validate_filename accepts: a bare name of at most 255 bytes,
    no path separator, reserved or control character, no `..`, no leading or trailing space
    and no trailing dot."""
    if not name or len(name.encode()) > 255 or ".." in name:
        return False
    if name != name.strip(" ") or name.endswith("."):
        return False
    return not any(ord(c) < 0x20 or c in _RESERVED for c in name)


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Slot:
    id: int
    cache: list[str] = field(default_factory=list)
    processing: int = 0
    id_task: int | None = None  # None until it ran a task (llama-server then omits it)
    n_prompt: int = 0
    n_prompt_cache: int = 0
    n_decoded: int = 0
    last_used: float = 0.0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.idle.set()

    def view(self, n_ctx: int) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "n_ctx": n_ctx,
            "speculative": False,
            "is_processing": self.processing > 0,
        }
        if self.id_task is not None:
            out["id_task"] = self.id_task
            out["n_prompt_tokens"] = self.n_prompt
            out["n_prompt_tokens_processed"] = self.n_prompt - self.n_prompt_cache
            out["n_prompt_tokens_cache"] = self.n_prompt_cache
            next_token = {"has_next_token": self.processing > 0, "has_new_line": False}
            out["next_token"] = [{**next_token, "n_remain": -1, "n_decoded": self.n_decoded}]
        return out


class Slots:
    """Every slot of one fake backend, its /slots routes and the save/restore counters."""

    def __init__(self, opts: Options, log: Callable[[str], None]) -> None:
        self.opts = opts
        self.log = log
        self.slots = [Slot(i) for i in range(max(1, opts.n_slots))]
        self._tasks = itertools.count(0)
        self.saved: list[str] = []
        self.restored: list[str] = []

    def routes(self) -> dict[str, Route]:
        return {"/slots": ("GET", self.list_slots)}

    def route(self, path: str) -> Route | None:
        """The route of `/slots/{id}` (any id: a bad one is answered by the handler)."""
        return ("POST", self.action) if path.startswith(PREFIX) else None

    def stats(self) -> dict[str, Any]:
        return {
            "slot_saves": len(self.saved),
            "slot_restores": len(self.restored),
            "slot_files_saved": list(self.saved),
            "slot_files_restored": list(self.restored),
        }

    # --- processing --------------------------------------------------------------------------

    @contextmanager
    def run(self, body: dict[str, Any], words: list[str], n_out: int) -> Iterator[Slot]:
        """A request's prompt `words` processed on a slot that then holds them and the
        `n_out` generated tokens."""
        slot = self._pick(body, words)
        slot.processing += 1
        slot.idle.clear()
        slot.id_task = next(self._tasks)
        slot.n_prompt = len(words)
        slot.n_prompt_cache = _common(slot.cache, words)
        slot.n_decoded = 0
        try:
            yield slot
        finally:
            slot.cache = words + "".join(tokens(n_out)).split()
            slot.n_decoded = n_out
            slot.last_used = time.monotonic()
            slot.processing -= 1
            if not slot.processing:
                slot.idle.set()
            if not self.opts.fast:
                self.log(
                    f"slot      release: id {slot.id:2d} | task {slot.id_task} | stop processing: "
                    f"n_tokens = {len(slot.cache)}, prompt {slot.n_prompt} tokens "
                    f"({slot.n_prompt_cache} from the cache)"
                )

    def _pick(self, body: dict[str, Any], words: list[str]) -> Slot:
        wanted = body.get("id_slot")
        if isinstance(wanted, int) and 0 <= wanted < len(self.slots):
            return self.slots[wanted]
        idle = [s for s in self.slots if not s.processing]
        if not idle:  # the fake does not queue: share the least busy slot
            return min(self.slots, key=lambda s: s.processing)
        best = max(idle, key=lambda s: _common(s.cache, words))
        if _common(best.cache, words):
            return best
        return min(idle, key=lambda s: s.last_used)

    # --- routes ------------------------------------------------------------------------------

    async def list_slots(self, ex: FakeExchange, faulty: bool = False) -> None:
        n_ctx = self.opts.n_ctx_slot
        await ex.respond(200, orjson.dumps([s.view(n_ctx) for s in self.slots]))

    async def action(self, ex: FakeExchange, faulty: bool = False) -> None:
        if self.opts.slot_save_path is None:
            await ex.respond(501, error_body(NOT_SUPPORTED, "not_supported_error", 501))
            return
        raw = ex.scope["path"][len(PREFIX) :]
        id_slot = int(raw) if raw.isdigit() else -1
        action = ex.query().get("action", [""])[-1]
        problem: str | None
        if id_slot < 0:
            problem = "Invalid slot ID"
        elif action not in ("save", "restore", "erase"):
            problem = "Invalid action"
        elif id_slot >= len(self.slots):
            problem = "Invalid slot ID"
        else:
            problem = None if action == "erase" else _filename_problem(ex)
        if problem is not None:
            await ex.respond(400, error_body(problem, "invalid_request_error", 400))
            return
        slot = self.slots[id_slot]
        began = time.monotonic()
        await slot.idle.wait()  # llama-server defers the task while the slot is busy
        if action == "erase":
            n_erased, slot.cache = len(slot.cache), []
            await ex.respond(200, orjson.dumps({"id_slot": id_slot, "n_erased": n_erased}))
        elif action == "save":
            await self._save(ex, slot, ex.json()["filename"], began)
        else:
            await self._restore(ex, slot, ex.json()["filename"], began)

    async def _save(self, ex: FakeExchange, slot: Slot, filename: str, began: float) -> None:
        await asyncio.sleep(self.opts.slot_save_seconds)
        path = Path(self.opts.slot_save_path or "", filename)
        data = orjson.dumps(
            {
                "format": FORMAT,
                "model": self.opts.model_file,
                "id_slot": slot.id,
                "n_tokens": len(slot.cache),
                "tokens": slot.cache,
            }
        )
        try:
            await asyncio.to_thread(path.write_bytes, data)
        except OSError as exc:
            msg = f"Unable to save slot: {exc}"
            self.log(f"E srv    send_error: {msg}")
            await ex.respond(500, error_body(msg, "server_error", 500))
            return
        self.saved.append(filename)
        self.log(f"slot     save_slot: id {slot.id:2d} | saved {len(slot.cache)} tokens to {path}")
        ms = round((time.monotonic() - began) * 1000, 3)
        answer = {
            "id_slot": slot.id,
            "filename": filename,
            "n_saved": len(slot.cache),
            "n_written": len(data),
            "timings": {"save_ms": ms},
        }
        await ex.respond(200, orjson.dumps(answer))

    async def _restore(self, ex: FakeExchange, slot: Slot, filename: str, began: float) -> None:
        await asyncio.sleep(self.opts.slot_restore_seconds)
        path = Path(self.opts.slot_save_path or "", filename)
        try:
            data = await asyncio.to_thread(path.read_bytes)
            words = _cache_of(orjson.loads(data), self.opts.model_file)
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else str(exc)
            self.log(
                "E llama_state_seq_load_file: error loading sequence state file: "
                f"failed to open {path}: {reason}"
            )
            self.log(f"E srv    send_error: {RESTORE_FAILED}")
            await ex.respond(400, error_body(RESTORE_FAILED, "invalid_request_error", 400))
            return
        slot.cache = words
        self.restored.append(filename)
        self.log(f"slot  restore_slot: id {slot.id:2d} | restored {len(words)} tokens from {path}")
        ms = round((time.monotonic() - began) * 1000, 3)
        answer = {
            "id_slot": slot.id,
            "filename": filename,
            "n_restored": len(words),
            "n_read": len(data),
            "timings": {"restore_ms": ms},
        }
        await ex.respond(200, orjson.dumps(answer))


def _filename_problem(ex: FakeExchange) -> str | None:
    """What is wrong with a save/restore body `{"filename": NAME}`, in llama-server's words."""
    try:
        body = ex.json()
    except ValueError as exc:
        return f"[json.exception.parse_error.101] parse error: {exc}"
    if not isinstance(body, dict) or "filename" not in body:
        return "[json.exception.out_of_range.403] key 'filename' not found"
    name = body["filename"]
    if not isinstance(name, str):
        return f"[json.exception.type_error.302] type must be string, but is {type(name).__name__}"
    return None if valid_filename(name) else "Invalid filename"


def _cache_of(saved: Any, model: str) -> list[str]:
    """The words of a slot file this fake backend wrote for `model`; ValueError if not one."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError("not a slot save file")
    if saved.get("model") != model:
        raise ValueError(f"saved for model {saved.get('model')!r}, this is {model!r}")
    words = saved.get("tokens")
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise ValueError("no token list")
    return words
