"""The docs site builds without a broken link or anchor, and the README stays one screen
whose links all land somewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

README_MAX_LINES = 200
RUN_COMMAND = ("python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . && "
               "serve run configs/qwen.yaml")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """``mkdocs build --strict`` into a temporary directory (never the checkout's site/)."""
    pytest.importorskip("material", reason="mkdocs-material is in the test extra: "
                                           "pip install -e '.[test]'")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out


def test_readme_is_one_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference "
        "material into docs/")


def test_readme_runs_the_default_profile_with_the_one_command():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Run it"):readme.index("## Test it")]
    assert f"```bash\n{RUN_COMMAND}\n```" in section
