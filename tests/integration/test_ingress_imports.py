"""The ingress prepares requests without MLX: importing the preparer loads none of it.

Run in a fresh interpreter, since this one has MLX loaded by other tests.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = ["serve_app.serving.prepare", "serve_app.serving.sampling", "serve_app.cache.prefix",
        "serve_app.serving.structured", "serve_app.api.openai_api"]


@pytest.mark.parametrize("module", PURE)
def test_importing_loads_no_mlx(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"
