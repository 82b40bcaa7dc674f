"""``python -m serve_app gc``: report and clean an SSD cache directory.

Needs neither MLX nor a model: it reads file headers only. A dry run reports
entries, bytes by model, orphans (sidecars whose block is gone), temporary
files left by a crash and what is over budget; ``--apply`` deletes exactly
that, and refuses while a server holds the directory unless ``--force``.
Both come from one plan (``plan``): the dry run lists it, ``--apply`` deletes
it and lists what it deleted.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_fs import untrusted_reason
from serve_app.config.paths import default_cache_dir


def parse_size(text: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


@dataclass(frozen=True)
class Doomed:
    """One file the plan deletes."""

    path: Path
    nbytes: int
    why: str  # "temp_file", "orphan" or "over_budget"


def plan(store: SSDStore, budget_given: bool) -> list[Doomed]:
    """Every file ``--apply`` deletes, each once, with its size: the dry run reports this list.

    Temporary files and orphan sidecars always; then, with a budget, what
    eviction would delete once the orphans are gone (a block with its sidecars).
    """
    doomed = []
    for path in store.temp_files:
        try:
            doomed.append(Doomed(path, path.lstat().st_size, "temp_file"))
        except OSError:  # gone meanwhile
            continue
    orphans = store.orphans()
    doomed += [Doomed(e.path, e.nbytes, "orphan") for e in orphans]
    if budget_given:
        doomed += [Doomed(e.path, e.nbytes, "over_budget")
                   for e in store.eviction_plan(gone=orphans)]
    return doomed


def report(store: SSDStore, budget_given: bool, doomed: list[Doomed]) -> dict:
    snap = store.snapshot()

    def paths(why: str) -> list[str]:
        return [str(d.path) for d in doomed if d.why == why]

    return {
        "dir": snap["dir"],
        "blocks": snap["blocks"],
        "sidecars": snap["sidecars"],
        "block_bytes": snap["block_bytes"],
        "sidecar_bytes": snap["sidecar_bytes"],
        "bytes_by_model": snap["by_model"],
        "orphans": paths("orphan"),
        "temp_files": paths("temp_file"),
        "foreign_files": snap["foreign_files"],
        "budget_bytes": store.budget_bytes if budget_given else None,
        "over_budget": paths("over_budget"),
        "over_budget_bytes": sum(d.nbytes for d in doomed if d.why == "over_budget"),
        "plan": [{"path": str(d.path), "bytes": d.nbytes, "why": d.why} for d in doomed],
        "plan_bytes": sum(d.nbytes for d in doomed),
    }


def apply(store: SSDStore, doomed: list[Doomed]) -> dict:
    """Delete the plan's files, each under the store's lock and through its index
    (``SSDStore.remove_path``); report those actually deleted (one may vanish meanwhile;
    a block's sidecars go with it)."""
    gone: set[Path] = set()
    for d in doomed:
        if d.path not in gone:
            gone.update(store.remove_path(d.path))
    deleted = [d for d in doomed if d.path in gone]
    by_reason: dict[str, int] = {}
    for d in deleted:
        by_reason[d.why] = by_reason.get(d.why, 0) + 1
    return {
        "files": [str(d.path) for d in deleted],
        "bytes": sum(d.nbytes for d in deleted),
        "by_reason": by_reason,
        "bytes_left": store.bytes_used(),
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
    untrusted = untrusted_reason(root)
    if untrusted is not None:
        print(f"refusing: cache directory {root}: {untrusted}")
        return 3
    store = SSDStore(root, args.budget if args.budget is not None else 1 << 62)
    # --apply holds the directory's lock from planning to the last deletion (no server
    # can start on it meanwhile); --force goes on without it while a server holds it.
    if args.apply and not store.lock_directory() and not args.force:
        print(f"refusing: a server is using {root} (stop it, or pass --force)")
        return 3
    store.open(clean=False)
    doomed = plan(store, args.budget is not None)
    result = {"dry_run": not args.apply, **report(store, args.budget is not None, doomed)}
    if args.apply:
        result["deleted"] = apply(store, doomed)
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
    print(f"  to delete: {len(r['plan'])} files, {r['plan_bytes']} bytes")
    if "deleted" in r:
        d = r["deleted"]
        reasons = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in d["by_reason"].items())
        print(f"  deleted {len(d['files'])} files ({reasons or 'none'}), {d['bytes']} bytes; "
              f"{d['bytes_left']} bytes left")
