"""A throwaway PostgreSQL for the shared-store tests (SPEC §19 X5).

One cluster per test session: `initdb` into a temp folder, `postgres` on a free loopback
port (trust auth on 127.0.0.1 only, its unix socket inside the folder), run as an
unprivileged user when the tests run as root (PostgreSQL refuses root). Each test gets a
fresh database of its own (`CREATE DATABASE` takes milliseconds). Afterwards the server
is stopped fast (SIGINT), killed if it does not go, and the folder removed.

PostgreSQL is a Debian package (`apt-get install postgresql`; its binaries live in
/usr/lib/postgresql/<version>/bin, not on PATH). Without it the tier is skipped with a
loud reason, except under `.ci/run` (CORRALLM_REQUIRE_TIERS=1), which installs it: there
a missing PostgreSQL fails.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import free_port, kill_group
from tests.support.tiers import REQUIRED, tier

UNPRIVILEGED = "nobody"
INITDB = ("-E", "UTF8", "--no-sync", "--no-instructions")
# Loopback only; durability off (nothing of a throwaway cluster must survive a power cut).
SETTINGS = ("-h", "127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off")
SETTINGS += ("-c", "full_page_writes=off", "-c", "max_connections=200")


def bin_dir() -> Path | None:
    """Where initdb and postgres are: on PATH, else Debian's versioned folder."""
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    return Path(versions[-1]).parent if versions else None


def without_postgres() -> str | None:
    if bin_dir() is not None:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "NO PSYCOPG: the shared-store tests need pip install 'psycopg[binary,pool]'"
        return None
    return (
        "NO POSTGRESQL: the shared-store tests (X5) run a throwaway PostgreSQL "
        "(apt-get install postgresql)"
    )


POSTGRES_TIER = tier(without_postgres())


@dataclass
class Cluster:
    folder: Path
    port: int
    proc: subprocess.Popen[bytes]
    _names = itertools.count(1)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def log(self) -> str:
        return (self.folder / "postgres.log").read_text(errors="replace")


def _as_user() -> dict[str, object]:
    """Popen arguments that drop root for PostgreSQL (which refuses to run as root)."""
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam(UNPRIVILEGED)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _server(command: list[object]) -> tuple[list[object], dict[str, object]]:
    """How to run the server: through setpriv where there is one, which also has the kernel
    end it (SIGQUIT: immediate shutdown) if the test process dies before its finalizer
    could; else with Popen dropping root itself."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return command, _as_user()
    prefix: list[object] = [setpriv, "--pdeathsig", "QUIT"]
    if os.geteuid() == 0:
        user = pwd.getpwnam(UNPRIVILEGED)
        prefix += ["--reuid", str(user.pw_uid), "--regid", str(user.pw_gid), "--clear-groups"]
    return [*prefix, "--", *command], {}


@contextlib.contextmanager
def cluster(timeout: float = 30.0) -> Iterator[Cluster]:
    binaries = bin_dir()
    if binaries is None:
        raise RuntimeError(without_postgres())
    folder = Path(tempfile.mkdtemp(prefix="corrallm-pg-"))  # not under pytest's 0700 tmp
    drop = _as_user()
    if drop:
        os.chown(folder, drop["user"], drop["group"])  # type: ignore[arg-type]
    data, log_path = folder / "data", folder / "postgres.log"
    proc: subprocess.Popen[bytes] | None = None
    try:
        done = subprocess.run(
            [binaries / "initdb", "-D", data, "-U", "postgres", "-A", "trust", *INITDB],
            capture_output=True,
            text=True,
            **drop,  # type: ignore[call-overload]
        )
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.strip()}")
        port = free_port()
        with log_path.open("wb") as log:
            if drop:
                os.chown(log_path, drop["user"], drop["group"])  # type: ignore[arg-type]
            command, user = _server([binaries / "postgres", "-D", data, "-p", str(port)])
            proc = subprocess.Popen(
                [*command, "-k", folder, *SETTINGS],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **user,  # type: ignore[call-overload]
            )
        server = Cluster(folder, port, proc)
        _wait_ready(server, timeout)
        yield server
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(folder, ignore_errors=True)


def _wait_ready(server: Cluster, timeout: float) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {server.proc.returncode}:\n{server.log()}")
        try:
            with psycopg.connect(server.url(), connect_timeout=2):
                return
        except psycopg.OperationalError as exc:
            last = exc
            time.sleep(0.05)
    raise RuntimeError(f"postgres not accepting connections after {timeout}s: {last}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Fast shutdown (SIGINT: abort sessions, no checkpoint wait), then kill the group."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    kill_group(proc.pid)  # any backend still around
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """The session's PostgreSQL (see the module docstring)."""
    missing = without_postgres()
    if missing is not None:
        if REQUIRED:
            pytest.fail(f"{missing} (required under CORRALLM_REQUIRE_TIERS=1)")
        pytest.skip(f"SKIPPED LOUDLY: {missing}")
    with cluster() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_cluster: Cluster) -> str:
    """A fresh database on the session's PostgreSQL, as a `postgresql://` URL."""
    return postgres_cluster.create_database()
