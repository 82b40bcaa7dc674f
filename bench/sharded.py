"""One model over two ranks, side by side in one run on the same weights and backend.

Arms (each measured with the others idle):

- **ours** under one ``serve run``: ``tensor: 2`` on ``tiny-dense`` and ``pipeline: 2`` on
  ``tiny-hybrid`` (``placement: pack``: both ranks on this machine over MLX's ``ring``
  backend on loopback), and each model unsharded in one process;
- **mlx_lm.server**'s distributed mode (tensor parallel, and ``--pipeline``): each rank
  its own ``mlx_lm.server`` process, given ``MLX_RANK`` and a ``ring`` hostfile
  (``MLX_HOSTFILE``) in its environment, as ours are; and in one process.

Both sides' ranks start the same way, and neither under a launcher: ours are Ray worker
processes (the Serve replica is rank 0, rank 1 a Ray actor) that set ``MLX_RANK`` and
``MLX_HOSTFILE`` and call ``mx.distributed.init`` (``serve_app/parallel/group.py``).
``mlx.launch`` would start mlx_lm.server's ranks with one I/O thread each that relays
their output and polls ``select`` with the ranks' stdin pipes in its write set: a pipe is
always writable, so the thread never sleeps: ``mlx.launch -n 2`` of two ranks that only
sleep took 7 CPU-seconds in its first 6 s here, more than one of the 2 cores. The run of
2026-12-04 started mlx_lm.server under it (its tensor-parallel decode was 0.075x its
unsharded one). The bench writes the hostfile ``mlx.launch`` would write (one loopback
address per rank) and starts the ranks itself.

For each: decode tok/s of one stream and the aggregate of eight concurrent streams
(medians of rounds), cold TTFT of a ~3.7k-token conversation, TTFT of its second turn, and
TTFT of that second turn again after the server was stopped and started. That last one
compares unlike things: ours restores the turn from its disk tier on every rank,
mlx_lm.server has no disk tier and prefills it again; it shows what the disk tier buys,
not one server's restore against another's. Before the restart the bench waits until our
store has written every block, stops the server, and evicts every block file from the
page cache (``fsync``, then ``posix_fadvise(POSIX_FADV_DONTNEED)``; the fraction still
resident, read back with ``mincore``, is reported), so the restore reads the disk (a
VM's virtual disk here, which its host may cache). Plus what the engine's
command channel costs per step (``/v1/stats``' ranks) and whether the answers are the
same text as the unsharded model's at temperature 0.

Goals (reported, never asserted): decode >= 0.95x mlx_lm.server's distributed mode,
one stream and eight; second-turn TTFT <= 0.5x its; after a restart the second turn
restored from SSD.

Usage: python -m bench.sharded [--tokens N] [--rounds R] [--out PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import emit, ready, stream_chat, wait_written, workdir
from bench.devserver import ServerProcess, free_port, write_config
from serve_app.models.embedded import materialize

GOALS = {"decode_vs_mlx_lm_server": 0.95, "second_turn_ttft_vs_mlx_lm_server": 0.5}
RANKS_STARTED = ("each rank its own process with MLX_RANK and a ring MLX_HOSTFILE in its "
                 "environment, on both sides (ours: Ray workers; mlx_lm.server: started by "
                 "the bench); no mlx.launch")
RESTART_COMPARES = ("ours restored from its disk tier (page cache evicted first) against "
                    "mlx_lm.server prefilling again: it has no disk tier")
BS = 64
PAIRS = {  # mode -> (embedded model, our model name, unsharded name, mlx_lm.server args)
    "tensor": ("tiny-dense", "t2", "dense", []),
    "pipeline": ("tiny-hybrid", "p2", "hybrid", ["--pipeline"]),
}


def conversation(tag: str) -> list[dict]:
    system = (f"[{tag}] You are a careful assistant who answers in full sentences and "
              "checks every step twice before writing it down. ") * 28
    return [{"role": "system", "content": system},
            {"role": "user", "content": "Describe how a ring of computers shares a sum."}]


def body(model: str, messages: list[dict], tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}


def measure(url: str, model: str, tag: str, tokens: int, rounds: int) -> dict:
    """Everything but the restart, on one served model."""
    convo = conversation(tag)
    cold = stream_chat(url, body(model, convo, tokens))
    turn = [*convo, {"role": "assistant", "content": cold["text"]},
            {"role": "user", "content": "Now say it in one line."}]
    second = stream_chat(url, body(model, turn, tokens))
    one, eight = [], []
    for r in range(rounds):
        s = stream_chat(url, body(model, [{"role": "user", "content": f"Round {r}: go on."}],
                                  tokens))
        one.append(s["tokens"] / s["decode_s"] if s["decode_s"] > 0 else None)
        prompts = [[{"role": "user", "content": f"Round {r}, stream {i}: go on."}]
                   for i in range(8)]
        tic = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda p: stream_chat(url, body(model, p, tokens)), prompts))
        eight.append(sum(o["tokens"] for o in outs) / (time.perf_counter() - tic))
    return {"cold_ttft_s": cold["ttft"], "second_turn_ttft_s": second["ttft"],
            "second_turn_cached": second["cached_tokens"],
            "decode_tps_1": _median(one), "decode_tps_8": _median(eight),
            "texts": [cold["text"], second["text"]], "turn": turn}


def after_restart(url: str, model: str, turn: list[dict], tokens: int) -> dict:
    again = stream_chat(url, body(model, turn, tokens))
    return {"restart_ttft_s": again["ttft"], "restart_cached": again["cached_tokens"],
            "restart_text": again["text"]}


def _median(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def evict(paths: list[Path]) -> None:
    """Write each file out and drop it from the page cache (clean pages only go)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: list[Path]) -> float | None:
    """The fraction of these files' pages in the page cache now (``mincore`` on a
    read-only mapping of each, which reads nothing in)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = ctypes.create_string_buffer(pages)
        fd = os.open(path, os.O_RDONLY)
        try:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                if libc.mincore(address, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
            finally:
                libc.munmap(address, size)
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in vec.raw)
        total += pages
    return resident / total if total else None


def ours(tmp: Path, tokens: int, rounds: int) -> tuple[dict, dict]:
    """Every arm of ours, and what the page cache held of the block files at the restart."""
    models = []
    for mode, (src, sharded, whole, _) in PAIRS.items():
        models.append({"name": sharded, "source": f"embedded:{src}", "context_length": 8192,
                       "max_batch_size": 8, "max_tokens": tokens,
                       "parallel": {mode: 2, "placement": "pack"},
                       "cache": {"block_size": BS}})
        models.append({"name": whole, "source": f"embedded:{src}", "context_length": 8192,
                       "max_batch_size": 8, "max_tokens": tokens, "cache": {"block_size": BS}})
    port = free_port()
    config = write_config(tmp / "ours.yaml", port, models,
                          cache_store={"ssd_dir": str(tmp / "kv")})
    names = [m["name"] for m in models]
    out: dict = {}
    server = ready(ServerProcess.serve_run(config, port, tmp / "ours-1.log"), names)
    try:
        for name in names:
            out[name] = measure(server.base_url, name, f"ours {name}", tokens, rounds)
        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()["models"]
        for name in names:
            ranks = (stats[name].get("replica") or {}).get("ranks") or []
            if ranks:
                r0 = ranks[0]
                out[name]["channel"] = {
                    "steps": r0["steps"], "seconds": r0["channel_seconds"],
                    "seconds_per_step": r0["channel_seconds"] / max(r0["steps"], 1),
                    "command_messages": r0["command_messages"],
                    "command_bytes": r0["command_bytes"]}
        for name in names:  # the store writes its blocks to SSD behind the requests
            wait_written(server, name, timeout=120)
    finally:
        server.stop()
    files = block_files(tmp / "kv")
    before = resident_fraction(files)
    evict(files)
    page_cache = {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
                  "resident_before_evict": before,
                  "resident_after_evict": resident_fraction(files)}
    server = ready(ServerProcess.serve_run(config, port, tmp / "ours-2.log"), names)
    try:
        for name in names:
            out[name].update(after_restart(server.base_url, name, out[name]["turn"], tokens))
    finally:
        server.stop()
    return out, page_cache


@dataclass
class RankProcesses:
    """An ``mlx_lm.server`` whose ranks are processes of their own; rank 0 serves HTTP."""

    ranks: list[ServerProcess]

    @property
    def base_url(self) -> str:
        return self.ranks[0].base_url

    def stop(self) -> None:
        """SIGKILL every rank, by pid: it keeps nothing to save, and a rank left waiting in
        a collective does not answer SIGINT."""
        for rank in self.ranks:
            rank.kill()


def mlx_lm_server(tmp: Path, tag: str, model_dir: Path, ranks: int, extra: list[str],
                  tokens: int) -> RankProcesses:
    """``ranks`` mlx_lm.server processes on loopback, started as ours are: each told its
    rank and the ring hostfile through its environment, none under ``mlx.launch`` (whose
    I/O thread per rank spins: see the module's docstring)."""
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port",
            str(port), "--max-tokens", str(tokens), *extra]
    env: dict[str, str] = {}
    if ranks > 1:
        hosts = tmp / f"{tag}-hosts.json"
        hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)]))
        env["MLX_HOSTFILE"] = str(hosts)
    started: list[ServerProcess] = []
    try:
        for rank in range(ranks - 1, -1, -1):  # the followers first: rank 0 waits for them
            started.insert(0, ServerProcess(argv, port, tmp / f"{tag}-rank{rank}.log",
                                            env={**env, "MLX_RANK": str(rank)}))
        ready(started[0], [str(model_dir)])
    except BaseException:
        for process in started:
            process.kill()
        raise
    return RankProcesses(started)


def theirs(tmp: Path, tokens: int, rounds: int) -> dict:
    out: dict = {}
    for mode, (src, _, _, extra) in PAIRS.items():
        model_dir = materialize(src)
        for ranks in (2, 1):
            tag = f"mlx_lm.server {mode} x{ranks}" if ranks > 1 else f"mlx_lm.server {src}"
            if tag in out:
                continue
            server = mlx_lm_server(tmp, tag.replace(" ", "_"), model_dir, ranks,
                                   extra if ranks > 1 else [], tokens)
            try:
                out[tag] = measure(server.base_url, str(model_dir), tag, tokens, rounds)
            finally:
                server.stop()
            server = mlx_lm_server(tmp, tag.replace(" ", "_") + "-2", model_dir, ranks,
                                   extra if ranks > 1 else [], tokens)
            try:
                out[tag].update(after_restart(server.base_url, str(model_dir),
                                              out[tag]["turn"], tokens))
            finally:
                server.stop()
    return out


def compare(result: dict) -> dict:
    rows = {}
    for mode, (src, sharded, whole, _) in PAIRS.items():
        a, b = result["ours"][sharded], result["mlx_lm_server"][f"mlx_lm.server {mode} x2"]
        base = result["ours"][whole]

        def ratio(key: str, x: dict = a, y: dict = b) -> float | None:
            return x[key] / y[key] if x.get(key) and y.get(key) else None

        rows[mode] = {
            "model": src,
            "decode_1_vs_mlx_lm_server": ratio("decode_tps_1"),
            "decode_8_vs_mlx_lm_server": ratio("decode_tps_8"),
            "cold_ttft_vs_mlx_lm_server": ratio("cold_ttft_s"),
            "second_turn_ttft_vs_mlx_lm_server": ratio("second_turn_ttft_s"),
            "restart_ttft_vs_mlx_lm_server": ratio("restart_ttft_s"),
            "decode_1_vs_ours_unsharded": ratio("decode_tps_1", a, base),
            "restart_restored_tokens": a.get("restart_cached"),
            "same_text_as_unsharded": a["texts"] == base["texts"],
            "restart_same_text": a.get("restart_text") == a["texts"][1],
        }
    return rows


def summary(result: dict) -> str:
    def f(x, spec=".2f") -> str:
        return "-" if x is None else format(x, spec)

    lines = ["arm                              decode 1   decode 8   cold TTFT  2nd TTFT  "
             "restart TTFT (cached)"]
    for side in ("ours", "mlx_lm_server"):
        for name, r in result[side].items():
            label = f"{'ours' if side == 'ours' else ''} {name}".strip()
            lines.append(f"{label:<32} {f(r['decode_tps_1'], '.1f'):>8}   "
                         f"{f(r['decode_tps_8'], '.1f'):>8}   {f(r['cold_ttft_s'], '.3f'):>8}  "
                         f"{f(r['second_turn_ttft_s'], '.3f'):>8}  "
                         f"{f(r.get('restart_ttft_s'), '.3f'):>8} ({r.get('restart_cached')})")
    for mode, c in result["comparison"].items():
        lines.append(f"{mode}: " + ", ".join(f"{k} {f(v) if isinstance(v, float) else v}"
                                             for k, v in c.items() if k != "model"))
    for name, r in result["ours"].items():
        if "channel" in r:
            ch = r["channel"]
            lines.append(f"command channel of {name}: {ch['steps']} steps, "
                         f"{1e6 * ch['seconds_per_step']:.0f} us a step, "
                         f"{ch['command_messages']} messages with commands, "
                         f"{ch['command_bytes']} bytes")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("decode_tps_1", "decode tok/s, 1 stream"), ("decode_tps_8", "tok/s, 8 streams"),
            ("second_turn_ttft_s", "2nd-turn TTFT (s)"),
            ("restart_ttft_s", "TTFT after restart (s)")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4))
    arms = [(f"ours {n}", r) for n, r in result["ours"].items()] + \
        list(result["mlx_lm_server"].items())
    for ax, (key, title) in zip(axes, keys, strict=True):
        ax.barh([a for a, _ in arms], [r.get(key) or 0 for _, r in arms])
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with workdir() as tmp:
        arms, page_cache = ours(tmp, args.tokens, args.rounds)
        result = {"goals": GOALS, "tokens": args.tokens, "rounds": args.rounds,
                  "ranks_started": RANKS_STARTED, "restart_compares": RESTART_COMPARES,
                  "ours": arms, "page_cache_at_restart": page_cache,
                  "mlx_lm_server": theirs(tmp, args.tokens, args.rounds)}
    # Other processes on the machine skew every figure: the load average around the run.
    result["loadavg_1_5_15"] = {"before": load_before, "after": os.getloadavg()}
    for side in ("ours", "mlx_lm_server"):
        for r in result[side].values():
            r.pop("turn", None)
    result["comparison"] = compare(result)
    emit(result, args.out)
    print(summary(result), file=sys.stderr)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
