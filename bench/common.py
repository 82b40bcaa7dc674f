"""What every benchmark here needs: the servers, one streamed chat request, the checks.

Every bench takes ``--model`` with an embedded model name (``tiny-hybrid``,
``tiny-hybrid-bf16``, ``tiny-dense``, ...; see ``serve_app.models.embedded.EMBEDDED_MODELS``), or a
real one (``smollm2-135m``: ``serve_app.models.embedded.REAL_MODELS``, ~10 tok/s on a 2-core CPU;
``bench.serving`` and ``bench.traces`` have settings sized for it).
The model is materialized once; ``mlx_lm.server --model <dir>`` gets that
directory and our profile gets ``source: embedded:<name>``, which resolves to the
same directory, so both servers run the very same weights, tokenizer and
template. Outputs are compared request by request (temperature 0), and ratios
are always ours / theirs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from bench.devserver import (  # noqa: F401 (re-exported for the benches)
    ServerProcess,
    descendants,
    free_port,
    write_config,
)
from serve_app.config.catalog import embedded_names

MODELS = embedded_names()  # the real ones first, then the random-weight ones
MLX_LM_PROMPT_CACHE_SIZE = 10  # mlx_lm.server --prompt-cache-size default (mlx-lm 0.32)


def add_model_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--model", default=default, choices=MODELS,
                        help="embedded model: the same weights go to both servers "
                             f"(default {default})")


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A scratch directory for configs, logs and cache files, under ``$BENCH_TMP`` if set;
    kept (and named on stderr) when ``$BENCH_KEEP`` is set or the bench fails."""
    path = Path(tempfile.mkdtemp(prefix="bench-", dir=os.environ.get("BENCH_TMP")))
    try:
        yield path
    except BaseException:
        print(f"bench failed; logs kept in {path}", file=sys.stderr)
        raise
    if os.environ.get("BENCH_KEEP"):
        print(f"bench files kept in {path}", file=sys.stderr)
    else:
        shutil.rmtree(path, ignore_errors=True)


def cache_opt(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` for a cache profile option; the value is parsed as YAML (ints, bools)."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError("expected KEY=VALUE")
    return key, yaml.safe_load(value)


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=None,
                        help="our cache block size (default: the profile's, 256 for hybrid)")
    parser.add_argument("--cache-opt", type=cache_opt, action="append", default=[],
                        metavar="KEY=VALUE", help="extra cache profile option for our server, "
                        "e.g. checkpoint_interval=1024 (repeatable)")


def cache_profile(args: argparse.Namespace) -> dict:
    """Our cache profile from ``--block-size`` and ``--cache-opt``."""
    cache = {"enabled": True, **dict(args.cache_opt)}
    if args.block_size:
        cache["block_size"] = args.block_size
    return cache


def stream_chat(base_url: str, body: dict) -> dict:
    """POST a streaming chat request; time to first token, decode time, text and usage.

    A thinking model's thought (``reasoning_content``, or mlx_lm.server's ``reasoning``)
    is ``reasoning``, apart from the answer's ``text``; its deltas are tokens too (the
    first one's time is the TTFT). ``cached_tokens`` is
    ``usage.prompt_tokens_details.cached_tokens``, or None when the server does not report
    it; ``usage`` the whole usage object. ``error`` is the error object of an
    ``{"error": ...}`` event that ended the stream (a stream cut after it started: its text
    is truncated), else None.
    """
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    parts: list[str] = []
    thought: list[str] = []
    usage = None
    finish = None
    error = None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            error = obj.get("error") or error
            usage = obj.get("usage") or usage
            for choice in obj.get("choices", []):
                finish = choice.get("finish_reason") or finish
                delta = choice.get("delta") or {}
                content = delta.get("content")
                think = delta.get("reasoning_content") or delta.get("reasoning")
                if content or think:
                    last = time.perf_counter()
                    first = first or last
                parts += [content] if content else []
                thought += [think] if think else []
    end = time.perf_counter()
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft": (first or end) - start,
        "decode_s": (last or end) - (first or end),
        "total_s": end - start,
        "text": "".join(parts),
        "reasoning": "".join(thought),
        "finish_reason": finish,
        "tokens": usage.get("completion_tokens", len(parts)),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
        "usage": usage,
        "error": error,
    }


def post_chat(base_url: str, body: dict) -> dict:
    """POST a non-streamed chat request; its wall time measured here (connect, request,
    the whole response), text and usage, in the keys ``stream_chat`` uses."""
    body = {**body, "stream": False}
    start = time.perf_counter()
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=600)
    end = time.perf_counter()
    r.raise_for_status()
    obj = r.json()
    choice = (obj.get("choices") or [{}])[0]
    usage = obj.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "total_s": end - start,
        "text": (choice.get("message") or {}).get("content") or "",
        "finish_reason": choice.get("finish_reason"),
        "tokens": usage.get("completion_tokens"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def start_ours(tmp: Path, tag: str, model: str, *, cache: dict | None, max_tokens: int,
               context_length: int = 16384, ssd_dir: Path | None = None,
               **profile) -> ServerProcess:
    """``serve run`` of our app with one embedded model; returns it ready.

    ``cache`` None keeps the profile's default cache settings; ``profile`` adds fields.
    """
    port = free_port()
    config = write_config(tmp / f"{tag}.yaml", port, [{
        "name": model, "source": f"embedded:{model}", "context_length": context_length,
        "max_tokens": max_tokens, **({"cache": cache} if cache is not None else {}),
        **profile}],
        cache_store={"ssd_dir": str(ssd_dir or tmp / f"kv-{tag}")})
    return ready(ServerProcess.serve_run(config, port, tmp / f"{tag}.log"), [model])


def ready(server: ServerProcess, models: list[str]) -> ServerProcess:
    """The server once it serves ``models``; stopped (everything it started) if it never does."""
    try:
        server.wait_ready(models)
    except BaseException:
        server.stop()
        raise
    return server


def start_mlx_lm_server(tmp: Path, tag: str, model_dir: Path, max_tokens: int,
                        *extra: str) -> ServerProcess:
    """``mlx_lm.server --model <dir>`` on the same weights; returns it ready."""
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port",
            str(port), "--max-tokens", str(max_tokens), *extra]
    return ready(ServerProcess(argv, port, tmp / f"{tag}.log"), [str(model_dir)])


def model_stats(server: ServerProcess, model: str) -> dict:
    return httpx.get(f"{server.base_url}/v1/stats", timeout=30).json()["models"][model]


def wait_written(server: ServerProcess, model: str, timeout: float = 60.0) -> dict:
    """Wait until the SSD write-behind has nothing pending; returns the model's stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = model_stats(server, model)
        staging = (s.get("cache_store") or {}).get("staging") or {}
        if not staging.get("pending_bytes") or time.monotonic() > deadline:
            return s
        time.sleep(0.1)


def compare_outputs(ours: list[dict], theirs: list[dict], labels: list[str]) -> dict:
    """Request-by-request text equality (temperature 0): our output vs mlx_lm's."""
    mismatches = []
    for label, a, b in zip(labels, ours, theirs, strict=True):
        if a["text"] != b["text"]:
            at = next((i for i, (x, y) in enumerate(zip(a["text"], b["text"], strict=False))
                       if x != y),
                      min(len(a["text"]), len(b["text"])))
            mismatches.append({"request": label, "first_diff_char": at,
                               "ours": a["text"], "mlx_lm": b["text"]})
    return {"requests": len(labels), "identical": len(labels) - len(mismatches),
            "all_identical": not mismatches, "mismatches": mismatches}


def checkpoint_memory(stats: dict) -> dict:
    """Recurrent-checkpoint bytes per 1K cached tokens, from our ``/v1/stats``.

    Newer servers report ``cache.checkpoint_bytes_per_1k_tokens`` themselves (the engine's
    ``captured_checkpoint_bytes * 1000 / captured_tokens``: recurrent-state bytes of every
    block and tail it captured, per token captured); that is used when present. Older
    ones do not: then it is computed from the SSD tier after the write-behind has drained,
    ``ssd.sidecar_bytes / (ssd.blocks * block_size) * 1000``, which assumes every block
    file holds ``block_size`` tokens (true before partial tail blocks existed) and needs
    ``gdn_snapshot_storage`` auto/ssd_sidecar. The SSD counts are recorded either way.
    """
    cache = stats.get("cache") or {}
    engine = stats.get("engine") or {}
    block_size = cache.get("block_size")
    store = stats.get("cache_store") or {}
    ssd = store.get("ssd") or {}
    reported = cache.get("checkpoint_bytes_per_1k_tokens")
    out = {"source": "reported by /v1/stats (cache.checkpoint_bytes_per_1k_tokens)"
           if reported is not None else
           "computed: ssd.sidecar_bytes / (ssd.blocks * block_size) * 1000",
           "checkpoint_bytes_per_1k_tokens": reported,
           "block_size": block_size,
           "checkpoint_interval": cache.get("checkpoint_interval"),
           "captured": {k: engine.get(k) for k in ("captured_blocks", "captured_tokens",
                                                   "captured_checkpoints",
                                                   "captured_checkpoint_bytes")},
           "hot": {"blocks": store.get("blocks"), "bytes": store.get("bytes")},
           "ssd": {k: ssd.get(k) for k in ("blocks", "block_bytes", "sidecars",
                                           "sidecar_bytes")}}
    if engine.get("captured_checkpoints"):
        out["bytes_per_checkpoint"] = (engine["captured_checkpoint_bytes"]
                                       / engine["captured_checkpoints"])
    elif ssd.get("sidecars"):
        out["bytes_per_checkpoint"] = ssd["sidecar_bytes"] / ssd["sidecars"]
    if reported is None and ssd.get("blocks") and block_size:
        out["checkpoint_bytes_per_1k_tokens"] = (ssd["sidecar_bytes"] * 1000
                                                 / (ssd["blocks"] * block_size))
    return out


def checkpoint_line(cm: dict) -> str:
    per_1k = cm.get("checkpoint_bytes_per_1k_tokens")
    if not per_1k:
        return (f"checkpoint bytes per 1K cached tokens: {per_1k} "
                "(no recurrent checkpoints captured: an attention-only model?)")
    each = cm.get("bytes_per_checkpoint")
    return (f"checkpoint bytes per 1K cached tokens: {per_1k:,.0f} ({cm['source']})"
            + (f"; {each:,.0f} bytes per checkpoint" if each else ""))


def emit(result: dict, out: Path | None) -> None:
    print(json.dumps(result, indent=2))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


# ---- resident memory of a server's whole process tree (through /proc, no psutil) ----

MIB = 1 << 20


def process_name(pid: int) -> str:
    """A readable name for a process: Ray's worker title (``ray::ServeReplica:...``),
    a Python script or ``-m`` module (``ray/dashboard/agent.py``, ``mlx_lm.server``),
    or the executable (``raylet``, ``gcs_server``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        argv = []
    if not argv:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return f"pid {pid}"
    if argv[0].startswith("ray::"):  # less the method it runs now (".listen_for_change")
        return re.sub(r"\.[A-Za-z_]\w*$", "", argv[0].split()[0])
    exe = os.path.basename(argv[0].split()[0])
    if not exe.startswith("python"):
        return exe
    return _python_target(argv[1:]) or exe


def _python_target(args: list[str]) -> str | None:
    """What a Python command line runs: ``-m`` module, or the script (shortened)."""
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            return args[i + 1]
        if arg == "-c":  # e.g. multiprocessing's resource tracker
            code = args[i + 1].split(";")[0] if i + 1 < len(args) else ""
            return f"python -c {code[:60]}".strip()
        if not arg.startswith("-"):
            script = arg.split("site-packages/", 1)[-1] if "site-packages/" in arg \
                else os.path.basename(arg)
            if script.endswith(".py"):
                return script
            rest = [a for a in args[i + 1:] if not a.startswith("-")]
            return f"{script} {rest[0]}" if rest else script  # `serve run`, `ray start`
    return None


def process_memory(pid: int) -> tuple[int, int | None] | None:
    """(RSS, PSS) bytes of one process, or None if it is gone. PSS (from smaps_rollup)
    splits shared pages among their users, so it sums without double counting."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next((int(line.split()[1]) * 1024 for line in f
                        if line.startswith("VmRSS:")), 0)
    except (OSError, ValueError):
        return None
    pss = None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            pss = next((int(line.split()[1]) * 1024 for line in f
                        if line.startswith("Pss:")), None)
    except (OSError, ValueError):
        pass
    return rss, pss


def tree_memory(roots: list[int]) -> dict[int, tuple[str, int, int | None]]:
    """pid -> (name, RSS, PSS) for every live process in the trees under ``roots``."""
    out: dict[int, tuple[str, int, int | None]] = {}
    for pid in {p for root in roots for p in (root, *descendants(root))}:
        mem = process_memory(pid)
        if mem is not None:  # kernel threads and exited processes have no VmRSS
            out[pid] = (process_name(pid), *mem)
    return out


def memory_sample(roots: list[int]) -> dict:
    """Totals (MiB) and a per-name breakdown (same-name processes summed) right now."""
    procs = tree_memory(roots)
    by_name: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, rss, _ in procs.values():
        by_name[name] = by_name.get(name, 0.0) + rss / MIB
        counts[name] = counts.get(name, 0) + 1
    pss = [p for _, _, p in procs.values()]
    return {"rss_mib": sum(r for _, r, _ in procs.values()) / MIB,
            "pss_mib": sum(pss) / MIB if pss and None not in pss else None,
            "processes": dict(sorted(by_name.items(), key=lambda kv: -kv[1])),
            "process_counts": counts}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(roots: list[int], seconds: float) -> dict:
    """Percent of one core each process of the trees under ``roots`` uses over
    ``seconds`` of doing nothing (same-name processes summed), and the total."""
    pids = {p for root in roots for p in (root, *descendants(root))}
    before = {pid: cpu_seconds(pid) for pid in pids}
    started = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - started
    by_name: dict[str, float] = {}
    for pid, was in before.items():
        now = cpu_seconds(pid)
        if was is None or now is None:
            continue
        name = process_name(pid)
        by_name[name] = by_name.get(name, 0.0) + 100 * (now - was) / elapsed
    return {"seconds": elapsed, "total_pct": sum(by_name.values()),
            "processes": dict(sorted(by_name.items(), key=lambda kv: -kv[1]))}


class MemorySampler:
    """Samples the memory of whole process trees every ``interval`` s on a thread,
    tagging each sample with the current phase ("idle", "streams8", ...), so one
    sampler gives both the idle footprint and the peak under load."""

    def __init__(self, roots: list[int], interval: float = 0.2) -> None:
        self.roots = roots
        self.interval = interval
        self.phase = "start"
        self.samples: list[tuple[str, dict]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((self.phase, memory_sample(self.roots)))
            self._stop.wait(self.interval)

    def peak(self, phase: str | None = None) -> dict | None:
        """The sample with the largest total RSS (in ``phase``, or in any phase)."""
        chosen = [s for p, s in self.samples if phase is None or p == phase]
        return max(chosen, key=lambda s: s["rss_mib"]) if chosen else None

    def median(self, phase: str) -> dict | None:
        """The sample with the median total RSS in ``phase`` (a steady, idle figure)."""
        chosen = sorted((s for p, s in self.samples if p == phase),
                        key=lambda s: s["rss_mib"])
        return chosen[len(chosen) // 2] if chosen else None
