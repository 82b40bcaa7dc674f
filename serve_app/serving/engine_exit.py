"""Engines parked before the interpreter finalizes: an MLX thread still running then would
be torn down mid-flight and abort the process."""

from __future__ import annotations

import atexit
import weakref
from typing import Any

_live: weakref.WeakSet = weakref.WeakSet()


def register(engine: Any) -> None:
    """Shut ``engine`` down (``engine.shutdown``) at exit if it still runs then."""
    _live.add(engine)


@atexit.register
def _park_engines() -> None:
    for engine in list(_live):
        engine.shutdown(timeout=5.0)
