"""The store's schema, one set of migrations for both dialects (SPEC §9, §19 X5).

`SCHEMA[i]` takes a store from version i to i+1. Statements are written once in the SQL
SQLite and PostgreSQL both accept (standard types: BIGINT, DOUBLE PRECISION, TEXT); the
few spots that cannot be are `{fields}` the dialect fills in (`SqlDialect.fragments`: the
auto-numbered id, yes/no flags, SQLite's WITHOUT ROWID), and the one statement only one
dialect has is wrapped in `Only` (SQLite's rollup trigger, which PostgreSQL stores never
had: migration 5 dropped it before they existed). Every store runs the same numbered
steps, so a version means the same tables everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from corrallm.store.dialect import SqlDialect


@dataclass(frozen=True)
class Only:
    """A statement only the dialect named `dialect` runs."""

    dialect: str
    sql: str


Statement = str | Only

# What a batch of activity rows adds to an hourly rollup, summed from the raw rows (the
# backfill of migration 3; `store/activity.py` does the same sums in Python per flush).
_ROLLUP_SUMS = """
    SUM(CASE WHEN kind = 'request' THEN 1 ELSE 0 END), SUM(prompt_tokens),
    SUM(completion_tokens), SUM(bytes), SUM(energy_wh), SUM(cost_usd),
    SUM(CASE WHEN kind = 'request' THEN dwell_ms ELSE 0 END)"""

_ROLLUP_TRIGGER = """
        CREATE TRIGGER activity_rollup AFTER INSERT ON activity BEGIN
            INSERT INTO usage_key_hour VALUES (
                CAST(NEW.t AS INTEGER) / 3600 * 3600, IFNULL(NEW.key, ''), NEW.grp,
                NEW.kind = 'request', NEW.prompt_tokens, NEW.completion_tokens, NEW.bytes,
                NEW.energy_wh, NEW.cost_usd,
                CASE WHEN NEW.kind = 'request' THEN NEW.dwell_ms ELSE 0 END
            ) ON CONFLICT (hour, key, grp) DO UPDATE SET
                requests = requests + excluded.requests,
                prompt_tokens = prompt_tokens + excluded.prompt_tokens,
                completion_tokens = completion_tokens + excluded.completion_tokens,
                bytes = bytes + excluded.bytes,
                energy_wh = energy_wh + excluded.energy_wh,
                cost_usd = cost_usd + excluded.cost_usd,
                dwell_ms = dwell_ms + excluded.dwell_ms;
            INSERT INTO usage_model_hour VALUES (
                CAST(NEW.t AS INTEGER) / 3600 * 3600, NEW.grp, NEW.model,
                NEW.kind = 'request', NEW.prompt_tokens, NEW.completion_tokens, NEW.bytes,
                NEW.energy_wh, NEW.cost_usd,
                CASE WHEN NEW.kind = 'request' THEN NEW.dwell_ms ELSE 0 END
            ) ON CONFLICT (hour, grp, model) DO UPDATE SET
                requests = requests + excluded.requests,
                prompt_tokens = prompt_tokens + excluded.prompt_tokens,
                completion_tokens = completion_tokens + excluded.completion_tokens,
                bytes = bytes + excluded.bytes,
                energy_wh = energy_wh + excluded.energy_wh,
                cost_usd = cost_usd + excluded.cost_usd,
                dwell_ms = dwell_ms + excluded.dwell_ms;
        END
        """

SCHEMA: Sequence[Sequence[Statement]] = (
    # 1: pauses (SPEC §10 P1, §9 C5): what must survive a restart.
    (
        """
        CREATE TABLE pauses (
            kind TEXT NOT NULL CHECK (kind IN ('model', 'extension')),
            name TEXT NOT NULL,
            until DOUBLE PRECISION,        -- unix seconds; NULL: until unpaused
            paused_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (kind, name)
        )
        """,
    ),
    # 2: activity (SPEC §9 C3/C4, §14): one row per request or load, and queue samples.
    (
        """
        CREATE TABLE activity (
            id {id},
            t DOUBLE PRECISION NOT NULL,   -- unix seconds when the request arrived
            kind TEXT NOT NULL,            -- 'request' | 'load'
            key TEXT,                      -- the caller's configured key name, or NULL
            grp TEXT NOT NULL,
            model TEXT NOT NULL,
            backend TEXT,
            endpoint TEXT NOT NULL,
            status INTEGER NOT NULL,
            dwell_ms DOUBLE PRECISION NOT NULL DEFAULT 0,
            duration_ms DOUBLE PRECISION NOT NULL DEFAULT 0,
            ttfb_ms DOUBLE PRECISION,
            prompt_tokens BIGINT NOT NULL DEFAULT 0,
            completion_tokens BIGINT NOT NULL DEFAULT 0,
            bytes BIGINT NOT NULL DEFAULT 0,
            energy_wh DOUBLE PRECISION NOT NULL DEFAULT 0,
            cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
            estimated {flag},
            degraded {flag},
            spilled {flag},
            preempted {flag},
            error TEXT
        )
        """,
        "CREATE INDEX activity_t ON activity (t)",
        "CREATE INDEX activity_key_t ON activity (key, t)",
        "CREATE INDEX activity_grp_t ON activity (grp, t)",
        "CREATE INDEX activity_model_t ON activity (model, t)",
        """
        CREATE TABLE queue_depth (
            t DOUBLE PRECISION NOT NULL,
            backend TEXT NOT NULL,
            waiting INTEGER NOT NULL,
            in_flight INTEGER NOT NULL
        )
        """,
        "CREATE INDEX queue_depth_t ON queue_depth (t)",
    ),
    # 3: hourly usage rollups (SPEC §9 C4): dashboard ranges of days read thousands of
    # rows, not millions. A trigger kept them in the same transaction as each insert (until
    # migration 5); queries add the raw rows of partial hours.
    # `key` is '' for requests without one (primary-key columns cannot be NULL here).
    (
        """
        CREATE TABLE usage_key_hour (
            hour BIGINT NOT NULL,          -- unix seconds at the start of the UTC hour
            key TEXT NOT NULL,
            grp TEXT NOT NULL,
            requests BIGINT NOT NULL,      -- kind = 'request' rows only
            prompt_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            bytes BIGINT NOT NULL,
            energy_wh DOUBLE PRECISION NOT NULL,  -- request and load rows
            cost_usd DOUBLE PRECISION NOT NULL,
            dwell_ms DOUBLE PRECISION NOT NULL,   -- summed over request rows
            PRIMARY KEY (hour, key, grp)
        ){without_rowid}
        """,
        """
        CREATE TABLE usage_model_hour (
            hour BIGINT NOT NULL,          -- unix seconds at the start of the UTC hour
            grp TEXT NOT NULL,
            model TEXT NOT NULL,
            requests BIGINT NOT NULL,      -- kind = 'request' rows only
            prompt_tokens BIGINT NOT NULL,
            completion_tokens BIGINT NOT NULL,
            bytes BIGINT NOT NULL,
            energy_wh DOUBLE PRECISION NOT NULL,  -- request and load rows
            cost_usd DOUBLE PRECISION NOT NULL,
            dwell_ms DOUBLE PRECISION NOT NULL,   -- summed over request rows
            PRIMARY KEY (hour, grp, model)
        ){without_rowid}
        """,
        f"""
        INSERT INTO usage_key_hour
        SELECT {{hour_of_t}}, COALESCE(key, ''), grp,{_ROLLUP_SUMS}
        FROM activity GROUP BY 1, 2, 3
        """,
        f"""
        INSERT INTO usage_model_hour
        SELECT {{hour_of_t}}, grp, model,{_ROLLUP_SUMS}
        FROM activity GROUP BY 1, 2, 3
        """,
        Only("sqlite", _ROLLUP_TRIGGER),
    ),
    # 4: the economics ledger (SPEC §11 D1): per backend, counters kept from install on.
    (
        """
        CREATE TABLE economics (
            backend TEXT PRIMARY KEY,
            first_seen DOUBLE PRECISION NOT NULL,  -- unix seconds: when counting began
            wakes BIGINT NOT NULL DEFAULT 0,
            sleeps BIGINT NOT NULL DEFAULT 0,
            asleep_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
            wake_count BIGINT NOT NULL DEFAULT 0,  -- wakes with a measured latency
            wake_seconds_total DOUBLE PRECISION NOT NULL DEFAULT 0,
            wake_seconds_max DOUBLE PRECISION NOT NULL DEFAULT 0,
            wake_seconds_last DOUBLE PRECISION,
            gpu_hours DOUBLE PRECISION NOT NULL DEFAULT 0  -- hours asleep * GPU share
        ){without_rowid}
        """,
    ),
    # 5: the rollups are summed per flush by the one writer (store/activity.py), one upsert
    # per hour and key or model in the batch, instead of two by the trigger for every row:
    # the writer's SQLite time halves (bench/store_queries.py's writer line).
    (Only("sqlite", "DROP TRIGGER activity_rollup"),),
    # 6: learned footprints (SPEC §17 M2): what each backend's process held after a load,
    # per pool, keyed by the backend and its command line (a changed cmd is a new key).
    (
        """
        CREATE TABLE footprints (
            backend TEXT NOT NULL,
            command TEXT NOT NULL,         -- a hash of the placement-independent spec
            pool TEXT NOT NULL,            -- `gpu`: whichever GPU it was placed on (M3)
            bytes BIGINT NOT NULL,
            measured_at DOUBLE PRECISION NOT NULL,  -- unix seconds
            PRIMARY KEY (backend, command, pool)
        ){without_rowid}
        """,
    ),
    # 7: each request row names its request (SPEC §21 O1: X-Corrallm-Request-Id), so the
    # dashboard links a row to its capture; NULL for load rows and rows written before.
    (
        "ALTER TABLE activity ADD COLUMN request_id TEXT",
        "CREATE INDEX activity_request_id ON activity (request_id)",
    ),
    # 8: spend windows shared by the gateways of one store (SPEC §6 S6, §19 X5): a row per
    # live reservation (its estimate, until settled or `expires`) and per spent amount.
    # Only shared stores use it (store/spend.py); an embedded store keeps its windows in
    # memory (cost/spend.py) and rebuilds them from the activity rows at boot.
    (
        """
        CREATE TABLE spend (
            id {id},
            grp TEXT NOT NULL,
            t DOUBLE PRECISION NOT NULL,   -- unix seconds: reserved at, or spent at
            usd DOUBLE PRECISION NOT NULL,
            state TEXT NOT NULL CHECK (state IN ('reserved', 'spent')),
            gateway TEXT NOT NULL,         -- who wrote it (for the operator)
            expires DOUBLE PRECISION       -- a reservation no longer counts after this
        )
        """,
        "CREATE INDEX spend_grp_t ON spend (grp, t)",
    ),
    # 9: keys are identities (SPEC §22). Rows written before named a key by its secret:
    # each becomes the name that key now has in the short form (`key-<first 8 hex of its
    # SHA-256>`), so no secret stays in the store and old rows line up with new ones.
    # The keys made at runtime (T2) are kept as digests; `usr` is the user behind a key
    # that may name one (T4: `user` is a reserved word in PostgreSQL).
    (
        "UPDATE activity SET key = 'key-' || substr({sha256_hex}, 1, 8) "
        "WHERE key IS NOT NULL AND key <> ''",
        "UPDATE usage_key_hour SET key = 'key-' || substr({sha256_hex}, 1, 8) WHERE key <> ''",
        "ALTER TABLE activity ADD COLUMN usr TEXT",
        "CREATE INDEX activity_usr_t ON activity (usr, t)",
        """
        CREATE TABLE api_keys (
            name TEXT PRIMARY KEY,
            digest TEXT NOT NULL UNIQUE,   -- sha256:<hex> of the secret; never the secret
            prefix TEXT NOT NULL,          -- the secret's first 7 characters, for people
            grp TEXT,                      -- NULL: the scheduler's default group
            policy TEXT NOT NULL,          -- JSON: models, limits, spendLimit, expires, ...
            created DOUBLE PRECISION NOT NULL,
            last_used DOUBLE PRECISION
        ){without_rowid}
        """,
        # T2: the digests of secrets revoked or rotated away, so such a secret is refused
        # as such (401) even where unknown keys are served (no `requireKeys`).
        """
        CREATE TABLE revoked_keys (
            digest TEXT PRIMARY KEY,       -- sha256:<hex> of the secret no longer valid
            name TEXT NOT NULL,            -- the key it belonged to
            reason TEXT NOT NULL CHECK (reason IN ('revoked', 'rotated')),
            at DOUBLE PRECISION NOT NULL   -- unix seconds
        ){without_rowid}
        """,
        # T3: per-key rate limits counted across the gateways of a shared store
        # (store/rates.py): a row per admitted request of a key, or of a user behind it;
        # its estimated tokens while `reserved`, its metered ones once `used`. Pruned
        # once out of the 60 s window. An embedded store counts in memory and leaves it
        # empty.
        """
        CREATE TABLE key_rates (
            id {id},
            subject TEXT NOT NULL,         -- key:<name> or key:<name>/user:<user>
            t DOUBLE PRECISION NOT NULL,   -- unix seconds: admitted at (rpm)
            tokens BIGINT NOT NULL,        -- the estimate while reserved, then the usage
            state TEXT NOT NULL CHECK (state IN ('reserved', 'used')),
            used_at DOUBLE PRECISION,      -- settled at (tpm counts the usage from then)
            gateway TEXT NOT NULL,         -- who wrote it (for the operator)
            expires DOUBLE PRECISION       -- a reservation no longer counts after this
        )
        """,
        "CREATE INDEX key_rates_subject_t ON key_rates (subject, t)",
    ),
)


def migrations(dialect: SqlDialect) -> tuple[tuple[str, ...], ...]:
    """The migrations as `dialect` runs them: `[i]` takes version i to i+1."""
    fields = {
        **dialect.fragments(),
        "hour_of_t": dialect.floor_to("t", 3600),
        "sha256_hex": dialect.sha256_hex("key"),
    }
    return tuple(
        tuple(
            s.format_map(fields) if isinstance(s, str) else s.sql
            for s in step
            if isinstance(s, str) or s.dialect == dialect.name
        )
        for step in SCHEMA
    )
