"""SSD wear: a rolling one-hour budget of bytes the SSD tier may write.

Every block the cache keeps on SSD is written once, and a busy server prefills a lot of
new tokens: Qwen3-8B's KV is 144 KiB a token, so 500 new tokens a second would write
about 260 GB an hour. Flash has a rated endurance; the cache must not spend it.

The default (``auto``) is derived from a typical SSD's rating. Consumer TLC drives are
rated for about 600 TB written per TB of capacity over a five-year warranty (Samsung 990
Pro and WD SN850X 1 TB: 600 TBW; Apple publishes no figure for Mac SSDs). We give the
cache half of that if it wrote its whole budget eight hours a day, every day, for five
years: 0.5 x 600 x capacity / (5 x 365 x 8 h) ~ 2% of the capacity an hour, 20 GB an
hour on a 1 TB drive (5 GB on 256 GB, 41 GB on 2 TB). Writing the full budget around the
clock would reach the drive's whole rating in about 3.3 years; real caches write in
bursts. Writes over the budget are dropped (never half-written) and counted, so the
cost is a later miss, not a worn drive.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

WINDOW_S = 3600.0
RATED_DRIVE_WRITES = 600  # TB written per TB of capacity over the warranty (typical TLC)
CACHE_SHARE = 0.5  # of that rating, for the cache
LIFETIME_HOURS = 5 * 365 * 8  # five years of eight-hour days
AUTO_FRACTION_PER_HOUR = RATED_DRIVE_WRITES * CACHE_SHARE / LIFETIME_HOURS  # ~0.0205
AUTO_MIN_BYTES = 1 << 30  # a tiny volume still lets the cache write something


def auto_write_budget(root: Path) -> int:
    """``ssd_write_budget_per_hour: auto`` for the volume that holds ``root``."""
    path = Path(root)
    while not path.exists() and path != path.parent:  # the directory may not exist yet
        path = path.parent
    total = shutil.disk_usage(path).total
    return max(int(total * AUTO_FRACTION_PER_HOUR), AUTO_MIN_BYTES)


class RollingByteBudget:
    """At most ``limit_bytes`` taken in any ``window_s`` seconds. Thread-safe.

    Takes are kept per second of the clock (at most ``window_s`` entries), so the
    window slides smoothly without one entry per write.
    """

    def __init__(self, limit_bytes: int, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_bytes = limit_bytes
        self.window_s = window_s
        self._clock = clock
        self._taken: deque[list[int]] = deque()  # [second, bytes], oldest first
        self._used = 0
        self._lock = threading.Lock()

    def _expire(self, now: float) -> None:
        while self._taken and self._taken[0][0] <= now - self.window_s:
            self._used -= self._taken.popleft()[1]

    def try_take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit in the window; False (nothing taken) if not."""
        with self._lock:
            now = self._clock()
            self._expire(now)
            if self._used + nbytes > self.limit_bytes:
                return False
            second = int(now)
            if self._taken and self._taken[-1][0] == second:
                self._taken[-1][1] += nbytes
            else:
                self._taken.append([second, nbytes])
            self._used += nbytes
            return True

    def give_back(self, nbytes: int) -> None:
        """Return bytes taken for a write that did not happen (newest first)."""
        with self._lock:
            while nbytes > 0 and self._taken:
                last = self._taken[-1]
                n = min(nbytes, last[1])
                last[1] -= n
                self._used -= n
                nbytes -= n
                if last[1] <= 0:
                    self._taken.pop()

    def used(self) -> int:
        """Bytes taken in the last window."""
        with self._lock:
            self._expire(self._clock())
            return self._used
