"""The `corrallm` command: serve, check, keys, config-schema, version, fake-backend."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from corrallm import __version__

if TYPE_CHECKING:
    from corrallm.config import Config

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="One OpenAI-compatible gateway in front of many LLM and audio backends.",
)


def _load(config: Path | None) -> tuple[Config, Path | None]:
    """The config named, else ./corrallm.yaml, else the packaged demo; exit 1 listing
    every problem if it is invalid."""
    from corrallm.config import ConfigError, load_config, load_demo_config
    from corrallm.residency.footprints import footprint_problems

    local = Path("corrallm.yaml")
    path = config or (local if local.exists() else None)
    try:
        if path is None:
            return load_demo_config(), None
        return load_config(path, checks=[footprint_problems]), path
    except ConfigError as exc:
        typer.echo(exc.report(), err=True)
        raise typer.Exit(1) from exc


@app.command()
def serve(
    config: Annotated[
        Path | None,
        typer.Option(
            envvar="CORRALLM_CONFIG", help="config file (default ./corrallm.yaml, else the demo)"
        ),
    ] = None,
    home: Annotated[
        Path, typer.Option(envvar="CORRALLM_HOME", help="state folder: PID records, logs, store")
    ] = Path("~/.corrallm"),
    db: Annotated[
        str | None,
        typer.Option(
            envvar="CORRALLM_DB",
            metavar="PATH|URL",
            help="the store: an SQLite file (default <home>/corrallm.db), or a "
            "postgresql://user@host:port/dbname URL (also postgres://) for a PostgreSQL "
            "store several gateways share",
        ),
    ] = None,
    web_root: Annotated[
        Path | None,
        typer.Option(
            envvar="CORRALLM_WEB_ROOT",
            help="serve the dashboard's templates/ and static/ from this folder first",
        ),
    ] = None,
    activity_retention: Annotated[
        str,
        typer.Option(envvar="CORRALLM_ACTIVITY_RETENTION", help="how long activity rows are kept"),
    ] = "30d",
    reservation_max_ttl: Annotated[
        str,
        typer.Option(
            envvar="CORRALLM_RESERVATION_MAX_TTL",
            help="default and longest ttl of a /v1/reservations lease",
        ),
    ] = "5m",
    health_timeout: Annotated[
        str,
        typer.Option(
            envvar="CORRALLM_HEALTH_TIMEOUT", help="how long a backend may take to turn healthy"
        ),
    ] = "120s",
    addr: Annotated[
        str,
        typer.Option(
            envvar="ADDR",
            metavar="HOST:PORT",
            help="where to listen: :6502 (every interface), 127.0.0.1:6502 or [::1]:6502; "
            "without --addr, the ADDR environment variable",
        ),
    ] = ":6502",
    workers: Annotated[
        str,
        typer.Option(
            envvar="CORRALLM_WORKERS",
            metavar="N|auto",
            help="relaying worker processes (SO_REUSEPORT) beside one owner of state; "
            "auto: one per core, less one; 1 (the default): one process, no hop",
        ),
    ] = "1",
) -> None:
    """Serve the gateway on --addr (default :6502; the ADDR environment variable when
    --addr is not given)."""
    from corrallm.server import ServeOptions, parse_addr, run

    timeout = _duration(health_timeout, "--health-timeout")
    lease_cap = _duration(reservation_max_ttl, "--reservation-max-ttl")
    retention = _duration(activity_retention, "--activity-retention")
    try:
        parse_addr(addr)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--addr (or ADDR)") from exc
    count = _workers(workers)
    cfg, path = _load(config)
    for warning in _start_warnings(cfg):
        typer.echo(f"corrallm serve: warning: {warning}", err=True)
    options = ServeOptions(
        addr=addr,
        home=home.expanduser(),
        health_timeout=timeout,
        reservation_max_ttl=lease_cap,
        activity_retention=retention,
        web_root=_web_root(web_root),
        config_path=path,
        db=db or None,
    )
    if count > 1:
        from corrallm.workers.serve import run as run_workers

        run_workers(cfg, options, count)
    else:
        run(cfg, options)


def _workers(value: str) -> int:
    """--workers: a count, or `auto` (one per core, less one for the owner; at least 1)."""
    if value == "auto":
        return max(1, (os.cpu_count() or 1) - 1)
    if not value.isdigit() or int(value) < 1:
        raise typer.BadParameter(
            f"must be a number of processes (1 or more) or auto, got {value!r}",
            param_hint="--workers (or CORRALLM_WORKERS)",
        )
    return int(value)


def _web_root(folder: Path | None) -> Path | None:
    if folder is None:
        return None
    folder = folder.expanduser()
    if not (folder / "templates").is_dir() and not (folder / "static").is_dir():
        raise typer.BadParameter(
            f"{folder} has neither templates/ nor static/ to serve", param_hint="--web-root"
        )
    return folder


def _duration(value: str, flag: str) -> float:
    from corrallm.config.units import parse_duration

    try:
        return parse_duration(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from exc


@app.command()
def check(
    config: Annotated[Path | None, typer.Option(help="config file to validate")] = None,
) -> None:
    """Validate a config; print a summary, or every problem and exit non-zero."""
    from corrallm.config import summary
    from corrallm.residency.footprints import estimate_footprints
    from corrallm.tools.environment import probe, report, warnings

    cfg, _ = _load(config)
    typer.echo(summary(cfg))
    footprints = estimate_footprints(cfg)[0]
    if footprints:
        typer.echo("\nmemory estimates (SPEC §17 M1; ramUsage auto or omitted):")
        for sid, footprint in footprints.items():
            typer.echo(f"  {sid}:")
            typer.echo("\n".join(f"    {line}" for line in footprint.describe()))
    env = probe()
    typer.echo("\n" + report(env))
    for warning in [*warnings(cfg, env), *_start_warnings(cfg)]:
        typer.echo(f"warning: {warning}")


def _start_warnings(cfg: Config) -> list[str]:
    """Backends whose process could not start on this machine (a program not found, a
    --slot-save-path folder missing), each with its YAML path."""
    from corrallm.config.validation import format_path
    from corrallm.lifecycle.preflight import start_problems

    return [f"{format_path(loc)}: {message}" for loc, message in start_problems(cfg)]


keys_app = typer.Typer(help="API keys (SPEC §22): hash a secret for `secretHash`.")
app.add_typer(keys_app, name="keys")


@keys_app.command("hash")
def keys_hash() -> None:
    """Read a secret from stdin (one line) and print `sha256:<hex>` for `secretHash`:
    the config then holds no secret at all."""
    from corrallm.auth.keys import hash_text

    secret = sys.stdin.readline().rstrip("\r\n")
    if not secret:
        typer.echo("no secret on stdin: pipe it in, e.g. `corrallm keys hash < key.txt`", err=True)
        raise typer.Exit(1)
    typer.echo(hash_text(secret))


@app.command("config-schema")
def config_schema() -> None:
    """Print the JSON Schema of corrallm.yaml (for editors)."""
    from corrallm.config import json_schema

    typer.echo(json.dumps(json_schema(), indent=2))


@app.command()
def verify(
    model: Annotated[str, typer.Option(help="the model to cycle")],
    base_url: Annotated[str, typer.Option(help="the running corrallm")] = "http://127.0.0.1:6502",
    token: Annotated[
        str | None, typer.Option(envvar="CORRALLM_TOKEN", help="admin token (default: from --home)")
    ] = None,
    home: Annotated[Path, typer.Option(envvar="CORRALLM_HOME")] = Path("~/.corrallm"),
    timeout: Annotated[float, typer.Option(help="seconds allowed for each step")] = 300.0,
) -> None:
    """Asleep -> request -> wakes -> responds -> idle -> asleep, each step timed."""
    from corrallm.tools.verify import Verify, VerifyFailed

    if token is None:
        token_file = home.expanduser() / "admin.token"
        if not token_file.exists():
            typer.echo(
                f"no admin token: pass --token or point --home at corrallm's ({token_file})",
                err=True,
            )
            raise typer.Exit(2)
        token = token_file.read_text().strip()
    try:
        steps = Verify(base_url, model, token, timeout, typer.echo).run()
    except VerifyFailed as exc:
        typer.echo(f"verify failed: {exc}", err=True)
        raise typer.Exit(1) from exc
    total = sum(seconds for _, seconds, _ in steps)
    typer.echo(f"verify passed: {len(steps)} steps in {total:.2f}s")


@app.command()
def bench(
    base_url: Annotated[str, typer.Option(help="any OpenAI-compatible endpoint")],
    model: Annotated[str, typer.Option(help="model name to send")],
    concurrency: Annotated[int, typer.Option(min=1)] = 1,
    requests: Annotated[int, typer.Option(min=1)] = 20,
    max_tokens: Annotated[int, typer.Option(min=1)] = 64,
    prompt: str = "Write a short paragraph about corrals.",
    api_key: Annotated[str | None, typer.Option(envvar="OPENAI_API_KEY")] = None,
    request_timeout: float = 300.0,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Time to first token, tokens/s and latency percentiles of streamed chat completions."""
    import asyncio

    from corrallm.tools.bench import run, table

    result = asyncio.run(
        run(base_url, model, concurrency, requests, max_tokens, prompt, api_key, request_timeout)
    )
    typer.echo(json.dumps(result, indent=2) if as_json else table(result))
    if result["errors"] == result["requests"]:
        raise typer.Exit(1)


@app.command("dump-graphql")
def dump_graphql() -> None:
    """Print the GraphQL schema (SDL) of /api/graphql."""
    from corrallm.api.graphql import sdl

    typer.echo(sdl())


@app.command()
def version() -> None:
    """Print the version."""
    typer.echo(__version__)


@app.command(
    "fake-backend",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def fake_backend(ctx: typer.Context) -> None:
    """A fake OpenAI-compatible backend (see `corrallm fake-backend --help`)."""
    from corrallm.fake_backend import main as fake_main

    fake_main(list(ctx.args))


def main() -> None:
    app()
