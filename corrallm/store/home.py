"""corrallm's home folder is its owner's alone (SPEC §22 T5).

The home holds the admin token, the store (with its activity, key digests and spend),
backends' logs (which may echo prompts) and PID records. corrallm creates the home and
its folders 0700 and every file it writes there 0600, whatever the umask; one made by an
older version, or by hand, is tightened when corrallm starts (the home itself with a log
line, since an operator may have opened it on purpose) and each file when corrallm opens
it again.

Files are created with their mode (`os.open(..., PRIVATE_FILE)`) rather than under a
changed umask: the umask is the whole process's, and backends spawned meanwhile would
inherit it. SQLite makes its `-wal` and `-shm` files with the mode of the database file,
so creating that file 0600 first is enough for them (store/db.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("corrallm")

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def secure_home(home: Path) -> None:
    """Create `home` 0700, or tighten an existing one (said in the log): its group and
    others lose every permission."""
    home.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    mode = stat.S_IMODE(home.stat().st_mode)
    if mode & 0o077:
        os.chmod(home, mode & PRIVATE_DIR)
        log.warning(
            "home %s was mode %04o (readable by others): tightened to %04o",
            home,
            mode,
            mode & PRIVATE_DIR,
        )


def private_folder(path: Path) -> None:
    """A folder under the home, created 0700 (and its missing parents)."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)


def open_private(path: Path, flags: int) -> int:
    """`os.open` creating `path` 0600; an existing file is made 0600 too. The folder
    is created 0700 if missing."""
    private_folder(path.parent)
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_FILE:
            os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_private(path: Path) -> None:
    """An existing file made 0600 (a missing one is left missing)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_IMODE(path.stat().st_mode) != PRIVATE_FILE:
            os.chmod(path, PRIVATE_FILE)
