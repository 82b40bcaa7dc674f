"""API keys without a server: digests compared, admin keys from the environment and the
key file, the middleware keeping the controls to admin keys and answering before it reads
a body, and the builder handing on digests only (the HTTP end to end is
tests/integration/test_auth_http.py)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.api import auth
from serve_app.config import api_keys
from serve_app.config.profile import ProfileError, parse_profile
from serve_app.deploy.app import build_app, keyed_profile
from tests.support.auth_keys import ADMIN_KEY, KEY_A, KEY_B, KEY_FILE_KEY, MODELS, WRONG

# ---- without a server ---------------------------------------------------------------------


def test_api_keys_compare_every_digest():
    keys = auth.ApiKeys(api_keys.digest(k) for k in (KEY_A, KEY_B))
    assert keys.enabled and keys.allows(KEY_A) and keys.allows(KEY_B)
    assert not keys.allows("") and not keys.allows(WRONG) and not keys.allows(KEY_A + "x")
    assert not keys.allows(KEY_A[:-1])
    assert not auth.ApiKeys().enabled


def keys_of(environ: dict[str, str]) -> auth.ApiKeys:
    """The keys an ingress checks for this environment, as the builder reads them."""
    digests = api_keys.configured_digests(None, environ)
    return auth.ApiKeys(digests.api, digests.admin)


def test_admin_keys_are_api_keys_and_alone_may_use_the_controls(tmp_path):
    admin_file = tmp_path / "admin"
    admin_file.write_text(f"{KEY_FILE_KEY}\n")
    admin_file.chmod(0o600)
    digests = api_keys.configured_digests(
        None, {api_keys.ENV_VAR: KEY_A, api_keys.ADMIN_ENV_VAR: KEY_B},
        admin_file=str(admin_file))
    assert set(digests.admin) == {api_keys.digest(KEY_B), api_keys.digest(KEY_FILE_KEY)}
    assert set(digests.api) == {api_keys.digest(k) for k in (KEY_A, KEY_B, KEY_FILE_KEY)}
    keys = auth.ApiKeys(digests.api, digests.admin)
    assert keys.admin_enabled and all(keys.allows(k) for k in (KEY_A, KEY_B, KEY_FILE_KEY))
    assert keys.is_admin(KEY_B) and keys.is_admin(KEY_FILE_KEY)
    assert not keys.is_admin(KEY_A) and not keys.is_admin(WRONG) and not keys.is_admin("")
    # Admin keys alone turn keys on (the admins are the only callers).
    alone = keys_of({api_keys.ADMIN_ENV_VAR: KEY_B})
    assert alone.enabled and alone.allows(KEY_B) and not alone.allows(KEY_A)
    # Without admin keys every API key may use the controls.
    plain = auth.ApiKeys([api_keys.digest(KEY_A)])
    assert not plain.admin_enabled and plain.is_admin(KEY_A) and not plain.is_admin(WRONG)
    with pytest.raises(api_keys.ApiKeyError, match=api_keys.ADMIN_ENV_VAR):
        api_keys.configured_digests(None, {api_keys.ADMIN_ENV_VAR: " , "})


def test_the_middleware_keeps_the_controls_to_admin_keys():
    auth.configure(keys_of({api_keys.ENV_VAR: KEY_A, api_keys.ADMIN_ENV_VAR: KEY_B}))
    try:
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        async def call(path: str, key: str | None, root: str = "") -> tuple[int, bytes]:
            sent = []

            async def receive():
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message):
                sent.append(message)

            headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
            scope = {"type": "http", "path": root + path, "root_path": root,
                     "method": "POST", "headers": headers, "query_string": b""}
            await auth.ApiKeyMiddleware(app)(scope, receive, send)
            return sent[0]["status"], sent[1]["body"]

        unload = "/admin/models/m/unload"
        status, body = asyncio.run(call(unload, KEY_A))
        assert status == 403 and b"admin_key_required" in body
        assert asyncio.run(call(unload, KEY_B))[0] == 200
        assert asyncio.run(call(unload, WRONG))[0] == 401
        assert asyncio.run(call(unload, None))[0] == 401
        assert asyncio.run(call("/v1/chat/completions", KEY_A))[0] == 200
        assert asyncio.run(call("/v1/chat/completions", KEY_B))[0] == 200
        assert asyncio.run(call("/v1/status", KEY_A))[0] == 200
        assert asyncio.run(call("/admin/benchmark", KEY_A))[0] == 403
        # Under a route prefix, whatever it is: a prefix comes off only at a "/" boundary
        # (as the router takes it off), so "/ad" never turns "/admin/..." into "min/...".
        for root in ("/llm", "/ad", "/a", "/admi", "/"):
            assert asyncio.run(call(unload, KEY_A, root))[0] == 403, root
            assert asyncio.run(call(unload, KEY_B, root))[0] == 200, root
        # Without admin keys, any API key may use the controls.
        auth.configure(auth.ApiKeys([api_keys.digest(KEY_A)]))
        assert asyncio.run(call(unload, KEY_A))[0] == 200
        assert asyncio.run(call(unload, WRONG))[0] == 401
    finally:
        auth.configure(auth.ApiKeys())


def test_the_controls_check_the_admin_key_themselves():
    """The routes' own check (``require_admin``), should a request reach a control past
    the middleware's check by path."""
    from serve_app.serving.request import ApiError

    auth.configure(keys_of({api_keys.ENV_VAR: KEY_A, api_keys.ADMIN_ENV_VAR: KEY_B}))
    try:
        auth.require_admin({"authorization": f"Bearer {KEY_B}"}, "/admin/x")
        auth.require_admin({"x-api-key": KEY_B}, "/admin/x")
        for headers, status in (({"authorization": f"Bearer {KEY_A}"}, 403),
                                ({"authorization": f"Bearer {WRONG}"}, 401), ({}, 401)):
            with pytest.raises(ApiError) as info:
                auth.require_admin(headers, "/admin/x")
            assert info.value.status == status
        auth.configure(auth.ApiKeys([api_keys.digest(KEY_A)]))
        auth.require_admin({"authorization": f"Bearer {KEY_A}"}, "/admin/x")
        auth.configure(auth.ApiKeys())
        auth.require_admin({}, "/admin/x")  # no keys at all: open, as every route
    finally:
        auth.configure(auth.ApiKeys())


def test_keys_from_the_environment():
    assert api_keys.keys_from_env({}) == []
    assert api_keys.keys_from_env({api_keys.ENV_VAR: f" {KEY_A} ,,{KEY_B}"}) == [KEY_A, KEY_B]
    for value in ("", " , ,"):  # set, but no key: never serve open by mistake
        with pytest.raises(api_keys.ApiKeyError, match="holds no key"):
            api_keys.keys_from_env({api_keys.ENV_VAR: value})
    with pytest.raises(api_keys.ApiKeyError, match="key 2 has characters") as info:
        api_keys.keys_from_env({api_keys.ENV_VAR: f"{KEY_A},bad key\u00e9"})
    assert "bad" not in str(info.value)  # an error never shows a key


def test_keys_on_isolate_every_models_cache_unless_shared():
    args = {"models": MODELS}
    profile = parse_profile(args)
    assert not any(m.cache.isolate_by_api_key for m in keyed_profile(profile, False).models)
    assert all(m.cache.isolate_by_api_key for m in keyed_profile(profile, True).models)
    shared = parse_profile({**args, "ingress": {"share_cache_between_keys": True}})
    assert not any(m.cache.isolate_by_api_key for m in keyed_profile(shared, True).models)


def test_the_builder_hands_on_digests_never_keys(tmp_path, monkeypatch):
    """What `serve run` deploys: the ingress's arguments hold the keys' digests, no key
    and no key-file path; every model replica's profile isolates by key."""
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE_KEY + "\n")
    key_file.chmod(0o600)
    admin_file = tmp_path / "admin"
    admin_file.write_text(ADMIN_KEY + "\n")
    admin_file.chmod(0o600)
    monkeypatch.setenv(api_keys.ENV_VAR, f"{KEY_A},{KEY_B}")
    app = build_app({"models": MODELS, "ingress": {"api_keys_file": str(key_file),
                                                   "admin_keys_file": str(admin_file)}})
    profile, handles, digests, plan = app._bound_deployment.init_args
    assert sorted(digests.api) == sorted(api_keys.digest(k)
                                         for k in (KEY_A, KEY_B, KEY_FILE_KEY, ADMIN_KEY))
    assert digests.admin == (api_keys.digest(ADMIN_KEY),)
    assert profile.ingress.api_keys_file is None and profile.ingress.admin_keys_file is None
    assert all(m.cache.isolate_by_api_key for m in profile.models)
    for handle in handles.values():
        assert handle._bound_deployment.init_args[0].cache.isolate_by_api_key
    text = repr([profile, digests, plan]
                + [h._bound_deployment.init_args for h in handles.values()])
    assert not any(k in text for k in (KEY_A, KEY_B, KEY_FILE_KEY, ADMIN_KEY, str(key_file),
                                       str(admin_file)))
    # Set but empty, or a key file others can read: no deploy (never served open).
    monkeypatch.setenv(api_keys.ENV_VAR, " ")
    with pytest.raises(ProfileError, match="holds no key"):
        build_app({"models": MODELS})
    monkeypatch.delenv(api_keys.ENV_VAR)
    key_file.chmod(0o644)
    with pytest.raises(ProfileError, match="mode 0644"):
        build_app({"models": MODELS, "ingress": {"api_keys_file": str(key_file)}})
    admin_file.chmod(0o640)
    with pytest.raises(ProfileError, match="admin key file .* has mode 0640"):
        build_app({"models": MODELS, "ingress": {"admin_keys_file": str(admin_file)}})
    # No keys: nothing changes.
    profile, _, digests, _ = build_app({"models": MODELS})._bound_deployment.init_args
    assert digests == api_keys.KeyDigests()
    assert not any(m.cache.isolate_by_api_key for m in profile.models)


def test_no_keys_logs_one_warning(caplog):
    with caplog.at_level("INFO", logger="ray.serve"):
        auth.ApiKeys().log_startup()
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "WITHOUT authentication" in record.message


def test_the_middleware_answers_before_reading_the_body():
    """401 for the route's API without one receive(): an unauthenticated body is never read."""
    auth.configure(auth.ApiKeys([api_keys.digest(KEY_A)]))
    try:
        reached: list[str] = []

        async def app(scope, receive, send):
            reached.append(scope["path"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        async def call(path: str, headers: list[tuple[bytes, bytes]]):
            received, sent = [], []

            async def receive():
                received.append(1)
                return {"type": "http.request", "body": b"x" * 1024, "more_body": True}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "path": path, "root_path": "", "method": "POST",
                     "headers": headers, "query_string": b""}
            await auth.ApiKeyMiddleware(app)(scope, receive, send)
            return received, sent

        received, sent = asyncio.run(call("/v1/messages", []))
        assert received == [] and sent[0]["status"] == 401 and reached == []
        assert b"authentication_error" in sent[1]["body"]
        received, sent = asyncio.run(call("/health", []))
        assert sent[0]["status"] == 200 and reached == ["/health"]
        received, sent = asyncio.run(call("/v1/chat/completions",
                                          [(b"authorization", f"Bearer {KEY_A}".encode())]))
        assert sent[0]["status"] == 200
    finally:
        auth.configure(auth.ApiKeys())
