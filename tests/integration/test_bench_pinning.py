"""bench.pinning on a real process tree: a node's raylet and what runs under it pinned."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

from bench.devserver import descendants
from bench.pinning import pin_node


def test_a_node_and_the_processes_under_it_are_pinned():
    """A child and its grandchild stand in for a raylet and its worker."""
    core = min(os.sched_getaffinity(0))
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(30)']); time.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while not descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        node = SimpleNamespace(all_processes={"raylet": [SimpleNamespace(process=parent)]})
        assert pin_node(node, (core,)) >= 2
        for pid in (parent.pid, *descendants(parent.pid)):
            assert os.sched_getaffinity(pid) == {core}
    finally:
        for pid in descendants(parent.pid):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()
