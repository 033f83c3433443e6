"""Command-line flags of `corrallm fake-backend`, parsed into one frozen `Options`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Options:
    port: int
    host: str = "127.0.0.1"
    model_name: str = "fake"
    load_seconds: float = 0.0
    tokens: int = 16
    token_delay: float = 0.0
    latency: float = 0.0
    n_ctx: int = 4096
    n_slots: int = 1
    embedding_dim: int = 8
    fast: bool = False
    exit_after_seconds: float | None = None
    exit_code: int | None = None
    crash_after_tokens: int | None = None
    crash_mid_event: bool = False
    ignore_sigterm: bool = False
    sse_crlf: bool = False
    hang: bool = False
    stall_after_tokens: int | None = None
    die_mid_body: bool = False
    faulty_requests: int | None = None
    tool_calls: bool = False
    hold_mb: int = 0
    load_progress: float | None = None
    hang_after_ready: float | None = None
    die_after_ready: float | None = None
    sleep_mode: bool = False
    sleep_seconds: float = 0.0
    wake_seconds: float = 0.0
    wake_fails: bool = False
    asleep_mb: int = 0
    slot_save_path: str | None = None
    slot_save_seconds: float = 0.0
    slot_restore_seconds: float = 0.0

    @property
    def n_ctx_slot(self) -> int:
        return max(1, self.n_ctx // max(1, self.n_slots))

    @property
    def model_file(self) -> str:
        return f"{self.model_name}.gguf"


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _directory(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"not a directory: {text}")  # llama-server's words
    return text


EPILOG = """\
vLLM's sleep mode (--sleep-mode): POST /sleep?level=1|2 (200, empty body), POST /wake_up
(optional ?tags=weights&tags=kv_cache; 200, empty body), GET /is_sleeping ->
{"is_sleeping": bool}. A real vLLM exposes them only when started with
--enable-sleep-mode AND the environment variable VLLM_SERVER_DEV_MODE=1 (they are
development endpoints; without that variable they answer 404). Sleep mode came in vLLM
v0.7.0 (LLM.sleep/LLM.wake_up, Python only); the HTTP endpoints came after it (Feb 2025,
vllm-project/vllm#12987), `tags` on /wake_up with #15500 (Mar 2025), `mode` on /sleep
later; newer vLLM keeps them in vllm/entrypoints/serve/sleep/api_router.py, still behind
VLLM_SERVER_DEV_MODE. The fake accepts `mode` and ignores it.
While asleep every inference route answers 503 {"error": {"message": "model is sleeping;
POST /wake_up first", "type": "unavailable"}}; /health, /v1/models and /props still answer.

llama-server's slots: GET /slots (one object per slot: id, n_ctx, speculative,
is_processing, and once it ran a task id_task, n_prompt_tokens, n_prompt_tokens_processed,
n_prompt_tokens_cache, next_token). With --slot-save-path DIR: POST /slots/{id}?action=save
or ?action=restore with {"filename": NAME} (a bare name inside DIR), and ?action=erase;
without it they answer 501 not_supported_error, as llama-server does.

/debug/stats adds: sleeping, sleep_level, sleeps, wakes, wake_failures, held_mb,
slot_saves, slot_restores, slot_files_saved, slot_files_restored.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="corrallm fake-backend",
        description=(
            "A fake OpenAI-compatible backend that behaves like llama-server: health 503 while\n"
            "'loading', chat/completions/embeddings/rerank/audio, SSE streaming with usage,\n"
            "llama-server-like log lines, llama-server's slot save/restore and (with\n"
            "--sleep-mode) vLLM's sleep mode. Used by the demo config, the tests and the\n"
            "benchmarks."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    seconds, count = _seconds, _count
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--model-name", default="fake", help="model id reported by /v1/models")
    p.add_argument(
        "--load-seconds",
        type=seconds,
        default=0.0,
        help="answer 503 'Loading model' for this long after start (port is bound at once)",
    )
    p.add_argument("--tokens", type=count, default=16, help="completion tokens per request")
    p.add_argument("--token-delay", type=seconds, default=0.0, help="seconds between tokens")
    p.add_argument("--latency", type=seconds, default=0.0, help="seconds before the first byte")
    p.add_argument("--n-ctx", type=count, default=4096, help="context size printed and in /props")
    p.add_argument("--n-slots", type=count, default=1, help="slots printed and in /props")
    p.add_argument("--embedding-dim", type=count, default=8, help="length of embedding vectors")
    p.add_argument(
        "--fast",
        action="store_true",
        help="benchmark mode: cached response bytes, no per-request log or debug record",
    )
    p.add_argument(
        "--exit-after-seconds",
        type=seconds,
        default=None,
        help="print a load error and exit (code 3, or --exit-code) after this long; 0 = at once",
    )
    p.add_argument("--exit-code", type=int, default=None, help="exit code for --exit-after-seconds")
    p.add_argument(
        "--crash-after-tokens",
        type=count,
        default=None,
        help="in a stream, kill the process (exit 1) after sending this many token chunks",
    )
    p.add_argument(
        "--crash-mid-event",
        action="store_true",
        help="with --crash-after-tokens, send the first half of the next event before exiting",
    )
    p.add_argument("--ignore-sigterm", action="store_true", help="ignore SIGTERM (needs SIGKILL)")
    p.add_argument(
        "--sse-crlf",
        action="store_true",
        help="frame stream events with CRLF line ends (sse-starlette's default), not LF",
    )
    p.add_argument(
        "--hang",
        action="store_true",
        help="accept inference requests and never answer them (until the client leaves)",
    )
    p.add_argument(
        "--stall-after-tokens",
        type=count,
        default=None,
        help="in a stream, go silent after this many token chunks, the connection left open",
    )
    p.add_argument(
        "--die-mid-body",
        action="store_true",
        help="for a non-streamed completion, send the headers and half the body, then exit 1",
    )
    p.add_argument(
        "--faulty-requests",
        type=count,
        default=None,
        help="apply --hang / --stall-after-tokens / --die-mid-body to only the first N "
        "inference requests (default: all)",
    )
    p.add_argument(
        "--tool-calls",
        action="store_true",
        help="a chat request with `tools` whose last message is the user's is answered with "
        "a call of its first tool (or the one tool_choice names), streamed or not",
    )
    p.add_argument(
        "--hold-mb",
        type=count,
        metavar="MIB",
        default=0,
        help="once loaded, allocate and touch this many MiB and hold them for the process's "
        "life (its RSS grows by about that much), like a model's weights",
    )
    p.add_argument(
        "--load-progress",
        type=_positive_seconds,
        metavar="SECONDS",
        default=None,
        help="while loading (--load-seconds), print a progress line every SECONDS; without "
        "it a load prints nothing between the banner and 'model loaded'",
    )
    p.add_argument(
        "--hang-after-ready",
        type=seconds,
        metavar="SECONDS",
        default=None,
        help="after being healthy for SECONDS, hang: the event loop blocks, so /health and "
        "inference (in flight or new) get no answer and SIGTERM is not handled; the process "
        "stays alive until SIGKILL",
    )
    p.add_argument(
        "--die-after-ready",
        type=seconds,
        metavar="SECONDS",
        default=None,
        help="after being healthy for SECONDS, print an error and exit with code 1",
    )
    _sleep_flags(p)
    _slot_flags(p)
    return p


def _sleep_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sleep-mode",
        action="store_true",
        help="expose vLLM's sleep-mode endpoints POST /sleep?level=N, POST /wake_up, GET "
        "/is_sleeping (see below); without it they answer 404, as on a vLLM started without "
        "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1",
    )
    p.add_argument(
        "--sleep-seconds",
        type=_seconds,
        metavar="SECONDS",
        default=0.0,
        help="how long POST /sleep takes before it answers (inference is refused from its "
        "start; default 0)",
    )
    p.add_argument(
        "--wake-seconds",
        type=_seconds,
        metavar="SECONDS",
        default=0.0,
        help="how long POST /wake_up takes before it answers (default 0)",
    )
    p.add_argument(
        "--wake-fails",
        action="store_true",
        help="every POST /wake_up answers 500 with a JSON error (after --wake-seconds) and the "
        "backend stays asleep",
    )
    p.add_argument(
        "--asleep-mb",
        type=_count,
        metavar="MIB",
        default=0,
        help="what is left of --hold-mb while asleep: a sleep frees the held memory down to "
        "this many MiB (default 0) and a wake allocates and touches it again",
    )


def _slot_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slot-save-path",
        type=_directory,
        metavar="DIR",
        default=None,
        help="enable llama-server's POST /slots/{id}?action=save|restore|erase, writing and "
        "reading slot caches as DIR/<filename> (an existing directory, as llama-server "
        "requires); without it those answer 501",
    )
    p.add_argument(
        "--slot-save-seconds",
        type=_seconds,
        metavar="SECONDS",
        default=0.0,
        help="how long a slot save takes before it writes the file and answers (default 0)",
    )
    p.add_argument(
        "--slot-restore-seconds",
        type=_seconds,
        metavar="SECONDS",
        default=0.0,
        help="how long a slot restore takes before it reads the file and answers (default 0)",
    )


def parse_options(argv: list[str]) -> Options:
    ns = build_parser().parse_args(argv)
    return Options(**vars(ns))
