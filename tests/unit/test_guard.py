"""The unit layer's guard is on for every test here, and refuses what it says it refuses."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess

import pytest

from tests.support.guard import Forbidden, _is_loopback, no_processes_no_network


def test_a_unit_test_cannot_start_a_process():
    """This test runs under the guard (tests/conftest.py wraps every unit test)."""
    with pytest.raises(Forbidden, match="start a process"):
        subprocess.run(["true"], check=True)
    with pytest.raises(Forbidden, match="start a process"):
        os.system("true")


def test_a_unit_test_cannot_start_a_multiprocessing_child():
    ctx = multiprocessing.get_context("spawn")
    with pytest.raises(Forbidden, match="start a process"):
        ctx.Process(target=print).start()


def test_a_unit_test_may_not_listen_on_every_interface_but_may_on_loopback():
    with socket.socket() as s, pytest.raises(Forbidden, match="bind"):
        s.bind(("0.0.0.0", 0))
    with socket.socket() as listener, socket.socket() as s:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        s.connect(listener.getsockname())  # loopback is allowed


def test_only_loopback_addresses_pass():
    assert _is_loopback(("127.0.0.1", 80)) and _is_loopback(("::1", 80, 0, 0))
    assert _is_loopback(("localhost", 80)) and _is_loopback("/tmp/a.sock")
    assert not _is_loopback(("192.0.2.1", 80)) and not _is_loopback(("0.0.0.0", 80))
    assert not _is_loopback(("example.org", 80))


def test_the_guard_undoes_itself_and_can_record_instead_of_failing():
    before = (socket.socket.bind, subprocess._fork_exec, os.system)  # type: ignore[attr-defined]
    seen: list[str] = []
    with no_processes_no_network(seen.append), socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        assert seen == []
        with pytest.raises(Forbidden):  # recorded by this guard, refused by the test's own
            s.bind(("0.0.0.0", 0))
    assert len(seen) == 1 and "bind" in seen[0]
    assert (socket.socket.bind, subprocess._fork_exec, os.system) == before  # type: ignore[attr-defined]
