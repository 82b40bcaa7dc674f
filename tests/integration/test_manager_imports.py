"""The prefix cache's policy loads without MLX or Ray: a fresh Python imports
``serve_app.cache.manager`` and neither comes with it (the policy itself:
tests/unit/test_manager.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_policy_imports_neither_mlx_nor_ray():
    code = ("import sys, serve_app.cache.manager; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"
