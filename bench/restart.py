"""Restart benchmark: the last turn of a conversation after a full server restart.

The 6-turn hybrid replay of ``bench/multiturn.py`` runs on our server (SSD tier
on), the server is stopped and started again (a new Ray cluster, page cache of
the cache files dropped), and the last turn is replayed. Side by side in one
run: the same turn with caching disabled, and ``mlx_lm.server`` after its own
restart. Also SSD restore throughput next to the disk's sequential read
bandwidth, and peak RSS of a long hybrid session with sidecars vs embedded.

Usage: python -m bench.restart [--block-size N]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import emit, stream_chat
from bench.multiturn import conversation, replay
from serve_app.devserver import ServerProcess, descendants, free_port, write_config
from serve_app.embedded import materialize

MODEL = "tiny-hybrid"


def drop_page_cache(*paths: Path) -> None:
    """Evict files from the page cache, so reads after a restart come from the disk."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read_bandwidth(directory: Path, size: int = 256 << 20) -> float:
    path = directory / "bandwidth.bin"
    with open(path, "wb") as f:
        chunk = os.urandom(8 << 20)
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_page_cache(path)
    tic = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    seconds = time.perf_counter() - tic
    path.unlink()
    return size / seconds


def start(tmp: Path, name: str, cache: dict, kv: Path) -> ServerProcess:
    port = free_port()
    config = write_config(tmp / f"{name}.yaml", port, [{
        "name": MODEL, "source": f"embedded:{MODEL}", "context_length": 16384,
        "max_tokens": 64, "cache": cache}], cache_store={"ssd_dir": str(kv)})
    server = ServerProcess.serve_run(config, port, tmp / f"{name}.log")
    server.wait_ready([MODEL])
    return server


def peak_rss(server: ServerProcess) -> int:
    total = 0
    for pid in descendants(server.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"ServeReplica" not in cmd and b"CacheStoreActor" not in cmd:
                continue
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def stats(server: ServerProcess) -> dict:
    return httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()["models"][MODEL]


def wait_written(server: ServerProcess) -> None:
    while stats(server)["cache_store"]["staging"]["pending_bytes"]:
        time.sleep(0.1)


def replay_last(server_url: str, model: str, system: str, users: list[str],
                answers: list[str], gen: int) -> dict:
    """Only the last turn, with the earlier turns' answers as history."""
    messages = [{"role": "system", "content": system}]
    for user, answer in zip(users[:-1], answers[:-1], strict=True):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": users[-1]})
    return stream_chat(server_url, {"model": model, "messages": messages, "max_tokens": gen,
                                    "temperature": 0})


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--gen", type=int, default=24)
    parser.add_argument("--long-turns", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    system, users = conversation(6, 1500, 300)
    cache = {"enabled": True, **({"block_size": args.block_size} if args.block_size else {})}
    model_dir = materialize(MODEL)
    result: dict = {"model": MODEL}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d:
        tmp = Path(d)
        kv = tmp / "kv"
        first = start(tmp, "first", cache, kv)
        answers = [r["text"] for r in replay(first.base_url, MODEL, system, users, args.gen)]
        wait_written(first)
        first.stop()
        drop_page_cache(*kv.rglob("*.safetensors"))
        second = start(tmp, "second", cache, kv)
        ours = replay_last(second.base_url, MODEL, system, users, answers, args.gen)
        s = stats(second)
        second.stop()

        cold_server = start(tmp, "cold", {"enabled": False}, tmp / "kv-cold")
        cold = replay_last(cold_server.base_url, MODEL, system, users, answers, args.gen)
        cold_server.stop()

        port = free_port()
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port",
                str(port), "--max-tokens", str(args.gen)]
        mls = ServerProcess(argv, port, tmp / "mls1.log")
        mls.wait_ready([str(model_dir)])
        mls_answers = [r["text"] for r in replay(mls.base_url, str(model_dir), system, users,
                                                 args.gen)]
        mls.stop()
        port = free_port()
        argv[argv.index("--port") + 1] = str(port)
        mls = ServerProcess(argv, port, tmp / "mls2.log")
        mls.wait_ready([str(model_dir)])
        baseline = replay_last(mls.base_url, str(model_dir), system, users, mls_answers,
                               args.gen)
        mls.stop()

        result["last_turn_ttft"] = {"ours_after_restart": ours["ttft"], "ours_cold": cold["ttft"],
                                    "mlx_lm_server_after_restart": baseline["ttft"]}
        result["ratio_vs_cold"] = ours["ttft"] / cold["ttft"]
        result["ratio_vs_mlx_lm_server"] = ours["ttft"] / baseline["ttft"]
        result["goals"] = {"vs_cold": 0.15, "vs_mlx_lm_server": 0.2}
        result["identical_to_cold"] = ours["text"] == cold["text"]
        result["cache"] = {k: s["cache"][k] for k in ("block_size", "hit_tokens_by_tier",
                                                        "sidecar_loads", "ssd_read_bytes",
                                                        "ssd_read_seconds")}
        read_s = s["cache"]["ssd_read_seconds"]
        result["ssd_restore_bytes_per_second"] = (s["cache"]["ssd_read_bytes"] / read_s
                                                  if read_s else None)
        result["disk_sequential_read_bytes_per_second"] = sequential_read_bandwidth(tmp)

        rss = {}
        long_system, long_users = conversation(args.long_turns, 1500, 300)
        for storage in ("ssd_sidecar", "embedded"):
            server = start(tmp, f"rss-{storage}", {**cache, "gdn_snapshot_storage": storage},
                           tmp / f"kv-{storage}")
            replay(server.base_url, MODEL, long_system, long_users, args.gen)
            wait_written(server)
            rss[storage] = peak_rss(server)
            server.stop()
        result["peak_rss_bytes_long_session"] = rss
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
