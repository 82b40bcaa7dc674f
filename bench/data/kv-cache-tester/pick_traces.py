"""Rebuild ``traces.json`` from a checkout of github.com/callanjfox/kv-cache-tester.

    python bench/data/kv-cache-tester/pick_traces.py /path/to/kv-cache-tester [--git-dir]

Keeps the traces named in ``TRACES`` (main-agent requests only, each request extending
the previous one's prefix), their first ``MAX_REQUESTS`` requests, and only the fields
``bench.traces`` uses; ``hash_ids`` are written as runs ``[first, count]`` of
consecutive ids (``[[1, 3], [9, 2]]`` is ``[1, 2, 3, 9, 10]``), which keeps the file small.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TRACES = ("0002", "0006", "0012", "0015", "0021", "0024", "0260", "0263", "0266", "0292",
          "0569", "0601")
MAX_REQUESTS = 16
FIELDS = ("t", "type", "in", "out", "think_time", "input_types")


def runs(ids: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in ids:
        if out and out[-1][0] + out[-1][1] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def read(source: Path, name: str, git_dir: bool) -> dict:
    if git_dir:
        text = subprocess.run(["git", f"--git-dir={source}", "show", f"HEAD:traces/{name}"],
                              check=True, capture_output=True, text=True).stdout
    else:
        text = (source / "traces" / name).read_text()
    return json.loads(text)


def main() -> int:
    source, git_dir = Path(sys.argv[1]), "--git-dir" in sys.argv
    traces = []
    for number in TRACES:
        d = read(source, f"trace_{number}.json", git_dir)
        requests = [{**{k: r[k] for k in FIELDS if k in r}, "hash_ids": runs(r["hash_ids"])}
                    for r in d["requests"][:MAX_REQUESTS]]
        traces.append({"id": d["id"], "file": f"traces/trace_{number}.json",
                       "block_size": d["block_size"], "system_tokens": d["system_tokens"],
                       "tool_tokens": d["tool_tokens"], "requests": requests})
    out = Path(__file__).with_name("traces.json")
    out.write_text(json.dumps({
        "source": "https://github.com/callanjfox/kv-cache-tester",
        "license": "Apache-2.0 (see LICENSE in this directory)",
        "note": f"first {MAX_REQUESTS} requests of each trace; fields {', '.join(FIELDS)} and "
                "hash_ids as runs [first, count] of consecutive ids",
        "traces": traces}, separators=(",", ":")) + "\n")
    print(out, out.stat().st_size, "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
