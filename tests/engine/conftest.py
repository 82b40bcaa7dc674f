"""Fixtures of the engine layer: a model home per module, and the models of
:func:`tests.support.formats.load` closed after each module."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.formats import close_loaded


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """Where this module's embedded models are materialized."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module", autouse=True)
def _close_loaded_models():
    """The cold services a module loaded stop with it, whatever order modules run in."""
    yield
    close_loaded()
