"""``python -m serve_app gc``: report and clean an SSD cache directory.

Needs neither MLX nor a model: it reads file headers only. A dry run reports
entries, bytes by model, orphans (sidecars whose block is gone), temporary
files left by a crash and what is over budget; ``--apply`` deletes exactly
that, and refuses while a server holds the directory unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serve_app.cache.ssd import SSDStore, default_cache_dir


def parse_size(text: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


def report(store: SSDStore, budget_given: bool) -> dict:
    snap = store.snapshot()
    over = store.over_budget() if budget_given else []
    return {
        "dir": snap["dir"],
        "blocks": snap["blocks"],
        "sidecars": snap["sidecars"],
        "block_bytes": snap["block_bytes"],
        "sidecar_bytes": snap["sidecar_bytes"],
        "bytes_by_model": snap["by_model"],
        "orphans": [str(e.path) for e in store.orphans()],
        "temp_files": [str(p) for p in store.temp_files],
        "foreign_files": snap["foreign_files"],
        "budget_bytes": store.budget_bytes if budget_given else None,
        "over_budget": [str(e.path) for e in over],
        "over_budget_bytes": sum(e.nbytes for e in over),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="serve_app gc")
    parser.add_argument("--dir", type=Path, default=None, help="cache directory")
    parser.add_argument("--budget", type=parse_size, default=None,
                        help="delete least recently used files above this size (e.g. 20GB)")
    parser.add_argument("--apply", action="store_true", help="delete what the report lists")
    parser.add_argument("--force", action="store_true", help="even while a server uses it")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    root = (args.dir or default_cache_dir()).expanduser()
    if not (root / "v1").is_dir():
        print(f"no cache directory at {root}")
        return 0
    store = SSDStore(root, args.budget if args.budget is not None else 1 << 62)
    store.open(clean=False)
    before = report(store, args.budget is not None)
    result = {"dry_run": not args.apply, **before}
    if args.apply:
        if store.directory_in_use() and not args.force:
            print(f"refusing: a server is using {root} (stop it, or pass --force)")
            return 3
        for entry in store.orphans():
            store.remove(entry)
        for path in store.temp_files:
            store._unlink(path)
        if args.budget is not None:
            store.enforce_budget()
        after = store.snapshot()
        result["deleted"] = {
            "orphans": len(before["orphans"]),
            "temp_files": len(before["temp_files"]),
            "over_budget_files": store.stats.evictions,
            "bytes_left": after["block_bytes"] + after["sidecar_bytes"],
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result)
    return 0


def _print(r: dict) -> None:
    mode = "dry run (nothing deleted; --apply to delete)" if r["dry_run"] else "applied"
    print(f"cache directory {r['dir']}: {mode}")
    print(f"  {r['blocks']} blocks ({r['block_bytes']} bytes), "
          f"{r['sidecars']} sidecars ({r['sidecar_bytes']} bytes)")
    for model, m in r["bytes_by_model"].items():
        print(f"  model {model}: {m['block_bytes'] + m['sidecar_bytes']} bytes")
    print(f"  orphan sidecars: {len(r['orphans'])}, temporary files: {len(r['temp_files'])}, "
          f"files of other format versions: {r['foreign_files']}")
    if r["budget_bytes"] is not None:
        print(f"  over budget {r['budget_bytes']}: {len(r['over_budget'])} files, "
              f"{r['over_budget_bytes']} bytes")
    if "deleted" in r:
        d = r["deleted"]
        print(f"  deleted {d['orphans']} orphans, {d['temp_files']} temporary files, "
              f"{d['over_budget_files']} files over budget; {d['bytes_left']} bytes left")
