"""The unit layer's guard: a unit test may not start a process or reach past loopback.

It wraps the few calls every way of starting a process goes through (``subprocess``,
``multiprocessing``, ``os.system``, ``ray.init``'s own daemons all end in one of them) and the
socket calls that reach an address; a test that makes one fails with what it tried."""

from __future__ import annotations

import _posixsubprocess
import ipaddress
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest


class Forbidden(AssertionError):
    """A unit test tried what only the integration layers may do."""


def _is_loopback(address: Any) -> bool:
    if isinstance(address, (str, bytes)):  # AF_UNIX path
        return True
    if not isinstance(address, tuple) or not address:
        return True
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@contextmanager
def no_processes_no_network(record: Callable[[str], None] | None = None) -> Iterator[None]:
    """Within the block, starting a process or reaching a non-loopback address raises
    :class:`Forbidden` (or, given ``record``, is reported to it and goes on)."""

    def refuse(what: str) -> None:
        if record is not None:
            record(what)
            return
        raise Forbidden(f"a unit test may not {what}: move it to tests/integration")

    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def process(what: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                refuse(f"start a process ({what})")
                return original(*args, **kwargs)
            return wrapped
        return make

    def reach(what: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def wrapped(sock: socket.socket, address: Any, *args: Any) -> Any:
                if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(address):
                    refuse(f"{what} {address!r}")
                return original(sock, address, *args)
            return wrapped
        return make

    patch(_posixsubprocess, "fork_exec", process("fork_exec"))
    patch(subprocess, "_fork_exec", process("subprocess"))  # it keeps its own reference
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            patch(os, name, process(f"os.{name}"))
    for name in ("connect", "connect_ex", "bind"):
        patch(socket.socket, name, reach(name))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


@contextmanager
def guarded(item: pytest.Item) -> Iterator[None]:
    """The guard around one test's setup, call and teardown (a module fixture that starts a
    server counts against the first test that asks for it)."""
    record = os.environ.get("SERVE_APP_GUARD_RECORD")
    if record:
        def note(what: str) -> None:
            with open(record, "a") as out:
                out.write(f"{item.nodeid}\t{what}\n")
        with no_processes_no_network(note):
            yield
    else:
        with no_processes_no_network():
            yield
