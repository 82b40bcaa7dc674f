"""Restart benchmark: the last turn of a conversation after a full server restart.

The 6-turn hybrid replay of ``bench/multiturn.py`` runs on our server (SSD tier
on), the server is stopped and started again (a new Ray cluster, page cache of
the cache files dropped), and the last turn is replayed. Side by side in one
run: the same turn with caching disabled, and ``mlx_lm.server`` after its own
restart. Also SSD restore throughput next to the disk's sequential read
bandwidth, and peak RSS of a long hybrid session with sidecars vs embedded.

Outputs are compared with mlx_lm.server's, turn by turn (temperature 0).

Usage: python -m bench.restart [--model tiny-hybrid|tiny-hybrid-bf16|...] [--block-size N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench.common import (
    ServerProcess,
    add_cache_options,
    add_model_option,
    cache_profile,
    compare_outputs,
    descendants,
    emit,
    model_stats,
    start_mlx_lm_server,
    start_ours,
    stream_chat,
    wait_written,
    workdir,
)
from bench.multiturn import conversation, replay
from serve_app.models.embedded import materialize


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
    add_model_option(parser, "tiny-hybrid")
    add_cache_options(parser)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=300)
    parser.add_argument("--gen", type=int, default=24)
    parser.add_argument("--long-turns", type=int, default=12,
                        help="turns of the peak-RSS session (0: skip that part)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model
    system, users = conversation(args.turns, args.system_tokens, args.user_tokens)
    cache = cache_profile(args)
    model_dir = materialize(model)
    result: dict = {"model": model,
                    "settings": {"turns": args.turns, "system_tokens": args.system_tokens,
                                 "user_tokens": args.user_tokens, "gen": args.gen,
                                 "cache": cache, "long_turns": args.long_turns}}

    def ours(tag: str, cache: dict, kv: Path) -> ServerProcess:
        return start_ours(tmp, tag, model, cache=cache, max_tokens=64, ssd_dir=kv)

    with workdir() as tmp:
        kv = tmp / "kv"
        first = ours("first", cache, kv)
        try:
            before = replay(first.base_url, model, system, users, args.gen)
            wait_written(first, model)
        finally:
            first.stop()
        answers = [r["text"] for r in before]
        drop_page_cache(*kv.rglob("*.safetensors"))
        second = ours("second", cache, kv)
        try:
            after = replay_last(second.base_url, model, system, users, answers, args.gen)
            s = model_stats(second, model)
        finally:
            second.stop()

        cold_server = ours("cold", {"enabled": False}, tmp / "kv-cold")
        try:
            cold = replay_last(cold_server.base_url, model, system, users, answers, args.gen)
        finally:
            cold_server.stop()

        mls = start_mlx_lm_server(tmp, "mls1", model_dir, args.gen)
        try:
            mls_before = replay(mls.base_url, str(model_dir), system, users, args.gen)
        finally:
            mls.stop()
        mls = start_mlx_lm_server(tmp, "mls2", model_dir, args.gen)
        try:
            baseline = replay_last(mls.base_url, str(model_dir), system, users,
                                   [r["text"] for r in mls_before], args.gen)
        finally:
            mls.stop()

        result["last_turn_ttft"] = {"ours_after_restart": after["ttft"],
                                    "ours_cold": cold["ttft"],
                                    "mlx_lm_server_after_restart": baseline["ttft"]}
        result["last_turn_cached_tokens"] = {"ours_after_restart": after["cached_tokens"],
                                             "mlx_lm_server_after_restart":
                                             baseline["cached_tokens"],
                                             "prompt_tokens": after["prompt_tokens"]}
        result["ratio_vs_cold"] = after["ttft"] / cold["ttft"]
        result["ratio_vs_mlx_lm_server"] = after["ttft"] / baseline["ttft"]
        result["goals"] = {"vs_cold": 0.15, "vs_mlx_lm_server": 0.2}
        result["identical_to_cold"] = after["text"] == cold["text"]
        labels = [f"turn {i + 1}" for i in range(len(users))]
        result["vs_mlx_lm_server_outputs"] = compare_outputs(
            [*before, after], [*mls_before, baseline], [*labels, "last turn after restart"])
        result["cache"] = {k: s["cache"][k] for k in ("block_size", "hit_tokens_by_tier",
                                                        "sidecar_loads", "ssd_read_bytes",
                                                        "ssd_read_seconds")}
        read_s = s["cache"]["ssd_read_seconds"]
        result["ssd_restore_bytes_per_second"] = (s["cache"]["ssd_read_bytes"] / read_s
                                                  if read_s else None)
        result["disk_sequential_read_bytes_per_second"] = sequential_read_bandwidth(tmp)

        rss = {}
        long_system, long_users = conversation(args.long_turns, args.system_tokens,
                                               args.user_tokens)
        for storage in ("ssd_sidecar", "embedded") if args.long_turns else ():
            server = ours(f"rss-{storage}", {**cache, "gdn_snapshot_storage": storage},
                          tmp / f"kv-{storage}")
            try:
                replay(server.base_url, model, long_system, long_users, args.gen)
                wait_written(server, model)
                rss[storage] = peak_rss(server)
            finally:
                server.stop()
        result["peak_rss_bytes_long_session"] = rss
    emit(result, args.out)
    cmp = result["vs_mlx_lm_server_outputs"]
    t = result["last_turn_ttft"]
    print(f"last turn TTFT after restart: ours {t['ours_after_restart']:.3f} s, "
          f"ours cold {t['ours_cold']:.3f} s, mlx_lm.server {t['mlx_lm_server_after_restart']:.3f}"
          f" s; ratios {result['ratio_vs_cold']:.3f}x vs cold, "
          f"{result['ratio_vs_mlx_lm_server']:.3f}x vs mlx_lm.server; "
          f"identical to mlx_lm.server: {cmp['identical']}/{cmp['requests']}, "
          f"to cold: {result['identical_to_cold']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
