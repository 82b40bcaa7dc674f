"""The README's commands are the ones that run; the docs' fault table names real tests."""

from __future__ import annotations

import re

from tests.support import REPO


def test_ci_runs_exactly_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Test it"):readme.index("## Talk to it")]
    (command,) = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert (REPO / ".ci" / "run").read_text().rstrip().splitlines()[-1] == command


def test_fault_table_names_tests_that_exist():
    """Every test the fault table (docs/faults.md) cites exists (a renamed test breaks this)."""
    section = (REPO / "docs" / "faults.md").read_text()
    cited = re.findall(r"`(\w+/test_\w+)::(test_\w+)(?:\[[^\]]*\])?`", section)
    assert len(cited) > 20
    for module, name in cited:
        source = (REPO / "tests" / f"{module}.py").read_text()
        assert f"def {name}(" in source, f"{module}::{name}"
