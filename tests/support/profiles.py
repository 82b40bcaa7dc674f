"""A profile file as `serve run` takes it (the profile's unit and `check` tests)."""

from __future__ import annotations

from pathlib import Path

import yaml


def write(tmp_path: Path, args) -> Path:
    config = {
        "http_options": {"host": "127.0.0.1", "port": 8000},
        "applications": [{"name": "llm", "import_path": "serve_app.app:build_app", "args": args}],
    }
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
