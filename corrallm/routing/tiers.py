"""Which backends of a served model a caller may use, in which order (SPEC §8 F1, F2). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from corrallm.config.schema import BackendConfig, PriorityGroup


def tiers(backends: Sequence[BackendConfig]) -> list[list[int]]:
    """Consecutive backends of the same `type` and `quality` form a tier (indices)."""
    out: list[list[int]] = []
    for i, backend in enumerate(backends):
        if out and _tier_key(backends[out[-1][0]]) == _tier_key(backend):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def may_serve(backend: BackendConfig, primary_quality: int, group: PriorityGroup | None) -> bool:
    """F2: a lower-quality backend serves a group only if it accepts degrade above its floor."""
    if backend.quality >= primary_quality:
        return True
    if group is None or not group.accept_degrade:
        return False
    return group.quality_floor is None or backend.quality >= group.quality_floor


def _tier_key(backend: BackendConfig) -> tuple[str, int]:
    return backend.type, backend.quality
