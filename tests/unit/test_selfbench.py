"""The self-benchmark without Ray or a server: the SSD figure on a real directory (the size
clamped, no file left behind even when the read fails), the fixed prompt, and the model
figure through a real ``Engine`` on the embedded tiny dense model (every run decodes as many
tokens: end-of-sequence is masked)."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import mlx_lm
import pytest

from serve_app.cache.ssd_fs import TMP_MARK
from serve_app.models.embedded import materialize
from serve_app.serving import selfbench
from serve_app.serving.engine import Engine
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.selfbench import (
    MIN_SSD_BYTES,
    PROMPT_TOKENS,
    SelfBenchmark,
    fixed_prompt,
    measure_model,
    measure_ssd,
    run_self_benchmark,
)

# ---- the SSD figure ------------------------------------------------------------------------


class CountingOs:
    """``os`` as the self-benchmark sees it, counting the bytes it writes and reads (and
    failing reads when told to)."""

    def __init__(self, fail_read: bool = False) -> None:
        self.written = 0
        self.read_bytes = 0
        self.fail_read = fail_read
        self.paths: list[str] = []

    def __getattr__(self, name: str):
        return getattr(os, name)

    def open(self, path, flags, *args):
        self.paths.append(str(path))
        return os.open(path, flags, *args)

    def write(self, fd: int, data: bytes) -> int:
        n = os.write(fd, data)
        self.written += n
        return n

    def read(self, fd: int, n: int) -> bytes:
        if self.fail_read:
            raise OSError(5, "Input/output error")
        data = os.read(fd, n)
        self.read_bytes += len(data)
        return data


def test_measure_ssd_writes_and_reads_back_and_leaves_nothing(tmp_path, monkeypatch):
    spy = CountingOs()
    monkeypatch.setattr(selfbench, "os", spy)
    directory = tmp_path / "kv" / "new"  # made if missing
    speed = measure_ssd(directory, 3 * MIN_SSD_BYTES)
    assert speed.dir == str(directory) and speed.nbytes == 3 * MIN_SSD_BYTES
    assert spy.written == spy.read_bytes == 3 * MIN_SSD_BYTES
    assert speed.write_seconds > 0 and speed.read_seconds > 0
    assert speed.write_bytes_per_s > 0 and speed.read_bytes_per_s > 0
    assert speed.read_bypassed_page_cache is (hasattr(os, "posix_fadvise")
                                              or os.uname().sysname == "Darwin")
    assert list(directory.iterdir()) == []
    # Named as a temporary file: a crash leaves nothing the SSD tier would keep.
    assert spy.paths and all(TMP_MARK in os.path.basename(p) for p in spy.paths)
    assert all(os.path.dirname(p) == str(directory) for p in spy.paths)


@pytest.mark.parametrize(("asked", "clamped"), [(1, MIN_SSD_BYTES), (0, MIN_SSD_BYTES),
                                                (-5, MIN_SSD_BYTES),
                                                (10**15, 2 * MIN_SSD_BYTES)])
def test_measure_ssd_clamps_the_size(tmp_path, monkeypatch, asked, clamped):
    """Between ``MIN_SSD_BYTES`` and ``MAX_SSD_BYTES`` whatever is asked (the maximum is
    lowered here: 4 GiB is no unit test)."""
    monkeypatch.setattr(selfbench, "MAX_SSD_BYTES", 2 * MIN_SSD_BYTES)
    spy = CountingOs()
    monkeypatch.setattr(selfbench, "os", spy)
    speed = measure_ssd(tmp_path, asked)
    assert speed.nbytes == clamped and spy.written == spy.read_bytes == clamped
    assert list(tmp_path.iterdir()) == []


def test_a_failed_read_leaves_no_file_behind(tmp_path, monkeypatch):
    """The error reaches the caller (the route answers it); the temporary file is gone."""
    spy = CountingOs(fail_read=True)
    monkeypatch.setattr(selfbench, "os", spy)
    with pytest.raises(OSError, match="Input/output error"):
        measure_ssd(tmp_path, MIN_SSD_BYTES)
    assert spy.written == MIN_SSD_BYTES  # the file was written before the read failed
    assert list(tmp_path.iterdir()) == []


def test_a_failed_read_through_os_read_leaves_no_file_behind(tmp_path, monkeypatch):
    """The same with ``os.read`` itself patched (as any caller of the module would see)."""
    def broken(fd: int, n: int) -> bytes:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "read", broken)
    with pytest.raises(OSError):
        measure_ssd(tmp_path, MIN_SSD_BYTES)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []


# ---- the prompt ------------------------------------------------------------------------------


def test_fixed_prompt_has_exactly_n_tokens_and_is_the_same_every_time():
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    text_ids = encode("The quick brown fox")
    for n in (1, 7, PROMPT_TOKENS, 3000):
        ids = fixed_prompt(encode, n)
        assert len(ids) == n and ids == fixed_prompt(encode, n)
        assert ids[:min(n, len(text_ids))] == text_ids[:n]
    assert len(fixed_prompt(encode)) == PROMPT_TOKENS
    long = fixed_prompt(encode, 3000)
    period = long.index(ord("T"), 1)  # the text repeats from its start
    assert long[period:2 * period] == long[:period]
    assert long[:10] == fixed_prompt(encode, 10)


def test_fixed_prompt_on_the_real_tokenizer(loaded):
    _, tokenizer = loaded
    ids = prompt_of(tokenizer, PROMPT_TOKENS)
    assert len(ids) == PROMPT_TOKENS and ids == prompt_of(tokenizer, PROMPT_TOKENS)
    assert "quick brown fox" in tokenizer.decode(ids[:20])


# ---- the model figure, through a real engine -----------------------------------------------


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_lm.load(str(materialize("tiny-dense", tmp_path_factory.mktemp("m"))))


def prompt_of(tokenizer, n: int) -> list[int]:
    return fixed_prompt(lambda text: tokenizer.encode(text, add_special_tokens=False), n)


def first_greedy_token(model, prompt: list[int]) -> int:
    """The token the model picks first on ``prompt`` (greedy, nothing masked)."""
    eng = Engine(model, stop_tokens=set(), max_batch_size=2, prefill_step_size=64)
    try:
        tokens: list[int] = []
        done = threading.Event()

        def sink(event: EngineEvent) -> None:
            if event.token is not None:
                tokens.append(event.token)
            if event.finish_reason or event.error:
                done.set()

        eng.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0), sink)
        assert done.wait(120)
        return tokens[0]
    finally:
        eng.shutdown()


def test_measure_model_decodes_every_token_with_eos_masked(loaded):
    """The model's own first greedy token is made its end of sequence (a stop token of the
    engine too): unmasked, the request would end at once; masked, it decodes every token
    asked for, so each run measures as many."""
    model, tokenizer = loaded
    prompt = prompt_of(tokenizer, 64)
    eos = first_greedy_token(model, prompt)
    eng = Engine(model, stop_tokens={eos}, max_batch_size=4, prefill_step_size=64)
    try:
        # Without the mask: it stops on its first token.
        ended: list[EngineEvent] = []
        done = threading.Event()
        eng.submit(prompt, SamplingParams(max_tokens=20, temperature=0.0),
                   lambda e: (ended.append(e), (e.finish_reason or e.error) and done.set()))
        assert done.wait(120)
        assert ended[-1].finish_reason == "stop"
        assert len([e for e in ended if e.token is not None]) <= 1
        before = eng.snapshot().generated_tokens
        speed = measure_model(eng, prompt, {eos}, decode_tokens=20, timeout=120)
        assert eng.snapshot().generated_tokens - before == 20
    finally:
        eng.shutdown()
    assert speed.prompt_tokens == 64
    assert speed.decode_tokens == 19  # 20 tokens: 19 after the first (the prefill's)
    assert speed.prefill_seconds > 0 and speed.prefill_tokens_per_s > 0
    assert speed.decode_seconds > 0 and speed.decode_tokens_per_s > 0
    assert speed.prefill_tokens_per_s == pytest.approx(64 / speed.prefill_seconds, rel=0.05)
    assert speed.decode_tokens_per_s == pytest.approx(19 / speed.decode_seconds, rel=0.05)
    assert speed.batch_busy is False


def test_run_self_benchmark_with_a_loaded_model_and_a_directory(loaded, tmp_path):
    """The whole run as the replica does it: the default prompt and decode length, the
    SSD figure in the cache directory, no notes."""
    model, tokenizer = loaded
    eos_ids = set(tokenizer.eos_token_ids)
    eng = Engine(model, stop_tokens=eos_ids, max_batch_size=4, prefill_step_size=512)
    service = SimpleNamespace(tokenizer=tokenizer, engine=eng, eos_ids=eos_ids)
    try:
        result = run_self_benchmark("tiny", "node-1", tmp_path / "kv", MIN_SSD_BYTES, service)
    finally:
        eng.shutdown()
    assert (result.model, result.node_id, result.notes) == ("tiny", "node-1", ())
    assert result.ssd is not None and result.ssd.nbytes == MIN_SSD_BYTES
    assert list((tmp_path / "kv").iterdir()) == []
    speed = result.model_speed
    assert speed is not None
    assert (speed.prompt_tokens, speed.decode_tokens) == (PROMPT_TOKENS, 127)
    assert speed.batch_busy is False
    assert result.to_json()["model_speed"]["decode_tokens"] == 127


def test_run_self_benchmark_without_ssd_or_model_says_both():
    result = run_self_benchmark("m", "node-1", None, MIN_SSD_BYTES, None)
    assert isinstance(result, SelfBenchmark)
    assert (result.ssd, result.model_speed) == (None, None)
    assert result.notes == (
        "the SSD tier is off (cache_store.ssd): no disk figures",
        "model 'm' is not loaded: no prefill or decode figures (load it, then run the "
        "benchmark again)")
    out = result.to_json()
    assert out["ssd"] is None and out["model_speed"] is None and len(out["notes"]) == 2
    assert out["at"] > 0 and out["model"] == "m" and out["node_id"] == "node-1"


def test_run_self_benchmark_with_only_a_directory(tmp_path):
    result = run_self_benchmark("m", "n", tmp_path, MIN_SSD_BYTES, None)
    assert result.ssd is not None and result.ssd.read_bytes_per_s > 0
    assert result.model_speed is None and len(result.notes) == 1
    assert "'m' is not loaded" in result.notes[0]
    assert list(tmp_path.iterdir()) == []
