"""The prepare stage: where templating, tokenizing and grammar compiling run, off the
event loop, with a bound on the requests waiting for it (429 beyond it).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serve_app.serving.errors import queue_full_error

# Requests waiting for (or in) a prepare pool, where templating, tokenizing and grammar
# compiling run, beyond which a replica or the ingress answers 429 before doing any of it.
MAX_PREPARING = 16


class PrepareStage:
    """A prepare pool and the requests admitted to it, waiting or running: a request
    leaves when its work ends or is cancelled before it started (a caller that gave up
    on work already running still holds its place until the work ends)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="prepare")
        self.busy = 0
        self.runs = 0  # calls run (or queued) so far

    def admit(self, name: str) -> None:
        """429 ``queue_full`` when ``MAX_PREPARING`` requests are in the stage already."""
        if self.busy >= MAX_PREPARING:
            raise queue_full_error(f"model {name!r} is at capacity: {self.busy} requests are "
                                   f"waiting to be templated (at most {MAX_PREPARING}); "
                                   "retry shortly")

    async def run(self, fn: Any, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = self.pool.submit(fn, *args)
        self.busy += 1
        self.runs += 1
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._leave))
        return await asyncio.wrap_future(future)

    def _leave(self) -> None:
        self.busy -= 1
