"""The API keys and models of the authentication tests (unit and over HTTP)."""

from __future__ import annotations

DENSE = "auth-dense"
HYBRID = "auth-hybrid"
BS = 16
# Two keys in the environment, a third in the key file; never in a log or a body.
KEY_A = "sk-auth-test-key-a-6f1d2e3c4b5a69788796"
KEY_B = "sk-auth-test-key-b-0a1b2c3d4e5f60718293"
KEY_FILE_KEY = "sk-auth-test-key-file-9e8d7c6b5a4f3e2d"
WRONG = "sk-auth-test-not-a-key-1234567890abcdef"
ADMIN_KEY = "sk-auth-test-admin-key-7c6b5a493827160f"
MODELS = [
    # No isolate_by_api_key here: keys being on must isolate by themselves.
    {"name": DENSE, "source": "embedded:tiny-dense", "context_length": 1024,
     "max_tokens": 64, "cache": {"block_size": BS}},
    # Prefix-routed: prepared (and keyed) in the ingress, for the router.
    {"name": HYBRID, "source": "embedded:tiny-hybrid", "context_length": 1024,
     "max_tokens": 64, "cache": {"block_size": BS}, "routing": {"mode": "prefix"}},
]
