"""``serve-app status``: what a running server is doing, read from its own endpoints.

``/v1/models`` (each model's phase), ``/v1/stats`` (memory, requests, the prefix cache) and
``/health``; plain urllib, so it runs anywhere the package is installed. Exit 0 when every
model serves, 1 when one does not (loading, failed), 2 when the server cannot be reached.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from serve_app.memory.plan import fmt_bytes

KEY_ENV = "SERVE_APP_API_KEY"


class Unreachable(Exception):
    """The server did not answer (the message says how to start one)."""


def fetch(url: str, key: str | None, timeout: float = 10.0) -> dict:
    """GET ``url`` as JSON; an HTTP error's JSON body too (503 while loading)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            return {"_status": exc.code, **json.loads(exc.read())}
        except ValueError:
            return {"_status": exc.code}
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise Unreachable(f"no server answers at {url} ({exc}); start one with "
                          "`serve-app serve embedded:smollm2-135m` or "
                          "`serve run configs/qwen.yaml`") from None


def _phase(entry: dict) -> str:
    phase = entry.get("phase") or entry.get("status") or "?"
    progress = entry.get("progress")
    if progress:
        done, total = progress.get("done_bytes", 0), progress.get("total_bytes") or 1
        phase += f" {fmt_bytes(done)} of {fmt_bytes(total)} ({100 * done // total}%)"
    if entry.get("reason"):
        phase += f": {entry['reason']}"
    return phase


def _model_lines(name: str, stats: dict | None, plan: dict | None) -> list[str]:
    out = []
    if plan:
        out.append(f"    memory: weights {fmt_bytes(plan.get('weights_bytes', 0))}, KV up to "
                   f"{fmt_bytes(plan.get('kv_bytes', 0))}, hot-tier share "
                   f"{fmt_bytes(plan.get('hot_share_bytes', 0))}")
    if not stats:
        return out
    engine, cache = stats.get("engine", {}), stats.get("cache", {})
    out.append(f"    requests: {engine.get('in_flight', 0)} in flight, "
               f"{engine.get('finished', 0)} finished, {engine.get('rejected', 0)} rejected; "
               f"{engine.get('generated_tokens', 0)} tokens generated")
    if cache.get("enabled"):
        hit, missed = cache.get("hit_tokens", 0), cache.get("missed_tokens", 0)
        rate = 100 * hit / (hit + missed) if hit + missed else 0.0
        tiers = ", ".join(f"{k} {v}" for k, v in (cache.get("hit_tokens_by_tier") or {}).items())
        out.append(f"    prefix cache: {rate:.0f}% of prompt tokens from cache ({hit} of "
                   f"{hit + missed}{'; ' + tiers if tiers else ''})")
    else:
        out.append("    prefix cache: off")
    return out


def status(url: str, key: str | None = None) -> tuple[int, str]:
    """(exit code, the report) for the server at ``url``."""
    url = url.rstrip("/")
    key = key or os.environ.get(KEY_ENV)
    try:
        models = fetch(f"{url}/v1/models", key)
    except Unreachable as exc:
        return 2, f"error: {exc}"
    if models.get("_status") == 401:
        return 2, (f"error: {url} needs an API key: --api-key KEY or ${KEY_ENV}")
    stats = fetch(f"{url}/v1/stats", key)
    per_model = stats.get("models") or {}
    plans = ((stats.get("memory") or {}).get("plan") or {}).get("models") or {}
    lines = [f"serve_app at {url}"]
    serving = True
    for entry in models.get("data", []):
        name = entry["id"]
        phase = entry.get("phase") or ("ready" if entry.get("status") == "loaded" else
                                       entry.get("status"))
        serving = serving and phase in ("ready", "unloaded")
        lines.append(f"  {name}: {_phase(entry)} (context {entry.get('context_length')})")
        lines += _model_lines(name, per_model.get(name), plans.get(name))
    plan = (stats.get("memory") or {}).get("plan")
    if plan:
        lines.append(f"  memory plan: {fmt_bytes(plan['planned_bytes'])} of a "
                     f"{fmt_bytes(plan['budget_bytes'])} budget"
                     f"{' (advisory: no Metal GPU)' if plan.get('advisory') else ''}")
    return (0 if serving else 1), "\n".join(lines)
