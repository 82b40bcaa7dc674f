"""``python -m serve_app gc``: dry run and --apply do what they report, no MLX needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from serve_app.cache.ssd import SSDStore
from tests.support.blocks import LAYOUT, bid
from tests.support.ssd_dirs import files, populate


def gc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app", "gc", *args],
                          capture_output=True, text=True, timeout=120)


def test_dry_run_reports_and_deletes_nothing(tmp_path):
    populate(tmp_path)
    before = files(tmp_path)
    r = gc("--dir", str(tmp_path), "--json", "--budget", "10KB")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dry_run"] and out["blocks"] == 4 and out["sidecars"] == 5
    assert len(out["orphans"]) == 1 and len(out["temp_files"]) == 1
    assert out["over_budget_bytes"] > 0
    assert files(tmp_path) == before


def sizes(root) -> dict[str, int]:
    return {str(p): p.stat().st_size for p in root.rglob("*")
            if p.is_file() and p.name != "LOCK"}


def test_apply_deletes_exactly_the_dry_run_plan(tmp_path):
    """The dry run's list is the set of files that disappear with --apply, bytes included:
    temp files, orphans, and over budget a block with its sidecar, each file once (a
    sidecar removed with its block used to be counted twice)."""
    s = populate(tmp_path)
    for i in range(4):  # distinct recency: block 0 (and its sidecar) is the oldest
        for path in (s.block_path(bid(i)), s.sidecar_path(LAYOUT, bid(i))):
            os.utime(path, (1_000_000 + i, 1_000_000 + i))
    before = sizes(tmp_path)
    dry = json.loads(gc("--dir", str(tmp_path), "--json", "--budget", "10KB").stdout)
    assert sizes(tmp_path) == before
    planned = {d["path"]: d["bytes"] for d in dry["plan"]}
    assert len(planned) == len(dry["plan"])  # each file once
    assert {d["why"] for d in dry["plan"]} == {"temp_file", "orphan", "over_budget"}
    over = set(dry["over_budget"])
    assert {str(s.block_path(bid(0))), str(s.sidecar_path(LAYOUT, bid(0)))} <= over
    assert dry["over_budget_bytes"] == sum(planned[p] for p in over)
    assert dry["plan_bytes"] == sum(planned.values())

    r = gc("--dir", str(tmp_path), "--json", "--budget", "10KB", "--apply")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    after = sizes(tmp_path)
    vanished = {p: n for p, n in before.items() if p not in after}
    assert vanished == planned
    assert set(out["deleted"]["files"]) == set(planned)
    assert out["deleted"]["bytes"] == sum(planned.values())
    assert out["deleted"]["by_reason"] == {"temp_file": 1, "orphan": 1, "over_budget": len(over)}
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert total <= 10_000 and out["deleted"]["bytes_left"] == total
    assert not s.sidecar_path(LAYOUT, bid(99)).exists()


def test_refuses_while_a_server_holds_the_directory(tmp_path):
    server = populate(tmp_path)
    assert server.lock_directory()
    r = gc("--dir", str(tmp_path), "--apply")
    assert r.returncode == 3 and "refusing" in r.stdout
    assert gc("--dir", str(tmp_path), "--apply", "--force").returncode == 0


def test_gc_needs_no_mlx(tmp_path):
    populate(tmp_path)
    code = ("import sys; from serve_app.__main__ import main; main(['gc', '--dir', "
            f"{str(tmp_path)!r}]); print('MLX' if 'mlx' in sys.modules else 'NO-MLX')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip().endswith("NO-MLX"), r.stdout + r.stderr


def test_apply_holds_the_directory_lock(tmp_path):
    """While ``--apply`` runs no server can take the directory; a dry run takes no lock."""
    populate(tmp_path)
    code = ("import sys, time; from serve_app.cli import gc; from serve_app.cache.ssd import "
            "SSDStore; real = gc.apply\n"
            "def slow(store, doomed):\n    print('APPLYING', flush=True); time.sleep(3)\n"
            "    return real(store, doomed)\n"
            f"gc.apply = slow; sys.exit(gc.main(['--dir', {str(tmp_path)!r}, '--apply']))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "APPLYING"
        server = SSDStore(tmp_path, 1 << 30)
        assert not server.lock_directory()  # gc holds it
    finally:
        assert proc.wait(60) == 0
    assert SSDStore(tmp_path, 1 << 30).lock_directory()  # released when gc exits
