"""What each dashboard section shows, gathered from the one service layer (api/service.py,
api/usage.py), the economics ledger included: the service's typed views as they are, or
with what a section adds (shares, bar widths). Data for the templates; no HTML here."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

from pydantic import BaseModel

from corrallm.api import keys as api_keys
from corrallm.api import service, usage
from corrallm.config.schema import ANY_GPU
from corrallm.gateway import Gateway
from corrallm.proxy.dialects import audio

SECTIONS = (
    "overview",
    "requests",
    "residency",
    "lanes",
    "nodes",
    "usage",
    "activity",
    "logs",
    "economics",
    "playground",
    "keys",
    "definitions",
)
# The sections that read the store (the only ones that await): one answered means the
# store answers again after an outage (ui/app.py's Outage).
STORE_SECTIONS = frozenset({"activity", "usage"})
# Fragments the page fetches on demand and never renders on its own: one capture (O2),
# opened from its activity row.
FRAGMENTS = (*SECTIONS, "capture")
ACTIVITY_ROWS = 50  # the activity section's rows
# The playground's choices of `response_format`; diarized_json asks for speaker segments.
FORMATS = ("json", "verbose_json", "diarized_json", "text", "srt", "vtt")
# Usage ranges: (how far back, bucket length).
RANGES = {"hour": ("1h", "5m"), "day": ("24h", "1h"), "week": ("7d", "6h")}


async def section(name: str, gw: Gateway, params: dict[str, str]) -> dict[str, Any] | BaseModel:
    if name == "overview":
        return overview(gw)
    if name == "requests":
        return service.live_requests(gw)
    if name == "activity":
        return await activity(gw)
    if name == "capture":
        return capture(gw, params.get("id", ""))
    if name == "residency":
        return residency(gw)
    if name == "lanes":
        return lanes(gw)
    if name == "nodes":
        return nodes(gw)
    if name == "usage":
        return await usage_view(gw, params.get("range", "day"))
    if name == "logs":
        return logs(gw, params.get("model"))
    if name == "economics":
        return service.economics(gw)
    if name == "playground":
        return playground(gw)
    if name == "keys":
        return keys(gw)
    return definitions(gw)


def overview(gw: Gateway) -> dict[str, Any]:
    return {"models": service.overview(gw).models}


FOOTPRINTS = ("declared", "estimated", "measured")


def _in_pool(footprint: dict[str, int] | None, pool: str) -> int | None:
    """A footprint's bytes in `pool`; the placeholder `gpu` counts for whichever GPU."""
    if footprint is None:
        return None
    return footprint.get(pool, footprint.get(ANY_GPU) if pool.startswith("gpu") else None)


def residency(gw: Gateway) -> dict[str, Any]:
    pools = {s.name: s.pools for s in service.overview(gw).servers}
    servers = []
    for server in service.residency(gw).servers:
        rows = []
        for pool, p in pools.get(server.name, {}).items():
            capacity = max(p.capacity, 1)
            residents: list[dict[str, Any]] = [
                {
                    "backend": r.backend,
                    "state": r.state,
                    "pinned": r.pinned,
                    "planned": r.ram_usage.get(pool, 0),
                    # M2: where the planned number comes from (None: unknown)
                    **{kind: _in_pool(getattr(r, kind), pool) for kind in FOOTPRINTS},
                }
                for r in server.residents
                if r.ram_usage.get(pool)
            ]
            x = 0.0
            for r in residents:  # stacked: each segment's offset and width, as % of capacity
                r["x"] = x
                r["w"] = 100.0 * r["planned"] / capacity
                x += r["w"]
            measured = [r["measured"] for r in residents if r["measured"] is not None]
            rows.append(
                {
                    "pool": pool,
                    "capacity": p.capacity,
                    "reserve": p.reserve,
                    "reserve_w": 100.0 * p.reserve / capacity,
                    "used": p.used,
                    "measured": sum(measured) if measured else None,
                    "residents": residents,
                }
            )
        servers.append({"name": server.name, "pools": rows})
    return {"servers": servers}


def lanes(gw: Gateway) -> dict[str, Any]:
    rows = [lane.model_dump() for lane in service.lanes(gw).lanes]  # with what it adds
    total_weight = sum(r["weight"] for r in rows) or 1.0
    for r in rows:
        r["weight_share"] = r["weight"] / total_weight
        spec = gw.config.priority_groups.get(r["name"])
        limit = spec.spend_limit if spec else None
        r["spend_limit_usd"] = limit.usd if limit else None
        r["spend_window"] = limit.window if limit else None
    return {"lanes": rows, "reservations": service.reservations(gw).reservations}


def nodes(gw: Gateway) -> dict[str, Any]:
    """X6: each peer, up or down (with why), and its models with their state and their
    backend processes there (what the peer holds), as the peer last reported them."""
    return {"peers": service.overview(gw).peers, "peer_timeout": gw.config.peer_timeout}


async def usage_view(gw: Gateway, range_name: str) -> dict[str, Any]:
    if range_name not in RANGES:
        range_name = "day"
    since, bucket = RANGES[range_name]
    by_key = (await usage.usage_by_key(gw, since)).rows
    keys: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    lanes_: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in by_key:
        for target in (keys[row.key or "(no key)"], lanes_[row.group]):
            target["requests"] += row.requests
            target["cost_usd"] += row.cost_usd
            target["energy_wh"] += row.energy_wh
            target["dwell_ms"] += (row.dwell_ms_avg or 0) * row.requests
    series = await usage.usage_series(gw, since, None, bucket)
    depth = await usage.queue_depth(gw, since, None, bucket)
    peaks: dict[str, int] = defaultdict(int)
    for point in depth.points:
        peaks[point.t] = max(peaks[point.t], point.waiting)
    return {
        "range": range_name,
        "ranges": list(RANGES),
        "key_bars": _bars(keys),
        "lane_bars": _bars(lanes_),
        "series": series.points,
        "series_max": max((p.requests for p in series.points), default=0),
        "bucket_seconds": series.bucket_seconds,
        "depth": [{"t": t, "waiting": w} for t, w in sorted(peaks.items())],
        "depth_max": max(peaks.values(), default=0),
    }


def _bars(groups: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    top = max((g["requests"] for g in groups.values()), default=0) or 1
    return [
        {"name": name, **g, "w": 100.0 * g["requests"] / top}
        for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["requests"])
    ]


async def activity(gw: Gateway) -> dict[str, Any]:
    """The newest rows, each marked with whether a capture of its request is kept."""
    rows = [row.model_dump() for row in (await usage.activity(gw, ACTIVITY_ROWS)).rows]
    kept = service.kept_captures(gw, (row["request_id"] for row in rows))
    for row in rows:
        row["captured"] = row["request_id"] in kept
    return {"rows": rows, "bodies": gw.config.capture.bodies}


def capture(gw: Gateway, request_id: str) -> dict[str, Any]:
    """One kept capture (ApiError 404 when none is), its JSON bodies indented."""
    record = service.capture(gw, request_id).model_dump()  # with its readable bodies
    for side in ("request", "response"):
        record[f"{side}_text"] = _readable(record[side], record["encoding"][side])
    return record


def _readable(body: str | None, encoding: str | None) -> str:
    """A JSON body indented; anything else (a stream's events, a cut body, base64) as is."""
    if body is None or encoding != "utf-8":
        return body or ""
    try:
        return json.dumps(json.loads(body), indent=2, ensure_ascii=False)
    except ValueError:
        return body


def logs(gw: Gateway, model: str | None) -> dict[str, Any]:
    names = [s.name for s in gw.served]
    chosen = model if model in names else (names[0] if names else None)
    # No model at all (a gateway whose models all come from peers not yet connected).
    empty: dict[str, Any] = {"lines": [], "n_ctx": None, "n_slots": None}
    data = service.model_logs(gw, chosen, 200).model_dump() if chosen else empty
    backend = gw.models[chosen].primary.endpoint.id if chosen else None
    return {"models": names, "model": chosen, "backend": backend, **data}


def playground(gw: Gateway) -> dict[str, Any]:
    models = [{"name": s.name, "diarizes": audio.diarizes(s)} for s in audio.batch_stt(gw)]
    return {
        "models": models,
        "formats": FORMATS,
        "format": "diarized_json" if models and models[0]["diarizes"] else "json",
        "needs_key": gw.config.scheduler.require_keys,
    }


def keys(gw: Gateway) -> dict[str, Any]:
    """T2: every key by name (never a secret), and the lanes a new one may join."""
    return {
        "keys": api_keys.list_keys(gw).keys,
        "groups": api_keys.groups(gw),
        "default_group": gw.config.scheduler.default_group,
    }


def definitions(gw: Gateway) -> dict[str, Any]:
    config = gw.config
    return {
        "models": [
            {"name": name, "model": m, "ids": [r.id for r in gw.models[name].routes]}
            for name, m in config.models.items()
        ],
        "groups": config.priority_groups,
        "default_group": config.scheduler.default_group,
        "commands": config.command_costs,
        "extensions": config.extensions,
    }
