"""The status page and its controls: ``GET /`` (the page for a browser, what this server
is for any other client), ``GET /v1/status`` (the page's data), and the admin POSTs that
load, unload and pin models, clear a model's cache and run the self-benchmark.

The page is three static files (``status_page/``): no build step, nothing from a CDN. It
holds no data itself, so it is served without a key; its data and every control need one
when keys are configured (``serve_app.api.auth``). Nothing changes state on a GET, and a
POST from another site's page is refused (its ``Origin`` is not this server's), so a page
the user visits elsewhere cannot drive this one's controls.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from importlib import resources
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from serve_app.api import auth
from serve_app.api.body import parse_json, read_body
from serve_app.api.http import OpenAIIngress, api, release
from serve_app.api.status import status_view
from serve_app.serving.request import ApiError

ASSETS = {"status.js": "text/javascript", "status.css": "text/css"}
# No other site may frame the page (a framed copy's clicks would carry this server's own
# origin), and it loads nothing but its own files.
PAGE_HEADERS = {"Cache-Control": "no-store", "X-Frame-Options": "DENY",
                "Content-Security-Policy": "frame-ancestors 'none'; default-src 'self'; "
                                           "img-src 'self' data:"}
MAX_ADMIN_BODY = 4096
ENDPOINTS = ["/health", "/v1/models", "/v1/chat/completions", "/v1/completions",
             "/v1/responses", "/v1/messages", "/v1/stats", "/v1/status", "/metrics"]


def _asset(name: str) -> str:
    return resources.files("serve_app.api").joinpath("status_page", name).read_text()


def check_same_origin(request: Request) -> None:
    """403 for a POST that a page of another origin sent (browsers always name the
    sending page's origin on a cross-origin POST); clients that are not browsers send
    none."""
    origin = request.headers.get("origin")
    if origin is None:
        return
    host = request.headers.get("host", "")
    if origin not in (f"http://{host}", f"https://{host}"):
        raise ApiError(403, f"cross-origin request refused: a page at {origin} may not "
                            "change this server; use the status page it serves at /",
                       type="permission_error", code="cross_origin")


def _admin(request: Request) -> None:
    """What every control checks first: the key may use the controls (again: the
    middleware checked by path), and the POST is not another site's."""
    auth.require_admin(request.headers, request.url.path)
    check_same_origin(request)


class StatusRoutes(OpenAIIngress):
    """The page, its data and its controls, beside the API's routes."""

    @api.get("/", response_model=None)
    async def root(self, request: Request) -> Response | dict:
        """The status page for a browser; for any other client what this server is, its
        models' phases and its endpoints."""
        if auth.wants_html(request.headers.get("accept", "")):  # asks for a key first?
            page = _asset("index.html").replace("{{api_keys}}",
                                                "on" if self.server.api_keys else "off")
            return HTMLResponse(page, headers=PAGE_HEADERS)
        names = [m.name for m in self.profile.models]
        phases = await asyncio.gather(*(self.backend.model_phase(n) for n in names))
        return {"name": "serve_app", "version": release(),
                "models": {n: p.public() for n, p in zip(names, phases, strict=True)},
                "endpoints": ENDPOINTS, "status_page": "/"}

    @api.get("/status/{asset}")
    async def status_asset(self, asset: str) -> Response:
        if asset not in ASSETS:
            raise ApiError(404, f"no such file: /status/{asset}", type="not_found_error")
        return Response(_asset(asset), media_type=ASSETS[asset],
                        headers={"Cache-Control": "no-store"})

    @api.get("/v1/status")
    async def status(self) -> dict:
        """The page's data: ``/v1/stats`` pruned to what it shows, at the same paths."""
        return status_view(await self.stats())

    # ---- controls -------------------------------------------------------------------

    def _admin_model(self, request: Request, name: str) -> str:
        _admin(request)
        return self.model_of(name).name

    def _pool_entry(self, name: str) -> dict[str, Any]:
        report = self.backend.pool_report() or {"models": {}}
        return {"model": name, **report["models"].get(name, {})}

    @api.post("/admin/models/{name:path}/load")
    async def admin_load(self, request: Request, name: str) -> dict:
        """Load a model now (unloading idle ones to make room, as a request would)."""
        await self.backend.load_model(self._admin_model(request, name))
        return self._pool_entry(name)

    @api.post("/admin/models/{name:path}/unload")
    async def admin_unload(self, request: Request, name: str) -> dict:
        """Unload a model now: 409 while it is pinned or serving a request."""
        await self.backend.unload_model(self._admin_model(request, name))
        return self._pool_entry(name)

    @api.post("/admin/models/{name:path}/pin")
    async def admin_pin(self, request: Request, name: str) -> dict:
        """Pin a model (loading it first): the pool never unloads it while pinned."""
        name = self._admin_model(request, name)
        was_pinned = bool(self._pool_entry(name).get("pinned"))
        self.backend.pin_model(name, True)  # first: nothing evicts it once loaded
        try:
            await self.backend.load_model(name)
        except BaseException:
            if not was_pinned:
                self.backend.pin_model(name, False)
            raise
        return self._pool_entry(name)

    @api.post("/admin/models/{name:path}/unpin")
    async def admin_unpin(self, request: Request, name: str) -> dict:
        self.backend.pin_model(self._admin_model(request, name), False)
        return self._pool_entry(name)

    @api.post("/admin/models/{name:path}/cache/clear")
    async def admin_clear_cache(self, request: Request, name: str) -> dict:
        """Forget a model's cached prefixes in every tier on every node; its next
        requests prefill cold."""
        cleared = await self.backend.clear_cache(self._admin_model(request, name))
        return {"model": name, "cleared": asdict(cleared)}

    @api.post("/admin/benchmark")
    async def admin_benchmark(self, request: Request) -> JSONResponse:
        """Run the self-benchmark: body ``{"model": NAME, "ssd_bytes": N}`` (both
        optional: the first loaded model, 256 MiB)."""
        _admin(request)
        raw = await read_body(request, MAX_ADMIN_BODY)
        name, ssd_bytes = _benchmark_args(parse_json(raw) if raw.strip() else {})
        if name is None:
            report = self.backend.pool_report()
            loaded = report["loaded"] if report else [m.name for m in self.profile.models]
            name = loaded[0] if loaded else self.profile.models[0].name
        name = self.model_of(name).name
        result = await self.backend.self_benchmark(name, ssd_bytes)
        return JSONResponse(result.to_json())


def _benchmark_args(body: Any) -> tuple[str | None, int]:
    from serve_app.serving.selfbench import MAX_SSD_BYTES, MIN_SSD_BYTES, SSD_BYTES

    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    unknown = sorted(set(body) - {"model", "ssd_bytes"})
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}; known: model, ssd_bytes",
                       param=unknown[0])
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "model: must be a string", param="model")
    ssd_bytes = body.get("ssd_bytes", SSD_BYTES)
    if (isinstance(ssd_bytes, bool) or not isinstance(ssd_bytes, int)
            or not MIN_SSD_BYTES <= ssd_bytes <= MAX_SSD_BYTES):
        raise ApiError(400, f"ssd_bytes: must be an integer from {MIN_SSD_BYTES} to "
                            f"{MAX_SSD_BYTES}", param="ssd_bytes")
    return name, ssd_bytes
