"""Made-up benchmark results (the report's and the runner's tests): JSON files as the
benches write them, and the report's table read back."""

from __future__ import annotations

import json
from pathlib import Path


def write(directory: Path, name: str, data: dict) -> None:
    (directory / name).write_text(json.dumps(data))


def outputs(identical: int, requests: int) -> dict:
    return {"requests": requests, "identical": identical,
            "all_identical": identical == requests, "mismatches": []}


def multiturn() -> dict:
    turns = [{"turn": i + 1, "ttft_ours": 1.0 if i == 0 else 0.1, "ttft_ours_cold": 1.0 + i,
              "ttft_mlx_lm_server": 1.0 if i == 0 else 0.2} for i in range(6)]
    return {"model": "tiny-hybrid", "turns": turns,
            "ttft_sum_turns_2_on": {"ours": 0.5, "ours_cold": 20.0, "mlx_lm_server": 1.0},
            "ratio_vs_mlx_lm_server": 0.5, "vs_mlx_lm_server_outputs": outputs(6, 6)}


def table(markdown: str) -> dict[tuple[str, str, str], list[str]]:
    """Summary rows by (bench, model, metric): [ours, mlx-lm, ratio, goal, status]."""
    section = markdown.split("## Summary", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines()[4:]:
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[tuple(cells[:3])] = cells[3:]
    return rows
