"""The package's layers, checked from the source: imports only point down.

``api`` (wire formats and HTTP) sits on ``serving`` (prepare, service, engine), which
sits on ``cache``; ``cluster`` (routing, the local cluster, replica reports) uses
``serving`` and ``cache``. ``models`` (materializing a real model, its load phases) and
``cli`` (the user's commands) stay out of the serving path. The modules at the top level
are the edges every layer may use (the profile, metrics, compat, the embedded models,
chat templates) or the assembly of them all (``app``, ``__main__``, ``gc``). A module-level
import against the arrows fails here; imports under ``TYPE_CHECKING`` are annotations only
and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "serve_app"
# Each layer and the layers it must not import.
FORBIDDEN = {
    "cache": {"serving", "api", "cluster"},
    "serving": {"api", "cluster"},
    "api": {"cluster"},
    "cluster": {"api"},
    "models": {"cache", "serving", "api", "cluster"},
    "cli": {"cache", "serving", "api", "cluster"},
}
# used by all
EDGES = {"profile", "metrics", "compat", "embedded", "validation", "replicas", "chat_templates"}
ASSEMBLY = {"app", "__main__", "gc"}  # they put the layers together: only each other use them
# The profile is the YAML schema of every layer, checked when it loads: it names the prompt
# normalization rules the serving layer has, and reads an API keys file as the ingress will.
ALLOWED = {("profile", "serve_app.serving.normalize"), ("profile", "serve_app.api.auth")}


def module_imports(path: Path) -> list[str]:
    """``serve_app`` modules imported at module level (not under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                if sub.module == "serve_app":
                    found += [f"serve_app.{a.name}" for a in sub.names]
                elif sub.module.startswith("serve_app."):
                    found.append(sub.module)
            elif isinstance(sub, ast.Import):
                found += [a.name for a in sub.names if a.name.startswith("serve_app.")]
    return found


def layer_of(module: str) -> str:
    """``serve_app.cache.tiers`` -> ``cache``; a top-level module is its own name."""
    return module.split(".")[1]


MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


def test_the_layers_exist():
    assert {p.parent.name for p in MODULES} >= {"serve_app", "api", "serving", "cache", "cluster"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_point_down(path: Path):
    layer = path.parent.name if path.parent != PACKAGE else None
    for module in module_imports(path):
        target = layer_of(module)
        if (path.stem, module) in ALLOWED:
            continue
        if target in ASSEMBLY:
            assert layer is None and path.stem in ASSEMBLY, f"{path.name} imports {module}"
        if layer is not None:
            assert target not in FORBIDDEN[layer], f"{layer}/{path.name} imports {module}"
        elif path.stem in EDGES:
            assert target in EDGES or target in ("cache", "models"), (
                f"the edge {path.name} imports {module}: edges sit below the layers")
