"""A served model's request filters (SPEC §16 K5), made once per config from its `filters`
and its aliases' own `setParams`, and applied to each request after routing, before
forwarding (by `proxy/dialects/openai.py`'s `upstream_body`, which every dialect's codec calls
for its upstream payload).

The order, for a request that named the model by `requested`:
    stripParams (removed) -> defaultParams (filled in where absent or null)
      -> setParams (forced) -> the alias's setParams (forced, when `requested` is one)
`model` and `stream` are never touched: the config refuses a filter that names them
(config/validation.py), and `apply` skips them all the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from corrallm.config.schema import ModelConfig

# corrallm routes by `model` (and renames it per backend) and reads `stream` itself.
UNTOUCHABLE = frozenset({"model", "stream"})

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RequestFilters:
    strip: tuple[str, ...] = ()
    default: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    forced: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    by_alias: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: _EMPTY)

    def __bool__(self) -> bool:
        return bool(self.strip or self.default or self.forced or self.by_alias)

    def apply(self, payload: dict[str, Any], requested: object) -> bool:
        """Filter `payload` in place for a request that named `requested`; True if it
        changed."""
        changed = False
        for name in self.strip:
            if name in payload:
                del payload[name]
                changed = True
        for name, value in self.default.items():
            if payload.get(name) is None:
                payload[name] = value
                changed = True
        alias = self.by_alias.get(requested) if isinstance(requested, str) else None
        for params in (self.forced, alias or _EMPTY):
            for name, value in params.items():
                if name not in payload or payload[name] != value:
                    payload[name] = value
                    changed = True
        return changed


NO_FILTERS = RequestFilters()


def _params(params: Mapping[str, Any]) -> Mapping[str, Any]:
    kept = {k: v for k, v in params.items() if k not in UNTOUCHABLE}
    return MappingProxyType(kept) if kept else _EMPTY


def filters_of(model: ModelConfig) -> RequestFilters:
    """The filters of `model`, with the table alias -> its own setParams."""
    spec = model.filters
    by_alias = {a.name: _params(a.set_params) for a in model.alias_specs if a.set_params}
    compiled = RequestFilters(
        tuple(name for name in spec.strip_params if name not in UNTOUCHABLE),
        _params(spec.default_params),
        _params(spec.set_params),
        MappingProxyType(by_alias) if by_alias else _EMPTY,
    )
    return compiled if compiled else NO_FILTERS
