"""The README stays one screen and runs the default profile with the one command (the
strict docs build is tests/integration/test_docs_build.py)."""

from __future__ import annotations

from tests.support import REPO

README_MAX_LINES = 200
RUN_COMMAND = ("python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . && "
               "serve run configs/qwen.yaml")


def test_readme_is_one_screen():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move reference "
        "material into docs/")


def test_readme_runs_the_default_profile_with_the_one_command():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Run it"):readme.index("## Test it")]
    assert f"```bash\n{RUN_COMMAND}\n```" in section
