"""What the tests share: one home for each helper (no test imports another test module)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root (the folder with pyproject.toml)."""
