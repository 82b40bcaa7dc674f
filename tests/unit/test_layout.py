"""The house by concern, checked from the source: packages in layers, imports pointing down.

Each package of ``serve_app`` has a rank (``RANKS``); a module may import its own package
and packages of a lower rank only. ``api`` and ``cluster`` share a rank and do not import
each other, nor do ``cache`` and ``parallel``. Imports under ``if TYPE_CHECKING`` are
annotations, not dependencies, and do not count; imports inside functions do. The package
graph has no cycle, the top of the package holds at most three modules, and no module is
over ``MAX_LINES``.
"""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

from tests.support import REPO

PACKAGE = REPO / "serve_app"
RANKS = {
    "config": 0,   # the YAML profile and its checks, user directories, the model catalog
    "models": 1,   # materializing models, the compat seam over mlx-lm's and Ray's internals
    "kvquant": 1,  # quantized K/V: the format, packing, the batch caches
    "cache": 2,    # the prefix cache: hashing, codecs, tiers, the SSD store, the manager
    "parallel": 2,  # one model over several ranks: what splits, the group, the commands
    "reasoning": 2,  # thinking models: markers, the thought/answer split, the budget
    "multimodal": 2,  # images: decoding, the processor, the vision tower, the splice
    "pooling": 2,  # embeddings and reranking: encoders, pooling, scores
    "memory": 3,   # what models need and machines have; the plan
    "metrics": 4,  # the one metrics table, recording, samples
    "serving": 5,  # preparing requests, the engine, the model service
    "api": 6,      # wire formats: OpenAI, Anthropic, Responses, the HTTP app
    "cluster": 6,  # the block directory, prefix routing, replica reports
    "store": 7,    # the cache-store actor and its client (Ray glue)
    "deploy": 8,   # Ray Serve deployments: builder, ingress, replicas, model pool
    "cli": 9,      # the user's commands
    "": 10,        # serve_app.__main__ and the serve_app.app entry point
}
TOP_LEVEL = {"__init__.py", "__main__.py", "app.py"}
MAX_LINES = 600
MODULES = sorted(PACKAGE.rglob("*.py"))


def package_of(module: str) -> str:
    """``serve_app.cache.ssd.store`` -> ``cache``; a top-level module -> ``""``."""
    parts = module.split(".")
    if len(parts) == 2 and (PACKAGE / f"{parts[1]}.py").exists():
        return ""
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path) -> list[str]:
    """The ``serve_app`` modules ``path`` imports, not counting ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in tree.body if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found: list[str] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "serve_app":
                found += [f"serve_app.{a.name}" for a in node.names]
            elif node.module.startswith("serve_app."):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("serve_app.")]
    return found


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {p: set() for p in RANKS}
    for path in MODULES:
        source = package_of(module_name(path))
        graph[source] |= {package_of(m) for m in imports_of(path)} - {source}
    return graph


def test_every_package_has_a_rank():
    packages = {package_of(module_name(p)) for p in MODULES}
    assert packages == set(RANKS), packages ^ set(RANKS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path):
    source = package_of(module_name(path))
    for module in imports_of(path):
        target = package_of(module)
        if target == source or module == "serve_app.__version__":
            continue
        assert RANKS[target] < RANKS[source], (
            f"{path.relative_to(PACKAGE)} ({source or 'top level'}, rank {RANKS[source]}) "
            f"imports {module} ({target}, rank {RANKS[target]}): imports point down only")


def test_the_packages_form_no_cycle():
    list(graphlib.TopologicalSorter(package_graph()).static_order())  # raises CycleError


def test_the_check_sees_an_upward_import_and_a_cycle(tmp_path):
    """The checks above can fail: an import of the engine by the cache is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from serve_app.api.http import api\n"
                   "def f():\n    from serve_app.serving.engine import Engine\n")
    assert imports_of(bad) == ["serve_app.serving.engine"]
    assert RANKS[package_of("serve_app.serving.engine")] > RANKS["cache"]
    with pytest.raises(graphlib.CycleError):
        cycle = {"cache": {"serving"}, "serving": {"cache"}}
        list(graphlib.TopologicalSorter(cycle).static_order())


def test_at_most_three_modules_at_the_top():
    top = {p.name for p in PACKAGE.glob("*.py")}
    assert top <= TOP_LEVEL, top - TOP_LEVEL


def test_the_architecture_page_names_every_module_once():
    """docs/architecture.md has one line per module (``- `path` — what it is``): a module
    added, moved or removed is a page to update."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    listed = re.findall(r"^- `([\w/]+\.py)` — ", page, re.M)
    modules = sorted(str(p.relative_to(PACKAGE)) for p in MODULES if p.name != "__init__.py")
    assert sorted(listed) == modules, (set(listed) ^ set(modules))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_the_line_limit(path: Path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)}: {lines} lines; split it by job"
