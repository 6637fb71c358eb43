"""The token-signing secret of a gateway started without ``GATEWAY_SECRET``.

On SQLite (the zero-configuration default) the secret is made once and kept beside the database, in
``<database>.secret`` (mode 0600), so that the tokens handed out before a restart still work after it. It
is created atomically (written to a private temporary file, then linked into place: two processes that
race both end up with the one that won), and refused if other users may read it or it is not a secret
this module wrote. On PostgreSQL, whose processes may run on several hosts, set ``GATEWAY_SECRET``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import tempfile

from pydantic import SecretStr

from gateway.errors import ConfigError
from gateway.settings import MIN_SECRET_BYTES, Settings

SUFFIX = ".secret"
_WELL_FORMED = re.compile(r"[!-~]+")  # printable ASCII, no space


def secret_path(settings: Settings) -> str | None:
    """Where this database keeps its generated secret; ``None`` where there is no file to keep it beside
    (PostgreSQL)."""
    from gateway.store.database import sqlite_path

    path = sqlite_path(settings.database_url)
    return None if path is None else path + SUFFIX


def with_secret(settings: Settings, *, create: bool = True) -> Settings:
    """``settings`` with the secret to sign with: ``GATEWAY_SECRET`` when set, else the database's secret
    file (made if missing and ``create``). Unchanged when there is neither (PostgreSQL)."""
    if settings.secret is not None:
        return settings
    path = secret_path(settings)
    if path is None:
        return settings
    secret = read_secret(path) if not create else load_or_create(path)
    if secret is None:
        return settings
    return settings.model_copy(update={"secret": SecretStr(secret)})


def load_or_create(path: str) -> str:
    secret = read_secret(path)
    if secret is not None:
        return secret
    try:
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".gateway-secret-")  # mode 0600
    except OSError as exc:
        raise ConfigError(f"cannot create the token secret {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
            out.flush()
            os.fsync(out.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs is the one
            os.link(temporary, path)  # atomic, and never replaces a secret
        _sync_directory(os.path.dirname(path))  # the new name survives a power cut, as the tokens would
    except OSError as exc:
        raise ConfigError(f"cannot create the token secret {path}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    made = read_secret(path)
    assert made is not None
    return made


def read_secret(path: str) -> str | None:
    """The secret in ``path``; ``None`` if there is no such file; ``ConfigError`` if others may read it or
    it does not hold a secret."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the token secret {path}: {exc.strerror}") from None
    with os.fdopen(fd) as handle:
        mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
        if mode & 0o077:
            raise ConfigError(
                f"the token secret {path} is open to other users (mode {mode:o}): run chmod 600 {path}"
            )
        text = handle.read(4096)
    secret = text.removesuffix("\n")
    if len(secret) < MIN_SECRET_BYTES or not _WELL_FORMED.fullmatch(secret):
        raise ConfigError(
            f"the token secret {path} is malformed (expected one line of at least {MIN_SECRET_BYTES} "
            "printable characters); delete it to make a new one (tokens signed with the old one stop working)"
        )
    return secret


def _sync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
