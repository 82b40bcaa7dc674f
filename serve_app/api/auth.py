"""API keys: who may use the server, checked before a request's body is read.

Keys come from ``SERVE_APP_API_KEYS`` (comma-separated) in the environment of the
process that builds the application, and from the profile's ``ingress.api_keys_file``
(one key a line, the file mode 0600 and owned by the server's user). The builder
reads them (``serve_app.config.api_keys``) and hands the ingress only their SHA-256
digests: no key is ever in a Serve config, an actor's arguments, a log line or ``/v1/stats``.

With keys configured, every route but ``/health`` and the status page's own files (``GET
/`` for a browser, ``/status/*``: no data in them) needs ``Authorization: Bearer KEY``
or ``x-api-key: KEY``; the presented key's digest is compared with every configured
digest in constant time (``hmac.compare_digest``, no early exit). The answer otherwise
is 401 in the API's own shape, sent by an ASGI middleware before the route runs, so
an unauthenticated body is never read.

Admin keys (``SERVE_APP_ADMIN_KEYS``, ``ingress.admin_keys_file``) are API keys that may
also use the controls (``/admin/*``: load, unload, pin, cache clear, self-benchmark). Once
any is set, another key gets 403 ``admin_key_required`` there: a tenant cannot unload the
models or clear the cache others use. Without admin keys every key may use them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse

from serve_app.config.api_keys import ADMIN_ENV_VAR, ENV_VAR

if TYPE_CHECKING:
    from serve_app.serving.request import ApiError

# The status page's files hold no data (its data, /v1/status, needs a key like the rest).
OPEN_PATHS = frozenset({"/health", "/status/status.js", "/status/status.css"})
ADMIN_PREFIX = "/admin/"  # the controls: with admin keys set, only they may use them

logger = logging.getLogger("ray.serve")


def presented_key(headers: Mapping[str, str]) -> str:
    """The key a request presents: ``Authorization: Bearer KEY``, else ``x-api-key``
    (Anthropic's SDK). The same key names the caller's cache namespace."""
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return key or headers.get("x-api-key", "").strip()


def _matches(presented: bytes, digests: list[bytes]) -> bool:
    """Whether ``presented`` is one of ``digests``: every one compared (no early exit),
    each in constant time, so the timing says nothing about which key, or how much of
    one, matched."""
    ok = False
    for d in digests:
        ok |= hmac.compare_digest(presented, d)
    return ok


class ApiKeys:
    """The configured key digests (``digests``: every key, admin keys included, as
    ``KeyDigests.api`` holds them; ``admin``: the admin keys); ``allows`` and ``is_admin``
    compare in constant time."""

    def __init__(self, digests: Iterable[str] = (), admin: Iterable[str] = ()) -> None:
        self.digests = [bytes.fromhex(d) for d in digests]
        self.admin = [bytes.fromhex(d) for d in admin]

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    @property
    def admin_enabled(self) -> bool:
        """Whether the controls are kept to admin keys."""
        return bool(self.admin)

    def allows(self, key: str) -> bool:
        """Whether ``key`` is one of the configured keys (admin keys included)."""
        return bool(key) and _matches(hashlib.sha256(key.encode()).digest(), self.digests)

    def is_admin(self, key: str) -> bool:
        """Whether ``key`` may use the controls: an admin key, or any key when no admin
        key is set."""
        if not self.admin_enabled:
            return self.allows(key)
        return bool(key) and _matches(hashlib.sha256(key.encode()).digest(), self.admin)

    def log_startup(self) -> None:
        if self.enabled:
            logger.info("API keys required on every route but /health (%d key(s))",
                        len(self.digests))
            if self.admin_enabled:
                logger.info("the controls (/admin/*) need one of the %d admin key(s)",
                            len(self.admin))
            else:
                logger.info("every API key may use the controls (/admin/*: load, unload, "
                            "pin, cache clear); set %s or ingress.admin_keys_file to keep "
                            "them to some", ADMIN_ENV_VAR)
        else:
            logger.warning(
                "serving WITHOUT authentication: anyone who can reach the HTTP port can use "
                "every model, read /v1/stats and /metrics, and share the prefix cache; set "
                "%s or ingress.api_keys_file (docs/security.md, API keys)", ENV_VAR)


_keys = ApiKeys()


def configure(keys: ApiKeys) -> None:
    """Set the keys this process's ingress checks (the ingress's constructor calls it)."""
    global _keys
    _keys = keys
    keys.log_startup()


def keys_enabled() -> bool:
    """Whether this process's ingress requires API keys."""
    return _keys.enabled


def admin_keys_enabled() -> bool:
    """Whether this process's ingress keeps the controls to admin keys."""
    return _keys.admin_enabled


def _anthropic_route(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def unauthorized(path: str, present: bool) -> JSONResponse:
    """401 in the shape of the API the path belongs to, with ``WWW-Authenticate``."""
    from serve_app.api import anthropic_api
    from serve_app.serving.request import ApiError

    message = ("invalid API key" if present else
               "no API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    headers = {"WWW-Authenticate": "Bearer"}
    if _anthropic_route(path):
        err = ApiError(401, message, type="authentication_error")
        return JSONResponse(anthropic_api.error_reply(err).body(), status_code=401,
                            headers=headers)
    err = ApiError(401, message, type="invalid_request_error", code="invalid_api_key")
    return JSONResponse(err.body(), status_code=401, headers=headers)


def require_admin(headers: Mapping[str, str], path: str) -> None:
    """The routes' own check of a control's key (the middleware's is by path): raises
    the 403 (401 without a configured key) a control answers a key that may not use it."""
    from serve_app.serving.request import ApiError

    keys = _keys
    if not keys.enabled:
        return
    key = presented_key(headers)
    if not keys.allows(key):
        raise ApiError(401, "invalid API key" if key else "no API key",
                       type="invalid_request_error", code="invalid_api_key")
    if not keys.is_admin(key):
        raise not_admin_error(path)


def not_admin_error(path: str) -> ApiError:
    """The 403 for a control asked with a key that is not an admin key."""
    from serve_app.serving.request import ApiError

    return ApiError(403, f"{path}: this API key may not change the server; the controls "
                         "need an admin key", type="permission_error",
                    code="admin_key_required")


def not_admin(path: str) -> JSONResponse:
    """``not_admin_error`` as the middleware's answer."""
    return JSONResponse(not_admin_error(path).body(), status_code=403)


class ApiKeyMiddleware:
    """ASGI middleware: 401 before the route runs (and before the body is read) for an
    HTTP request without a configured key, when keys are configured."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        keys = _keys
        path = _route_path(scope)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        if (scope["type"] != "http" or not keys.enabled or path in OPEN_PATHS
                or _page(path, scope, headers)):
            await self.app(scope, receive, send)
            return
        key = presented_key(headers)
        if not keys.allows(key):
            await unauthorized(path, bool(key))(scope, receive, send)
        elif path.startswith(ADMIN_PREFIX) and not keys.is_admin(key):
            await not_admin(path)(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def wants_html(accept: str) -> bool:
    """A browser's navigation asks for HTML first; API clients send ``*/*`` or JSON."""
    return "text/html" in accept.split(",")[0]


def _page(path: str, scope: dict, headers: dict[str, str]) -> bool:
    """A browser asking for the status page (``GET /`` wanting HTML): open, it holds no
    data; ``GET /`` as JSON (what this server serves) needs a key."""
    return path == "/" and scope.get("method") == "GET" and wants_html(
        headers.get("accept", ""))


def _route_path(scope: dict) -> str:
    """The path as the app's routes see it (without the application's route prefix),
    by Starlette's own rule (``starlette._utils.get_route_path``): the prefix comes off only
    at a ``/`` boundary (``/ad`` is not a prefix of ``/admin/...``), or the check here and
    the router would see two different paths."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if not root or not path.startswith(root):
        return path
    if path == root:
        return "/"
    if path[len(root)] == "/":
        return path[len(root):]
    return path
