"""The captures' ring buffer (SPEC §21 O2): kept records, bounded in bytes, oldest out first.

Pure: no clock, no I/O. A record's size is counted once, when it is added, from what it
really holds (the strings' and dicts' own sizes, `sys.getsizeof`) plus an allowance for the
record object and its slot in the ring, so the bound is on memory, not on a count.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

# The record object, its slot in the OrderedDict (hash entry and list links), the ints,
# floats and bools it holds: more than they take (tests/unit/test_captures.py measures it).
ENTRY_OVERHEAD = 640


@dataclass(frozen=True, slots=True)
class Record:
    """One kept exchange, its secrets already redacted and its bodies already text."""

    request_id: str
    t: float  # unix seconds: when the request arrived
    model: str | None
    backend: str | None
    key: str | None  # the key as the activity shows it (SPEC §14), never a request header
    group: str | None
    endpoint: str
    status: int
    error: str | None
    request: str
    response: str
    request_encoding: str  # "utf-8" or "base64"
    response_encoding: str
    request_headers: dict[str, str]
    response_headers: dict[str, str]
    request_truncated: bool
    response_truncated: bool
    request_bytes: int  # the whole body's size, as received (not what is kept)
    response_bytes: int  # the whole body's size, as sent
    user: str | None = None  # the user behind the key (SPEC §22 T4), as the activity shows it
    size: int = field(default=0, compare=False)  # bytes it holds, counted by `footprint`


def footprint(record: Record) -> int:
    """Bytes `record` holds: every string and dict it refers to, and the overhead."""
    size = ENTRY_OVERHEAD
    for text in (
        record.request_id,
        record.model,
        record.backend,
        record.key,
        record.user,
        record.group,
        record.endpoint,
        record.error,
        record.request,
        record.response,
        record.request_encoding,
        record.response_encoding,
    ):
        if text is not None:
            size += sys.getsizeof(text)
    for headers in (record.request_headers, record.response_headers):
        size += sys.getsizeof(headers)
        for name, value in headers.items():
            size += sys.getsizeof(name) + sys.getsizeof(value)
    return size


class Ring:
    """Records by request id, oldest first; their sizes never sum above `bound` bytes."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.used = 0
        self._records: OrderedDict[str, Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: Record) -> bool:
        """Keep `record` (its `size` counted now), evicting the oldest until it fits.
        False, and nothing evicted, when it alone is over the bound."""
        size = footprint(record)
        if size > self.bound:
            return False
        old = self._records.pop(record.request_id, None)
        if old is not None:
            self.used -= old.size
        while self.used + size > self.bound:
            _, evicted = self._records.popitem(last=False)
            self.used -= evicted.size
        object.__setattr__(record, "size", size)  # frozen to everyone else
        self._records[record.request_id] = record
        self.used += size
        return True

    def resize(self, bound: int) -> None:
        """A new bound; a smaller one evicts the oldest at once until the rest fits."""
        self.bound = bound
        while self.used > bound:
            _, evicted = self._records.popitem(last=False)
            self.used -= evicted.size

    def get(self, request_id: str) -> Record | None:
        return self._records.get(request_id)

    def newest(self) -> Iterator[Record]:
        """Newest first. A snapshot: adding while iterating is safe."""
        return reversed(list(self._records.values()))
