"""One test per private seam in ``serve_app.models.compat``, against the installed mlx-lm and Ray.

An upgrade that moves or changes one of these internals fails its test here,
by name, before it fails a request.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator

from serve_app.models import compat
from serve_app.models.embedded import EMBEDDED_MODELS, materialize


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return materialize("tiny-hybrid", tmp_path_factory.mktemp("m"))


def test_download_model_keeps_a_local_directory(hybrid_dir):
    assert compat.download_model(str(hybrid_dir)) == hybrid_dir


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_model_classes_build_a_model_from_its_config(name):
    config = EMBEDDED_MODELS[name].config
    model_cls, args_cls = compat.model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    assert len(model.layers) == config["num_hidden_layers"]


def _states(caches: list) -> list[mx.array]:
    return [a for _, a in tree_flatten([c.state for c in caches]) if a is not None]


def test_batch_row_caches_are_the_live_rows_of_both_batches(hybrid_dir):
    model, tokenizer = mlx_lm.load(str(hybrid_dir))
    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=8,
                         stream=mx.default_stream(mx.default_device()))
    prompts = [list(range(3, 23)), list(range(40, 52))]  # two rows, different padding
    uids = gen.insert(prompts, max_tokens=[3, 3])
    with pytest.raises(KeyError):  # not in a batch yet: no live cache to read
        compat.batch_row_caches(gen, uids[0])
    seen = {"prompt": 0, "generation": 0}
    for _ in range(20):
        prompt_responses, responses = gen.next()
        live = [(p.uid, "prompt") for p in prompt_responses if not p.end_of_prompt]
        live += [(r.uid, "generation") for r in responses if r.finish_reason is None]
        rows = set()
        for uid, stage in live:
            caches, row = compat.batch_row_caches(gen, uid)
            assert caches is compat.batch_row_caches(gen, uid)[0]  # live, not a copy
            assert len(caches) == len(model.layers)
            rows.add(row)
            ours = _states([c.extract(row) for c in caches])
            public = _states(gen.extract_cache([uid])[uid][0])
            assert len(ours) == len(public)
            assert all(mx.array_equal(a, b).item() for a, b in zip(ours, public, strict=True))
            seen[stage] += 1
        assert len(rows) == len({uid for uid, _ in live})  # one row per request
        if not prompt_responses and not responses:
            break
    assert seen["prompt"] and seen["generation"], seen


def test_record_metric_zero_reaches_rays_recording_path():
    from ray.serve.metrics import Counter

    counter = Counter("serve_app_compat_probe", description="compat probe",
                      tag_keys=("model",))
    compat.record_metric_zero(counter, {"model": "m"})
    with pytest.raises(ValueError, match="tag"):  # Ray validated the labels: it recorded
        compat.record_metric_zero(counter, {"other": "m"})


def test_download_model_takes_the_tokenizers_files_only(hybrid_dir):
    """The ingress's tokenizer-only download: a local directory is kept as it is."""
    assert compat.download_model(str(hybrid_dir), allow_patterns=compat.TOKENIZER_FILES) \
        == hybrid_dir


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid"])
def test_token_bytes_are_the_raw_bytes_of_each_token(name, tmp_path):
    """A character split over tokens: each token's bytes are its part of the UTF-8."""
    from serve_app.models.embedded import materialize

    _, tokenizer = mlx_lm.load(str(materialize(name, tmp_path)))
    table = compat.token_bytes_table(tokenizer)
    assert table is not None
    text = "é ✓\n<tool_call>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    parts = [table(i) for i in ids]
    assert b"".join(parts) == text.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in parts)  # a lone byte of "é"


def test_wrapped_hf_tokenizer_is_the_hugging_face_tokenizer_inside_mlx_lms(hybrid_dir):
    """mlx-lm's ``TokenizerWrapper`` unwrapped; any other tokenizer is None."""
    from transformers import PreTrainedTokenizerBase

    _, tokenizer = mlx_lm.load(str(hybrid_dir))
    hf = compat.wrapped_hf_tokenizer(tokenizer)
    assert isinstance(hf, PreTrainedTokenizerBase)
    assert hf.encode("hello", add_special_tokens=False) \
        == tokenizer.encode("hello", add_special_tokens=False)
    assert compat.wrapped_hf_tokenizer(hf) is None


def test_serve_cli_runs_in_process_and_returns_its_exit_status(capsys):
    """``serve run`` as a click command called in this process (``serve_app.cli.launch``);
    its behaviour on a started Ray is tested end to end in ``tests/integration/test_launch.py``."""
    assert compat.run_serve_cli(["--help"]) == 0
    assert "Usage: serve run" in capsys.readouterr().out
    assert compat.run_serve_cli(["--no-such-flag"]) != 0


def test_an_installed_decode_step_sees_the_pipelined_batch_and_runs_plain_steps(hybrid_dir):
    """``install_decode_step``: the generator's decode steps go through ours, and
    ``DecodeRows`` reads the batch's pending token, history and budget; its plain step is
    mlx-lm's own (the same tokens as a generator left alone)."""
    model, _ = mlx_lm.load(str(hybrid_dir))
    prompts = [list(range(3, 23)), list(range(40, 52))]

    def tokens(install: bool) -> dict[int, list[int]]:
        gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=8,
                             stream=mx.default_stream(mx.default_device()))
        seen: list[tuple[list[int], list[int], list[int]]] = []

        def step(rows: compat.DecodeRows) -> list:
            pending = rows.pending()
            mx.eval(pending)
            seen.append(([int(t) for t in pending.tolist()],
                         [len(rows.tokens(i)) for i in range(len(rows.uids))],
                         [rows.remaining(i) for i in range(len(rows.uids))]))
            assert len(rows.pending_logprobs()) == len(rows.uids) and rows.model is model
            assert len(rows.caches) == len(model.layers)
            return rows.plain_step()

        if install:
            compat.install_decode_step(gen, step)
        uids = gen.insert(prompts, max_tokens=[4, 4])
        out: dict[int, list[int]] = {u: [] for u in uids}
        for _ in range(30):
            _, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.token)
        if install:
            # the shorter prompt reaches decoding first: nothing emitted yet, its cache
            # holds its prompt, and its pending token is the one it emits first
            assert seen[0] == ([out[uids[1]][0]], [len(prompts[1])], [4]), seen[0]
            assert sum(len(p) for p, _, _ in seen) == 8  # every token went through ours
        return out

    assert tokens(True) == tokens(False)


def test_recurrent_mixers_and_their_recorded_inputs(hybrid_dir):
    """``recurrent_mixers`` finds the mixer of every layer whose cache is recurrent, and
    ``recording_mixer_inputs`` hands back what each got: running a mixer alone on it
    from the same state gives the state the whole forward left (what a speculative
    rollback relies on). Outside the context nothing is recorded."""
    from mlx_lm.models.cache import ArraysCache, make_prompt_cache

    model, _ = mlx_lm.load(str(hybrid_dir))
    cache = make_prompt_cache(model)
    model(mx.array([list(range(3, 19))]), cache=cache)
    mixers = compat.recurrent_mixers(model, cache)
    assert mixers and [i for i, _ in mixers] == [
        i for i, c in enumerate(cache) if isinstance(c, ArraysCache)]
    before = [list(cache[i].cache) for i, _ in mixers]
    with compat.recording_mixer_inputs(mixers) as seen:
        model(mx.array([[7, 8, 9]]), cache=cache)
    assert sorted(seen) == [i for i, _ in mixers]
    after = [list(cache[i].cache) for i, _ in mixers]
    for (i, mixer), saved, want in zip(mixers, before, after, strict=True):
        cache[i].cache = saved
        mixer(seen[i], None, cache[i])
        assert all(mx.array_equal(a, b).item() for a, b in zip(cache[i].cache, want,
                                                              strict=True))
    with compat.recording_mixer_inputs([]) as nothing:
        model(mx.array([[1]]), cache=cache)
    assert nothing == {}


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-hybrid-mtp"])
def test_trunk_parts_and_the_recorded_final_hidden_state(name, tmp_path):
    """``trunk_parts`` finds the embedding, the output head and a full-attention layer of
    Qwen3-Next and Qwen3.5 models; the recorded output of the decoder stack, through the
    head, is the model's logits. Outside the context nothing is recorded."""
    model, _ = mlx_lm.load(str(materialize(name, tmp_path)))
    parts = compat.trunk_parts(model)
    layer = parts.inner.layers[parts.layer_index]
    assert not layer.is_linear and type(layer) is parts.layer_class
    assert parts.embed(mx.array([[3]])).shape == (1, 1, parts.args.hidden_size)
    tokens = mx.array([[5, 6, 7, 8]])
    with compat.recording_final_hidden(parts.inner) as seen:
        logits = model(tokens)
    assert len(seen) == 1 and seen[0].shape == (1, 4, parts.args.hidden_size)
    assert mx.allclose(parts.logits(seen[0]), logits).item()
    with compat.recording_final_hidden(None) as nothing:
        model(tokens)
    assert nothing == []
    with compat.recording_final_hidden(parts.inner) as seen:
        pass
    model(tokens)
    assert seen == []


def test_sync_sampled_tokens_patches_the_step_that_samples(hybrid_dir):
    """``sync_sampled_tokens`` relies on ``GenerationBatch._step`` leaving every row's
    sampled token in ``_next_tokens``: with the group of this one process (size 1, the
    sum of rank 0's tokens alone) a batch decodes exactly as without it, and the tokens
    it feeds are the synced array. Two ranks: ``tests/integration/test_sharded.py``."""
    from mlx_lm.generate import GenerationBatch

    model, _ = mlx_lm.load(str(hybrid_dir))

    def decode() -> list[int]:
        gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=2)
        (uid,) = gen.insert([[5, 6, 7, 8, 9]], max_tokens=[6])
        out: list[int] = []
        while len(out) < 6:
            _, responses = gen.next()
            out += [r.token for r in responses if r.uid == uid]
        gen.close()
        return out

    plain = decode()
    compat.sync_sampled_tokens(mx.distributed.init())  # installs the patch
    seen = []
    original = GenerationBatch._step  # the patched step

    def watch(self):
        out = original(self)
        seen.append(self._next_tokens)
        return out

    try:
        GenerationBatch._step = watch  # under the patch: sees what it left
        synced = decode()
    finally:
        GenerationBatch._step = original
        compat.sync_sampled_tokens(None)
    assert synced == plain and seen
    assert GenerationBatch.__dict__.get("_serve_app_syncs_tokens")


def test_a_rows_sampler_is_the_object_mlx_lms_plain_step_calls(hybrid_dir):
    """``DecodeRows.sampler``: a row inserted with its own sampler gets that very object (a
    verify step draws with it, so both step kinds share its position); a row without one
    gets the generator's fallback; mlx-lm's plain step calls the row's own."""
    model, _ = mlx_lm.load(str(hybrid_dir))
    calls: list[int] = []

    def mine(logprobs: mx.array) -> mx.array:
        calls.append(logprobs.shape[0])
        return mx.argmax(logprobs, axis=-1)

    gen = BatchGenerator(model, stop_tokens=[], prefill_step_size=8,
                         stream=mx.default_stream(mx.default_device()))
    seen: list[tuple[bool, bool]] = []

    def step(rows: compat.DecodeRows) -> list:
        for i, uid in enumerate(rows.uids):
            sampler = rows.sampler(i)
            seen.append((uid == uids[0], sampler is mine))
            assert callable(sampler)
        return rows.plain_step()

    compat.install_decode_step(gen, step)
    uids = gen.insert([list(range(3, 23)), list(range(40, 52))], max_tokens=[4, 4],
                      samplers=[mine, None])
    before = len(calls)
    for _ in range(30):
        gen.next()
    assert seen and all(is_mine == own for own, is_mine in seen), seen
    assert any(own for own, _ in seen) and not all(own for own, _ in seen)
    assert len(calls) > before  # the plain step drew with the row's own sampler
