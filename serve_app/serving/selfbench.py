"""A self-benchmark of this machine, run only when asked (the status page, ``POST
/admin/benchmark``): write and read speed of the SSD cache directory, and prefill and
decode speed of a loaded model on a short fixed prompt.

What a person wants to know before choosing a model or a cache budget (oMLX's panel has
it): can this disk restore a conversation faster than the model prefills it? Reads go
around the OS page cache where the platform allows (``F_NOCACHE`` on macOS, dropping the
written pages on Linux), else the read figure is the page cache's and says so.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serve_app.cache.ssd_fs import TMP_MARK
from serve_app.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from serve_app.serving.engine import Engine
    from serve_app.serving.engine_events import EngineEvent
    from serve_app.serving.service import ModelService

SSD_BYTES = 256 * 1024**2  # written and read back; at least a few hundred ms on a Mac's SSD
MIN_SSD_BYTES, MAX_SSD_BYTES = 1024**2, 4 * 1024**3
CHUNK = 8 * 1024**2
PROMPT_TOKENS = 512  # a short prompt: the prefill rate of a turn, not of a long context
DECODE_TOKENS = 128
F_NOCACHE = 48  # macOS's fcntl: this descriptor's reads bypass the unified buffer cache
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SsdSpeed:
    """One write (fsynced) and one read of ``nbytes`` in the cache directory ``dir``."""

    dir: str
    nbytes: int
    write_seconds: float
    read_seconds: float
    write_bytes_per_s: float
    read_bytes_per_s: float
    read_bypassed_page_cache: bool  # False: the read may have come from RAM


@dataclass(frozen=True)
class ModelSpeed:
    """A fixed prompt prefilled cold (no prefix cache) and ``decode_tokens`` decoded alone."""

    prompt_tokens: int
    prefill_seconds: float
    prefill_tokens_per_s: float
    decode_tokens: int
    decode_seconds: float
    decode_tokens_per_s: float
    batch_busy: bool  # other requests were running: the figures are shared with them


@dataclass(frozen=True)
class SelfBenchmark:
    """A run of the self-benchmark: where and when, and what it measured."""

    model: str
    node_id: str
    at: float  # Unix time it finished
    ssd: SsdSpeed | None
    model_speed: ModelSpeed | None
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_ssd(directory: Path, nbytes: int = SSD_BYTES) -> SsdSpeed:
    """Write ``nbytes`` of random data to a temporary file in ``directory`` (fsynced), read
    it back, delete it. The file's name marks it temporary: a crash leaves nothing the
    SSD tier keeps (it removes such files when it opens the directory)."""
    nbytes = max(MIN_SSD_BYTES, min(MAX_SSD_BYTES, int(nbytes)))
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"selfbench{TMP_MARK}{os.getpid()}-{threading.get_ident()}"
    chunk = os.urandom(min(CHUNK, nbytes))
    try:
        tic = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        _no_cache(fd)  # macOS: the written pages are not kept either, so the read is the disk's
        try:
            left = nbytes
            while left > 0:
                left -= os.write(fd, chunk[:left])
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - tic
        bypassed = _drop_cached(path)
        tic = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            _no_cache(fd)
            while os.read(fd, CHUNK):
                pass
        finally:
            os.close(fd)
        read_s = time.perf_counter() - tic
    finally:
        path.unlink(missing_ok=True)
    return SsdSpeed(str(directory), nbytes, round(write_s, 4), round(read_s, 4),
                    round(nbytes / max(write_s, 1e-9)), round(nbytes / max(read_s, 1e-9)),
                    bypassed)


def _no_cache(fd: int) -> None:
    """macOS: this descriptor's reads and writes bypass the unified buffer cache."""
    if sys.platform == "darwin":
        import fcntl

        fcntl.fcntl(fd, F_NOCACHE, 1)


def _drop_cached(path: Path) -> bool:
    """Take the file's pages out of the OS cache before it is read: whether it could."""
    if sys.platform == "darwin":
        return True  # the read's descriptor sets F_NOCACHE
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True


def fixed_prompt(encode, n: int = PROMPT_TOKENS) -> list[int]:
    """``n`` tokens of a fixed English text, the same for every run on one tokenizer."""
    text = ("The quick brown fox jumps over the lazy dog while the status page measures "
            "how fast this machine reads a prompt and writes an answer. ")
    ids = list(encode(text))
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def measure_model(engine: Engine, prompt: list[int], eos_ids: set[int],
                  decode_tokens: int = DECODE_TOKENS, timeout: float = TIMEOUT_S) -> ModelSpeed:
    """Prefill ``prompt`` cold and decode ``decode_tokens`` greedily, end-of-sequence
    masked so every run decodes as many. Through the engine like a request, never through
    the prefix cache (no plan: nothing restored, nothing stored)."""
    import mlx.core as mx

    events: list[EngineEvent] = []
    done = threading.Event()
    eos = sorted(eos_ids)

    def no_eos(tokens: Any, logits: Any) -> Any:
        if eos:
            logits[..., mx.array(eos)] = -mx.inf
        return logits

    def sink(event: EngineEvent) -> None:
        events.append(event)
        if event.error is not None or event.finish_reason is not None:
            done.set()

    busy = engine.stats.in_flight > 0
    submitted = time.perf_counter()
    rid = engine.submit(prompt, SamplingParams(max_tokens=decode_tokens, temperature=0.0,
                                               logits_processors=(no_eos,)), sink)
    if not done.wait(timeout):
        engine.cancel(rid)
        raise TimeoutError(f"the model benchmark took over {timeout:.0f} s")
    errors = [e.error for e in events if e.error is not None]
    if errors:
        raise RuntimeError(f"the model benchmark failed: {errors[0]}")
    tokens = [e for e in events if e.token is not None]
    first, last = tokens[0].at, tokens[-1].at
    prefill_s, decode_s = first - submitted, last - first
    decoded = len(tokens) - 1
    return ModelSpeed(len(prompt), round(prefill_s, 4), round(len(prompt) / prefill_s, 1),
                      decoded, round(decode_s, 4),
                      round(decoded / decode_s, 1) if decode_s > 0 else 0.0, busy)


def run_self_benchmark(model: str, node_id: str, ssd_dir: Path | None, ssd_bytes: int,
                       service: ModelService | None) -> SelfBenchmark:
    """The whole benchmark (blocking): the SSD cache directory ``ssd_dir`` (None: the SSD
    tier is off) and ``service``'s model (None: it is not loaded), each said when absent."""
    notes = []
    ssd = None
    if ssd_dir is not None:
        ssd = measure_ssd(ssd_dir, ssd_bytes)
    else:
        notes.append("the SSD tier is off (cache_store.ssd): no disk figures")
    speed = None
    if service is None:
        notes.append(f"model {model!r} is not loaded: no prefill or decode figures (load "
                     "it, then run the benchmark again)")
    else:
        tokenizer = service.tokenizer
        prompt = fixed_prompt(lambda text: tokenizer.encode(text, add_special_tokens=False))
        speed = measure_model(service.engine, prompt, service.eos_ids)
        method = service.engine.stats.speculative_method
        if method:
            notes.append(f"speculative decoding ({method}) is on: the fixed prompt repeats "
                         "one sentence, which drafts well, so decode is faster than on most "
                         "prompts")
    return SelfBenchmark(model, node_id, round(time.time(), 3), ssd, speed, tuple(notes))
