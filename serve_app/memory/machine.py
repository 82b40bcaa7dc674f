"""What this machine has: its physical memory, this process's resident set, and giving
freed memory back to the OS.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class MachineMemory:
    """Physical memory, and on Metal the GPU's recommended working set (what MLX can keep
    wired; None elsewhere)."""

    total_bytes: int
    gpu_working_set_bytes: int | None = None

    @property
    def metal(self) -> bool:
        return self.gpu_working_set_bytes is not None


def physical_memory() -> int:
    """Bytes of physical memory (sysconf; ``sysctl hw.memsize`` on macOS if that fails)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        if sys.platform != "darwin":
            raise
    out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True,
                         check=True, timeout=5)
    return int(out.stdout.strip())


def probe_machine() -> MachineMemory:
    """This machine's memory; on Apple Silicon asks Metal for its working set."""
    total = physical_memory()
    if sys.platform != "darwin":
        return MachineMemory(total)
    try:
        import mlx.core as mx

        if not mx.metal.is_available():
            return MachineMemory(total)
        working = mx.device_info().get("max_recommended_working_set_size")
    except Exception:  # no MLX, or no Metal: the plan is advisory either way
        return MachineMemory(total)
    return MachineMemory(total, int(working) if working else None)


def trim_malloc() -> None:
    """glibc's ``malloc_trim(0)``; nothing elsewhere (macOS returns freed pages itself)."""
    import ctypes
    import ctypes.util

    if os.uname().sysname != "Linux":
        return
    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # a libc without it (musl)
        pass


def process_rss_bytes() -> int | None:
    """This process's resident memory (Linux ``/proc``; None elsewhere)."""
    try:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
