"""Reading the configured API keys: ``SERVE_APP_API_KEYS`` and the profile's
``ingress.api_keys_file`` (one key a line, mode 0600, owned by the server's user), and the
admin keys, which alone may use the controls (``/admin/*``) once any are set:
``SERVE_APP_ADMIN_KEYS`` and ``ingress.admin_keys_file``. Only their SHA-256 digests
leave the builder (``serve_app.api.auth`` checks requests).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("ray.serve")


ENV_VAR = "SERVE_APP_API_KEYS"
ADMIN_ENV_VAR = "SERVE_APP_ADMIN_KEYS"  # keys that may also change the server (/admin/*)
ADMIN_FILE = "admin key file"  # how errors name ``ingress.admin_keys_file``


SHORT_KEY_CHARS = 16  # shorter keys are accepted, with a WARNING


class ApiKeyError(ValueError):
    """Keys that cannot be used (the message never contains a key)."""


def digest(key: str) -> str:
    """A key's digest: what the ingress keeps and what a cache namespace is named by."""
    return hashlib.sha256(key.encode()).hexdigest()


def _checked(keys: Iterable[str], where: str) -> list[str]:
    out = []
    for i, key in enumerate(keys, 1):
        if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
            raise ApiKeyError(f"{where}: key {i} has characters a header cannot carry "
                            "(use printable ASCII without spaces)")
        out.append(key)
    return out


def keys_from_env(environ: Mapping[str, str] | None = None, var: str = ENV_VAR) -> list[str]:
    """The keys of ``var`` (``SERVE_APP_API_KEYS``); [] when unset. Set but holding no key
    (empty, or only commas) is an error: the operator meant keys, so never serve open."""
    environ = os.environ if environ is None else environ
    if var not in environ:
        return []
    keys = [k.strip() for k in environ[var].split(",") if k.strip()]
    if not keys:
        raise ApiKeyError(f"{var} is set but holds no key; unset it to serve without keys")
    return _checked(keys, var)


def check_key_file(path: str | Path, st: os.stat_result | None = None,
                   what: str = "API key file") -> Path:
    """A key file the server may trust: a regular file owned by this user, neither
    group- nor world-accessible (mode 0600 or stricter). Raises ``ApiKeyError`` naming it.
    ``st``: the stat of the file as opened (so the file checked is the file read)."""
    path = Path(path).expanduser()
    if st is None:
        try:
            st = path.stat()
        except OSError as exc:
            raise ApiKeyError(f"{what} {str(path)!r}: cannot read it: "
                              f"{exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ApiKeyError(f"{what} {str(path)!r} is not a regular file")
    if st.st_uid != os.getuid():
        raise ApiKeyError(f"{what} {str(path)!r} is owned by uid {st.st_uid}, not by "
                          f"this user (uid {os.getuid()})")
    if st.st_mode & 0o077:
        raise ApiKeyError(f"{what} {str(path)!r} has mode "
                          f"{stat.S_IMODE(st.st_mode):04o}; other users must not read it: "
                          f"chmod 600 {path}")
    return path


def keys_from_file(path: str | Path, what: str = "API key file") -> list[str]:
    """The keys of a key file (one a line; blank lines and ``#`` comments skipped),
    after ``check_key_file`` on the opened file. A file with no key is an error."""
    path = check_key_file(path, what=what)
    try:
        with open(path, "rb") as f:
            check_key_file(path, os.fstat(f.fileno()), what)
            lines = f.read().decode().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyError(f"{what} {str(path)!r}: cannot read it: {exc}") from None
    keys = [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]
    if not keys:
        raise ApiKeyError(f"{what} {str(path)!r} holds no key")
    return _checked(keys, f"{what} {str(path)!r}")


@dataclass(frozen=True)
class KeyDigests:
    """What the ingress checks: the digests of every key that may use the API (``api``,
    the admin keys among them) and of the admin keys (``admin``): with any set, only they
    may use the controls."""

    api: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()


def configured_digests(key_file: str | None, environ: Mapping[str, str] | None = None,
                       admin_file: str | None = None) -> KeyDigests:
    """Digests of every configured key (environment and files), deduplicated."""
    admin = keys_from_env(environ, ADMIN_ENV_VAR) + (
        keys_from_file(admin_file, ADMIN_FILE) if admin_file else [])
    keys = keys_from_env(environ) + (keys_from_file(key_file) if key_file else []) + admin
    if any(len(k) < SHORT_KEY_CHARS for k in keys):
        logger.warning("an API key is shorter than %d characters: easy to guess; use e.g. "
                       "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
                       SHORT_KEY_CHARS)
    return KeyDigests(tuple(sorted({digest(k) for k in keys})),
                      tuple(sorted({digest(k) for k in admin})))
