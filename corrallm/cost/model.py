"""Everything resolves to dollars (SPEC §9 C1). Pure arithmetic over the config.

- Local energy: `prompt_tokens x processWattsPerToken + completion_tokens x
  generateWattsPerToken` Wh (audio classes: bytes in x processWattsPerByte + bytes out x
  generateWattsPerByte), times `costPerKwh` / 1000.
- Paid: tokens x `pricing` per million x `costFactor` (a backend with `pricing`, or of a
  `paid` class); no local energy.
- Loading: measured load seconds x `swap.loadWatts` / 3600 Wh, at `costPerKwh`.
- Leases (SPEC §22 T5): slot-seconds held x `pricing.perSlotHour` / 3600 x `costFactor`
  (paid), else x the cost class's `slotWatts` / 3600 Wh, at `costPerKwh`.
"""

from __future__ import annotations

from dataclasses import dataclass

from corrallm.config.schema import BackendConfig, CommandCost, Config, ProcessSpec

# When a request names no token limit, its completion is estimated at this many tokens
# for the spend-limit and tpm reservations (replaced by the real count once known).
DEFAULT_COMPLETION_ESTIMATE = 256
BYTES_PER_TOKEN = 4  # the usual rule of thumb for estimating tokens from text


@dataclass(frozen=True)
class Metered:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    estimated: bool = False  # the backend reported no usage: counts are estimates

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Price:
    energy_wh: float = 0.0
    cost_usd: float = 0.0


FREE = Price()  # what most requests cost: one, shared (a Price is never changed)


def guess(body_bytes: int, max_tokens: int | None) -> Metered:
    """What a request not yet served is likely to use: its body's tokens by the rule of
    thumb, and the completion tokens it asks for (else DEFAULT_COMPLETION_ESTIMATE)."""
    return Metered(
        prompt_tokens=body_bytes // BYTES_PER_TOKEN,
        completion_tokens=max_tokens or DEFAULT_COMPLETION_ESTIMATE,
        bytes_in=body_bytes,
    )


class CostModel:
    def __init__(self, config: Config) -> None:
        self._classes = config.command_costs
        self._per_kwh = config.cost_per_kwh
        # Backend types whose usage is metered in bytes, not tokens (asked per request).
        self._audio = frozenset(t for t, c in self._classes.items() if c.modality == "audio")

    def cost_class(self, backend: BackendConfig) -> CommandCost | None:
        return self._classes.get(backend.type)

    def paid(self, backend: BackendConfig) -> bool:
        cls = self.cost_class(backend)
        return backend.pricing is not None or (cls is not None and cls.paid)

    def audio(self, backend: BackendConfig) -> bool:
        return backend.type in self._audio

    def request(self, backend: BackendConfig, m: Metered) -> Price:
        if self.paid(backend):
            pricing = backend.pricing
            if pricing is None:
                return FREE
            usd = (
                m.prompt_tokens * pricing.input_per_million
                + m.completion_tokens * pricing.output_per_million
            ) / 1_000_000
            return Price(0.0, usd * backend.cost_factor)
        cls = self.cost_class(backend)
        if cls is None:
            return FREE
        if cls.modality == "audio":
            wh = m.bytes_in * cls.process_watts_per_byte + m.bytes_out * cls.generate_watts_per_byte
        else:
            wh = (
                m.prompt_tokens * cls.process_watts_per_token
                + m.completion_tokens * cls.generate_watts_per_token
            )
        return self._energy(wh)

    def lease(self, backend: BackendConfig, slot_seconds: float) -> Price:
        """What holding slots of `backend` in a /v1/reservations lease costs."""
        hours = slot_seconds / 3600
        if self.paid(backend):
            pricing = backend.pricing
            per_hour = pricing.per_slot_hour if pricing is not None else 0.0
            return Price(0.0, hours * per_hour * backend.cost_factor) if per_hour else FREE
        cls = self.cost_class(backend)
        if cls is None or not cls.slot_watts:
            return FREE
        return self._energy(hours * cls.slot_watts)

    def load(self, spec: ProcessSpec, seconds: float) -> Price:
        return self._energy(seconds * spec.swap.load_watts / 3600)

    def estimate(self, backend: BackendConfig, body_bytes: int, max_tokens: int | None) -> float:
        """Dollars a request is likely to cost, reserved against its lane's spend limit."""
        return self.request(backend, guess(body_bytes, max_tokens)).cost_usd

    def estimate_tokens(
        self, backend: BackendConfig, body_bytes: int, max_tokens: int | None
    ) -> int:
        """Tokens a request is likely to use, reserved against its key's tpm (SPEC §22 T3):
        the same guess as for its cost. An audio upload's bytes are not tokens (its usage
        is metered in bytes), so it reserves none."""
        if self.audio(backend):
            return 0
        # guess(...).tokens without its Metered (this runs once per limited request)
        return body_bytes // BYTES_PER_TOKEN + (max_tokens or DEFAULT_COMPLETION_ESTIMATE)

    def _energy(self, wh: float) -> Price:
        return Price(wh, wh * self._per_kwh / 1000)
