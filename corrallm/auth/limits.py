"""Per-key rate limits (SPEC §22 T3): requests per minute, tokens per minute and requests
held at once, for a key and for each user behind it (T4 `limits.perUser`). Pure: the
clock is passed in, nothing here waits, logs or touches a store.

What is counted is a *subject*: `key:<name>`, or `key:<name>/user:<user>`. Its window
holds
- the times of the requests admitted in the last 60 s (rpm; those within 10 ms of each
  other as one entry, counted until the latest of them leaves),
- the tokens of the requests settled in the last 60 s, each at the time it settled, plus
  the estimates of the requests admitted and not settled yet (tpm): a request reserves
  its estimate when admitted, as for spend limits, and its metered usage replaces it,
- how many requests it holds now, queued or running (concurrent).

A request asks every subject it belongs to at once (`Ask`s): it is admitted only if each
has room, and then counted in each. The rules are checked in one order: an estimate that
alone exceeds a tpm limit (waiting cannot help), then concurrent, rpm, tpm.

The limits themselves are not kept here: each request brings its key's limits in force
(a reload or a key changed at runtime applies from the next request), and a window is
dropped once nothing in it counts any more, so idle keys and users cost nothing.

Gateways sharing a PostgreSQL store count rpm and tpm in the database (store/rates.py,
through auth/throttle.py) with the same rules (`breach`) and the same Retry-After
(`rpm_retry`, `tpm_retry`); the windows here then count this gateway's own requests,
its concurrency and its fallback while the database cannot be reached.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from corrallm.config.schema import RateLimits

WINDOW = 60.0  # seconds: what "per minute" means
CONCURRENT_RETRY = 1.0  # a held request may end any moment: ask again after this long

Rule = Literal["rpm", "tpm", "concurrent"]

# OpenAI's names for what a limited key has left (on every answer to it)
LIMIT_REQUESTS = b"x-ratelimit-limit-requests"
REMAINING_REQUESTS = b"x-ratelimit-remaining-requests"
LIMIT_TOKENS = b"x-ratelimit-limit-tokens"
REMAINING_TOKENS = b"x-ratelimit-remaining-tokens"


# A limit that is not set, as a cap no count reaches: the hot path compares, never asks
# whether a limit is there.
UNLIMITED = 1 << 62


@dataclass(frozen=True, slots=True)
class Ask:
    """One subject a request is counted in, with the limits in force for it, and what the
    hot path needs of them made once (a key's asks live as long as its config)."""

    subject: str
    limits: RateLimits
    rpm: int = field(init=False, compare=False, repr=False)  # UNLIMITED when not set
    tpm: int = field(init=False, compare=False, repr=False)
    concurrent: int = field(init=False, compare=False, repr=False)
    alone: tuple[str, ...] = field(init=False, compare=False, repr=False)  # (subject,)
    # (LIMIT_REQUESTS, rpm) and (LIMIT_TOKENS, tpm), None when not set
    limit_requests: tuple[bytes, bytes] | None = field(init=False, compare=False, repr=False)
    limit_tokens: tuple[bytes, bytes] | None = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        rpm, tpm, concurrent = self.limits.rpm, self.limits.tpm, self.limits.concurrent
        made = object.__setattr__
        made(self, "rpm", UNLIMITED if rpm is None else rpm)
        made(self, "tpm", UNLIMITED if tpm is None else tpm)
        made(self, "concurrent", UNLIMITED if concurrent is None else concurrent)
        made(self, "alone", (self.subject,))
        made(self, "limit_requests", None if rpm is None else (LIMIT_REQUESTS, b"%d" % rpm))
        made(self, "limit_tokens", None if tpm is None else (LIMIT_TOKENS, b"%d" % tpm))


@dataclass(frozen=True, slots=True)
class LimitRefusal:
    rule: Rule
    subject: str
    limit: int
    used: int  # what counted against the limit: requests in the window, tokens, or held
    estimate: int  # the request's estimated tokens
    retry_after: float | None  # seconds; None: the estimate alone exceeds the limit


# Made once or twice per request of a key with limits: plain slotted classes (a frozen
# dataclass pays an object.__setattr__ per field, measurable on the hot path).
@dataclass(slots=True)
class Remaining:
    """What the tightest subject has left (the x-ratelimit-* headers); None: no such limit."""

    limit_requests: int | None = None
    requests: int | None = None
    limit_tokens: int | None = None
    tokens: int | None = None

    def headers(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's header names, for the limits there are."""
        out: list[tuple[bytes, bytes]] = []
        if self.limit_requests is not None and self.requests is not None:
            out += (
                (LIMIT_REQUESTS, b"%d" % self.limit_requests),
                (REMAINING_REQUESTS, b"%d" % self.requests),
            )
        if self.limit_tokens is not None and self.tokens is not None:
            out += (
                (LIMIT_TOKENS, b"%d" % self.limit_tokens),
                (REMAINING_TOKENS, b"%d" % self.tokens),
            )
        return out


@dataclass(slots=True)
class Hold:
    """An admitted request's place in its subjects' windows, until released: what it
    reserved, what was left after it (its x-ratelimit-* headers), and its rows in a
    shared store (none when counted in memory)."""

    subjects: tuple[str, ...]
    tokens: int  # the estimate it reserved
    at: float  # when it was admitted
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # `Remaining.headers`
    rows: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class Counts:
    """One subject's counts before a request: requests in the window, tokens used in it
    plus reserved, requests held."""

    requests: int = 0
    tokens: int = 0
    held: int = 0


def limited(limits: RateLimits | None) -> bool:
    return limits is not None and (
        limits.rpm is not None or limits.tpm is not None or limits.concurrent is not None
    )


def breach(
    limits: RateLimits, counts: Counts, estimate: int, rates: bool = True
) -> tuple[Rule, int, int] | None:
    """The first rule one more request of `estimate` tokens would break, with its limit
    and what already counts against it; None if it fits. `rates=False`: concurrency only
    (the rates are counted elsewhere, in a shared store)."""
    if limits.tpm is not None and estimate > limits.tpm:
        return "tpm", limits.tpm, counts.tokens
    if limits.concurrent is not None and counts.held >= limits.concurrent:
        return "concurrent", limits.concurrent, counts.held
    if not rates:
        return None
    if limits.rpm is not None and counts.requests >= limits.rpm:
        return "rpm", limits.rpm, counts.requests
    if limits.tpm is not None and counts.tokens + estimate > limits.tpm:
        return "tpm", limits.tpm, counts.tokens
    return None


def rpm_retry(times: Sequence[float], limit: int, now: float) -> float:
    """Seconds until one more request fits in a window holding requests admitted at
    `times` (oldest first): until all but `limit - 1` of them have left it. At least 1."""
    leaving = len(times) - limit  # this one leaves, and every one before it
    if leaving < 0:
        return CONCURRENT_RETRY
    return max(1.0, times[leaving] + WINDOW - now)


def tpm_retry(spent: Iterable[tuple[float, int]], over: int, now: float) -> float:
    """Seconds until `over` tokens of `spent` ((settled at, tokens), oldest first) have left
    the window; a whole window when they would not be enough (the rest is reserved by
    requests still running, whose usage then counts for a minute)."""
    freed = 0
    for t, tokens in spent:
        freed += tokens
        if freed >= over:
            return max(1.0, t + WINDOW - now)
    return WINDOW


def tightest(limits: Sequence[tuple[RateLimits, Counts]]) -> Remaining:
    """What is left, per kind, in the subject that has least of it (counts taken after
    the request, when it was admitted)."""
    requests: tuple[int, int] | None = None  # (remaining, limit)
    tokens: tuple[int, int] | None = None
    for rules, counts in limits:
        if rules.rpm is not None:
            left = (max(0, rules.rpm - counts.requests), rules.rpm)
            requests = left if requests is None or left < requests else requests
        if rules.tpm is not None:
            left = (max(0, rules.tpm - counts.tokens), rules.tpm)
            tokens = left if tokens is None or left < tokens else tokens
    return Remaining(
        requests[1] if requests else None,
        requests[0] if requests else None,
        tokens[1] if tokens else None,
        tokens[0] if tokens else None,
    )


# Requests (and settled tokens) within GRAIN seconds of an entry's first share that entry,
# stamped with its latest: each counts a little longer than it would alone (at most
# GRAIN), never less, and a key at thousands of requests a second keeps a few thousand
# entries a minute, not an object per request kept for 60 s (about 35 MB a key at 5,000
# requests a second).
GRAIN = 0.01
INF = float("inf")


@dataclass(slots=True)
class Window:
    """One subject's counts over the last 60 s."""

    # [first, latest, how many], oldest first: the requests admitted (rpm)
    requests: deque[list[float]] = field(default_factory=deque)
    admitted: int = 0  # the requests in `requests`
    # [first, latest, tokens], oldest first: the tokens of requests settled (tpm)
    spent: deque[list[float]] = field(default_factory=deque)
    used: int = 0  # the tokens in `spent`
    reserved: int = 0  # estimates of the requests not settled yet
    held: int = 0
    # Nothing leaves the window before this time: until then `expire` is one comparison
    # (it is asked on every request of the key).
    due: float = INF

    def admit(self, now: float) -> None:
        self.admitted += 1
        self.add(self.requests, now, 1)

    def add(self, entries: deque[list[float]], now: float, n: int) -> None:
        """`n` requests (or tokens) into `requests` (or `spent`), at `now`."""
        if entries:
            last = entries[-1]
            if now - last[0] < GRAIN:
                if now > last[1]:
                    last[1] = now
                last[2] += n
                return
        elif now + WINDOW < self.due:  # the oldest entry now: it leaves first
            self.due = now + WINDOW
        entries.append([now, now, n])

    def expire(self, now: float) -> None:
        if now < self.due:
            return
        edge = now - WINDOW
        requests, spent = self.requests, self.spent
        while requests and requests[0][1] <= edge:
            self.admitted -= int(requests.popleft()[2])
        while spent and spent[0][1] <= edge:
            self.used -= int(spent.popleft()[2])
        self.due = min(requests[0][1] if requests else INF, spent[0][1] if spent else INF) + WINDOW

    def counts(self) -> Counts:
        return Counts(self.admitted, self.used + self.reserved, self.held)

    def rpm_retry(self, limit: int, now: float) -> float:
        """`rpm_retry` over the entries (an entry's requests all admitted at its latest)."""
        leaving = self.admitted - limit  # this one leaves, and every one before it
        if leaving < 0:
            return CONCURRENT_RETRY
        for entry in self.requests:
            leaving -= int(entry[2])
            if leaving < 0:
                return max(1.0, entry[1] + WINDOW - now)
        return WINDOW

    def take_back(self, at: float) -> None:
        """The request admitted at `at` no longer counts (if it still did)."""
        for entry in reversed(self.requests):
            if entry[0] <= at <= entry[1]:
                entry[2] -= 1
                self.admitted -= 1
                if entry[2] <= 0:
                    self.requests.remove(entry)
                return

    @property
    def idle(self) -> bool:
        return not (self.requests or self.spent or self.reserved or self.held)


class Limiter:
    """Every subject's window."""

    def __init__(self) -> None:
        self._windows: dict[str, Window] = {}

    def __len__(self) -> int:
        return len(self._windows)

    def counts(self, subject: str, now: float) -> Counts:
        window = self._windows.get(subject)
        if window is None:
            return Counts()
        window.expire(now)
        if window.idle:
            del self._windows[subject]
        return window.counts()

    def judge(
        self, asks: Sequence[Ask], estimate: int, now: float, rates: bool = True
    ) -> LimitRefusal | None:
        """Whether a request of `estimate` tokens fits every subject it asks; nothing is
        counted (`take` does). `rates=False`: concurrency (and a hopeless estimate) only."""
        for ask in asks:
            counts = self.counts(ask.subject, now)
            broken = breach(ask.limits, counts, estimate, rates)
            if broken is not None:
                rule, limit, used = broken
                return LimitRefusal(
                    rule,
                    ask.subject,
                    limit,
                    used,
                    estimate,
                    self._retry(ask, rule, limit, estimate, now),
                )
        return None

    def take(self, asks: Sequence[Ask], estimate: int, now: float) -> Hold:
        """Count the request in every subject it asks (whether or not it fits)."""
        for ask in asks:
            window = self._windows.get(ask.subject)
            if window is None:
                window = self._windows[ask.subject] = Window()
            window.admit(now)
            window.reserved += estimate
            window.held += 1
        return Hold(tuple([a.subject for a in asks]), estimate, now)

    def admit(self, asks: Sequence[Ask], estimate: int, now: float) -> Hold | LimitRefusal:
        refused = self.judge(asks, estimate, now)
        return refused if refused is not None else self.take(asks, estimate, now)

    def counted(self, asks: Sequence[Ask], estimate: int, now: float) -> Hold | LimitRefusal:
        """`admit`, with what is left after it (`remaining`) on the hold, in one pass over
        the windows: the hot path of a key with limits (the same rules as `breach`; a
        refusal is judged by `judge`). Most requests ask one subject, their key: that
        case takes no list and no loop, and compares with the caps and header halves its
        `Ask` made once."""
        if len(asks) != 1:
            return self._counted(asks, estimate, now)
        ask = asks[0]
        window = self._windows.get(ask.subject)
        if window is None:
            window = Window()
        elif now >= window.due:
            window.expire(now)
        tokens = window.used + window.reserved + estimate
        admitted = window.admitted
        if tokens > ask.tpm or admitted >= ask.rpm or window.held >= ask.concurrent:
            return self._refused(asks, estimate, now)
        self._windows[ask.subject] = window
        window.admitted = admitted = admitted + 1
        window.reserved += estimate
        window.held += 1
        window.add(window.requests, now, 1)
        headers: list[tuple[bytes, bytes]] = []  # Remaining(...).headers(), an object less
        if ask.limit_requests is not None:
            headers += (ask.limit_requests, (REMAINING_REQUESTS, b"%d" % (ask.rpm - admitted)))
        if ask.limit_tokens is not None:
            headers += (ask.limit_tokens, (REMAINING_TOKENS, b"%d" % (ask.tpm - tokens)))
        return Hold(ask.alone, estimate, now, headers)

    def _counted(self, asks: Sequence[Ask], estimate: int, now: float) -> Hold | LimitRefusal:
        """`counted` for a request counted in several subjects (a key and its user)."""
        windows = []
        for ask in asks:
            window = self._windows.get(ask.subject)
            if window is None:
                window = Window()
            else:
                window.expire(now)
            wanted = window.used + window.reserved + estimate
            if wanted > ask.tpm or window.admitted >= ask.rpm or window.held >= ask.concurrent:
                return self._refused(asks, estimate, now)
            windows.append(window)
        requests: tuple[int, int] | None = None  # (left, limit) in the tightest subject
        tokens: tuple[int, int] | None = None
        for ask, window in zip(asks, windows, strict=True):
            self._windows[ask.subject] = window
            window.admit(now)
            window.reserved += estimate
            window.held += 1
            limits = ask.limits
            if limits.rpm is not None:
                left = (max(0, limits.rpm - window.admitted), limits.rpm)
                requests = left if requests is None or left < requests else requests
            if limits.tpm is not None:
                left = (max(0, limits.tpm - window.used - window.reserved), limits.tpm)
                tokens = left if tokens is None or left < tokens else tokens
        remaining = Remaining(
            requests[1] if requests else None,
            requests[0] if requests else None,
            tokens[1] if tokens else None,
            tokens[0] if tokens else None,
        )
        return Hold(tuple([a.subject for a in asks]), estimate, now, remaining.headers())

    def _refused(self, asks: Sequence[Ask], estimate: int, now: float) -> LimitRefusal:
        refused = self.judge(asks, estimate, now)
        assert refused is not None, "the same rules as breach()"
        return refused

    def release(self, hold: Hold, used: int, now: float) -> None:
        """The request is over: its metered tokens replace its estimate, its place is free."""
        windows = self._windows
        for subject in hold.subjects:
            window = windows.get(subject)
            if window is None:
                continue
            window.held -= 1
            window.reserved -= hold.tokens
            if used > 0:
                window.used += used
                window.add(window.spent, now, used)
            if now >= window.due:
                window.expire(now)
            if not window.held and window.idle:
                del windows[subject]

    def _held(self, hold: Hold) -> Iterator[tuple[str, Window]]:
        """Each window `hold` is in, its place and its estimate given back."""
        for subject in hold.subjects:
            window = self._windows.get(subject)
            if window is None:
                continue
            window.held = max(0, window.held - 1)
            window.reserved = max(0, window.reserved - hold.tokens)
            yield subject, window

    def cancel(self, hold: Hold, now: float) -> None:
        """Undo `take`: the request was not admitted after all (a shared store refused it)."""
        for subject, window in self._held(hold):
            window.take_back(hold.at)
            self._tidy(subject, window, now)

    def remaining(self, asks: Sequence[Ask], now: float) -> Remaining:
        return tightest([(a.limits, self.counts(a.subject, now)) for a in asks])

    def sweep(self, now: float) -> None:
        """Drop every window nothing counts in any more (subjects that stopped asking)."""
        for subject, window in list(self._windows.items()):
            self._tidy(subject, window, now)

    def _tidy(self, subject: str, window: Window, now: float) -> None:
        window.expire(now)
        if window.idle:
            self._windows.pop(subject, None)

    def _retry(self, ask: Ask, rule: Rule, limit: int, estimate: int, now: float) -> float | None:
        window = self._windows.get(ask.subject)
        if rule == "concurrent":
            return CONCURRENT_RETRY
        if rule == "rpm":
            return window.rpm_retry(limit, now) if window else CONCURRENT_RETRY
        if estimate > limit:
            return None
        counts = window.counts() if window else Counts()
        spent = [(entry[1], int(entry[2])) for entry in window.spent] if window else []
        return tpm_retry(spent, counts.tokens + estimate - limit, now)
