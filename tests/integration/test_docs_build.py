"""The docs site builds (``mkdocs build --strict``: no broken link or anchor), and every
relative link of the README lands on a file or a built page's anchor (the README's own
length and commands: tests/unit/test_docs.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO


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


def test_mkdocs_build_strict_passes(site):
    assert (site / "index.html").exists()
    for page in (REPO / "docs").glob("*.md"):
        name = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert (site / name).exists(), f"{page.name} is not in the built site"


def test_readme_links_land(site):
    """Every relative link of the README names a file that exists, and a link into a docs
    page's heading names an anchor the built page has (mkdocs does not read the README)."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local)
    for link in local:
        path, _, anchor = link.partition("#")
        assert (REPO / path).exists(), link
        if anchor and path.startswith("docs/") and path.endswith(".md"):
            stem = Path(path).stem
            html = (site / ("index.html" if stem == "index" else f"{stem}/index.html"))
            assert f'id="{anchor}"' in html.read_text(), link
