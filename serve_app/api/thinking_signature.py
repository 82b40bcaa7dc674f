"""Signatures on the thoughts this server sends (Anthropic ``thinking`` blocks, Responses
``encrypted_content``), so a thought sent back in history is known to be the model's own.

A thought in history is rendered into the next prompt as the model's words: a client
could otherwise put words in the model's mouth there. Each signature is an HMAC-SHA256
over the model's name and the thought's text with the server's key: from
``SERVE_APP_THINKING_KEY`` when set (every ingress of a cluster must share it), else from
a key file created once (mode 0600) in the serve_app home, so a restarted server still
verifies the blocks its clients resend (Claude Code and Codex resend every thought of a
session). The model's name travels in the signature: a thought of another model served
here verifies too.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from serve_app.config.paths import default_home
from serve_app.serving.request import ApiError

KEY_ENV = "SERVE_APP_THINKING_KEY"
KEY_FILE = "thinking.key"
_VERSION = 1
_DOMAIN = b"serve_app thinking v1\0"


@dataclass(frozen=True)
class SignedThought:
    """A thought sent back in history with its signature, and where it was
    (``param``: the request field a 400 names)."""

    param: str
    text: str
    model: str
    mac: str


@dataclass(frozen=True)
class ThoughtSigner:
    """Signs and verifies thoughts with one key."""

    key: bytes

    def mac(self, model: str, text: str) -> str:
        message = _DOMAIN + model.encode("utf-8", "surrogatepass") + b"\0" + text.encode(
            "utf-8", "surrogatepass")
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def signature(self, model: str, text: str) -> str:
        """An Anthropic thinking block's ``signature``."""
        return _encode({"v": _VERSION, "model": model, "mac": self.mac(model, text)})

    def encrypted_content(self, model: str, text: str) -> str:
        """A Responses reasoning item's ``encrypted_content``: the thought itself, signed
        (not secret: the same text is in the item's ``content``)."""
        return _encode({"v": _VERSION, "model": model, "text": text,
                        "mac": self.mac(model, text)})

    def verify(self, thought: SignedThought) -> None:
        """400 naming ``thought.param`` unless this server signed it."""
        if not hmac.compare_digest(thought.mac, self.mac(thought.model, thought.text)):
            raise forged(thought.param)


def forged(param: str) -> ApiError:
    return ApiError(400, f"{param}: the signature does not verify: this thought was not "
                         "produced by this server (or was altered, or the server's thinking "
                         "key changed); send the thought as this server returned it, or leave "
                         "it out", param=param, code="invalid_signature")


def _encode(fields: dict[str, object]) -> str:
    raw = json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode(value: str, param: str) -> dict:
    """A signature's (or encrypted content's) fields; 400 naming ``param`` when it is not
    one of ours at all."""
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        fields = json.loads(raw)
    except (ValueError, binascii.Error):
        fields = None
    if (not isinstance(fields, dict) or fields.get("v") != _VERSION
            or not isinstance(fields.get("model"), str) or not isinstance(fields.get("mac"), str)):
        raise ApiError(400, f"{param}: not a signature this server made", param=param,
                       code="invalid_signature")
    return fields


def signed_block(param: str, text: str, signature: str) -> SignedThought:
    """An Anthropic thinking block's thought and signature, to verify."""
    fields = _decode(signature, param)
    return SignedThought(param, text, fields["model"], fields["mac"])


def opened(param: str, encrypted_content: str) -> SignedThought:
    """A Responses ``encrypted_content``, opened (its text still to verify)."""
    fields = _decode(encrypted_content, param)
    if not isinstance(fields.get("text"), str):
        raise ApiError(400, f"{param}: not a signature this server made", param=param,
                       code="invalid_signature")
    return SignedThought(param, fields["text"], fields["model"], fields["mac"])


def load_key(home: Path | None = None) -> bytes:
    """The server's key: ``SERVE_APP_THINKING_KEY``'s (UTF-8) bytes when set, else the key
    file's, created with a random key the first time (by whichever process wins)."""
    env = os.environ.get(KEY_ENV)
    if env:
        return env.encode("utf-8")
    path = (home or default_home()) / KEY_FILE
    try:
        return _read(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    try:
        os.link(tmp, path)  # fails if another process made it first: its key wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return _read(path)


def _read(path: Path) -> bytes:
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"{path} is empty: delete it (a new key is made) or set {KEY_ENV}")
    return key.encode()


def server_signer() -> ThoughtSigner:
    """The ingress's signer (read once, when the ingress starts)."""
    return ThoughtSigner(load_key())
