"""What a GGUF file says about itself, read from its header only (tensor data is never read).

The layout (magic, version, counts, typed key/values, tensor infos) is GGUF v2/v3 as the
`gguf` package writes it; its tables give the value types and each tensor type's block
size and bytes per block. The header is walked here with `struct` rather than through
`gguf.GGUFReader` because the reader builds a numpy view per string: on a 256k-token
vocabulary it takes ~7 s, where skipping the strings takes ~0.1 s, and `corrallm check`
and config reloads read every model's header.
"""

from __future__ import annotations

import bisect
import functools
import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf

# Numeric arrays longer than this (token scores, token types) are kept as a count only:
# the estimate needs the per-layer arrays (tens to hundreds of entries), not the vocabulary's.
MAX_KEPT_ARRAY = 4096
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class GgufError(Exception):
    """The file is not a readable GGUF; the message names the file and the cause."""


@dataclass(frozen=True)
class Counted:
    """An array value kept as its length only (strings, or a long numeric array)."""

    count: int


Value = int | float | bool | str | tuple[int | float | bool, ...] | Counted


@dataclass(frozen=True)
class Tensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    n_bytes: int


@dataclass(frozen=True)
class Header:
    path: str
    metadata: Mapping[str, Value]
    tensors: tuple[Tensor, ...]

    def get(self, key: str) -> Value | None:
        return self.metadata.get(key)

    def integer(self, key: str) -> int | None:
        value = self.metadata.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        return value

    def text(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None

    def count(self, key: str) -> int:
        """Length of an array value (0 when absent or not an array)."""
        value = self.metadata.get(key)
        if isinstance(value, Counted):
            return value.count
        return len(value) if isinstance(value, tuple) else 0


@dataclass(frozen=True)
class Model:
    """A model's files: one GGUF, or every shard of a split one."""

    files: tuple[str, ...]  # absolute paths
    header: Header  # the first shard's (the metadata lives there)
    tensors: tuple[Tensor, ...]  # of every shard


_SHARD = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def load_model(name: str, base: Path, flag: str) -> Model:
    """The model a flag (`flag name`) names, relative to `base`; a split model's shards are
    found by llama.cpp's naming (PREFIX-0000N-of-0000M.gguf) from any one of them. Raises
    GgufError worded for the operator."""
    path = Path(name).expanduser()
    path = Path(os.path.abspath(path if path.is_absolute() else base / path))
    given = _checked(path, f"{flag} {name}")
    count = given.integer(gguf.Keys.Split.LLM_KV_SPLIT_COUNT) or 1
    match = _SHARD.match(str(path))
    if count <= 1 and match is None:
        return Model((str(path),), given, given.tensors)
    if match is None:
        raise GgufError(
            f"{path} is shard {given.integer(gguf.Keys.Split.LLM_KV_SPLIT_NO) or 0} of a "
            f"{count}-file split model but is not named PREFIX-0000N-of-{count:05d}.gguf"
        )
    count = int(match["count"])
    shards = [Path(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    headers = []
    for shard in shards:
        if not shard.is_file():
            raise GgufError(f"split model shard {shard} is missing (from {flag} {name})")
        headers.append(_checked(shard, f"{flag} {name}"))
    tensors = tuple(t for h in headers for t in h.tensors)
    return Model(tuple(str(s) for s in shards), headers[0], tensors)


def _checked(path: Path, source: str) -> Header:
    if not path.exists():
        raise GgufError(f"model file {path} does not exist (from {source})")
    try:
        return read_header(str(path))
    except OSError as exc:
        raise GgufError(f"cannot read {path}: {exc.strerror or exc}") from None


def read_header(path: str) -> Header:
    """The header of the GGUF at `path` (absolute); raises GgufError (or OSError)."""
    st = os.stat(path)
    return _read_cached(path, st.st_size, st.st_mtime_ns)


# A process-wide memo, not state: a header is a pure function of the file's bytes, which
# (path, size, mtime) stands for, so a config reload or `corrallm check` re-reads nothing
# unchanged. Bounded, so models removed from the config do not pin memory for long.
@functools.lru_cache(maxsize=64)
def _read_cached(path: str, size: int, mtime_ns: int) -> Header:
    del mtime_ns  # part of the cache key only
    if size < 24:
        raise GgufError(f"{path} is not a GGUF file (only {size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise GgufError(f"{path} is not a GGUF file (it starts with {bytes(buf[:4])!r})")
        try:
            return _parse(path, buf, size)
        except (struct.error, UnicodeDecodeError, IndexError, ValueError) as exc:
            raise GgufError(f"{path}: the GGUF header is truncated or corrupt ({exc})") from exc


class _Cursor:
    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf = buf
        self.pos = 0
        self.order = order
        self._structs: dict[str, struct.Struct] = {}

    def _struct(self, fmt: str) -> struct.Struct:
        s = self._structs.get(fmt)
        if s is None:
            s = self._structs[fmt] = struct.Struct(self.order + fmt)
        return s

    def scalar(self, fmt: str) -> int | float | bool:
        s = self._struct(fmt)
        (value,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return value  # type: ignore[no-any-return]

    def u32(self) -> int:
        return int(self.scalar("I"))

    def u64(self) -> int:
        return int(self.scalar("Q"))

    def string(self) -> str:
        n = self.u64()
        end = self.pos + n
        if end > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = self.buf[self.pos : end].decode("utf-8")
        self.pos = end
        return text

    def skip_strings(self, count: int) -> None:
        length = self._struct("Q")
        buf, pos = self.buf, self.pos
        for _ in range(count):
            pos += 8 + length.unpack_from(buf, pos)[0]
        if pos > len(buf):
            raise ValueError("a string array runs past the end of the file")
        self.pos = pos

    def value(self, vtype: int) -> Value:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype != _ARRAY:
            raise ValueError(f"unknown value type {vtype}")
        item, count = self.u32(), self.u64()
        if count > len(self.buf):
            raise ValueError(f"an array claims {count} items")
        if item == _STRING:
            self.skip_strings(count)
            return Counted(count)
        if item not in _SCALARS:
            raise ValueError(f"unsupported array item type {item}")
        s = self._struct(f"{count}{_SCALARS[item]}")
        start = self.pos
        self.pos += s.size
        if count > MAX_KEPT_ARRAY:
            return Counted(count)
        return tuple(s.unpack_from(self.buf, start))


def _parse(path: str, buf: mmap.mmap, size: int) -> Header:
    (version,) = struct.unpack_from("<I", buf, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written big-endian
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise GgufError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    cur = _Cursor(buf, order)
    cur.pos = 8
    n_tensors, n_kv = cur.u64(), cur.u64()
    if n_tensors > size or n_kv > size:
        raise ValueError(f"implausible counts ({n_tensors} tensors, {n_kv} keys)")
    metadata: dict[str, Value] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.u32())
    infos: list[tuple[str, int, tuple[int, ...], int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.u32()
        if n_dims > 8:
            raise ValueError(f"tensor {name} has {n_dims} dimensions")
        shape = tuple(cur.u64() for _ in range(n_dims))
        infos.append((name, cur.u32(), shape, cur.u64()))
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    align = alignment if isinstance(alignment, int) and alignment > 0 else 32
    data_start = -(-cur.pos // align) * align
    return Header(path, metadata, _tensors(infos, size - data_start))


def _tensors(
    infos: list[tuple[str, int, tuple[int, ...], int]], data_size: int
) -> tuple[Tensor, ...]:
    """Each tensor's bytes from its type's block size; for a type newer than the `gguf`
    package, from the distance to the next tensor's offset (alignment padding included)."""
    ends = sorted({offset for *_, offset in infos} | {data_size})
    out = []
    for name, ggml_type, shape, offset in infos:
        n_elements = 1
        for dim in shape:
            n_elements *= dim
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            n_bytes = -(-n_elements // block) * type_size
        except (ValueError, KeyError):
            n_bytes = ends[min(bisect.bisect_right(ends, offset), len(ends) - 1)] - offset
        out.append(Tensor(name, ggml_type, shape, max(n_bytes, 0)))
    return tuple(out)
