"""This user's directories, in one place: where models are materialized, where the SSD
tier keeps blocks, where a local cluster's nodes keep theirs. Each honours its own
environment variable first, then ``$XDG_CACHE_HOME`` (else ``~/.cache``)."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SERVE_APP_HOME"  # materialized models, generated profiles (run/), logs
CACHE_DIR_ENV = "SERVE_APP_CACHE_DIR"  # the SSD tier of a one-node server


def user_cache_root() -> Path:
    """``$XDG_CACHE_HOME/serve_app`` (else ``~/.cache/serve_app``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "serve_app"


def default_home() -> Path:
    """Where materialized models live: ``$SERVE_APP_HOME`` or the user cache root."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else user_cache_root()


def default_cache_dir() -> Path:
    """The SSD tier's directory: ``$SERVE_APP_CACHE_DIR`` or ``kv`` in the cache root."""
    return Path(os.environ.get(CACHE_DIR_ENV) or user_cache_root() / "kv")


def default_ssd_root() -> Path:
    """A local cluster's nodes' SSD directories (beside the default ``kv``)."""
    return user_cache_root() / "cluster"
