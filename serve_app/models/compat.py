"""Every use of mlx-lm's or Ray's private internals, one named function each.

Private names can change in any release. Keeping them here, each with a test
in ``tests/unit/test_compat.py`` run against the installed versions, means an
upgrade that breaks one fails one named test instead of a request somewhere.
Imports are lazy: the ingress loads this module without loading MLX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # llguidance types its JSON compile options only in its private module.
    from llguidance._lib import JsonCompileOptions as JsonCompileOptions
    from mlx_lm.models.base import BaseModelArgs

# What ``mlx_lm.utils.load_tokenizer`` downloads (mlx-lm 0.32): a tokenizer, no weights.
TOKENIZER_FILES = ["*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
                   "*.jsonl", "*.jinja"]


def download_model(path_or_repo: str, revision: str | None = None,
                   allow_patterns: list[str] | None = None) -> Path:
    """The local directory of a model: a path as is, a hub repo id downloaded.

    Relies on ``mlx_lm.utils._download`` (mlx-lm 0.32), the helper ``mlx_lm.load``
    uses with mlx-lm's own file patterns. ``mlx_lm.load`` does not return the
    directory, and the prefix cache needs it to digest the weight files.
    """
    from mlx_lm.utils import _download

    if allow_patterns is not None:
        return Path(_download(path_or_repo, revision=revision, allow_patterns=allow_patterns))
    return Path(_download(path_or_repo, revision=revision))


def model_classes(config: dict) -> tuple[type, type[BaseModelArgs]]:
    """mlx-lm's (Model, ModelArgs) classes for a config's ``model_type``.

    Relies on ``mlx_lm.utils._get_classes`` (mlx-lm 0.32): there is no public way
    to build a model from a config alone, which the embedded random-weight
    models need before they are saved in mlx-lm's format.
    """
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def batch_row_caches(generator: Any, uid: int) -> tuple[list, int]:
    """The running batch's per-layer caches holding ``uid``, and its row in them.

    Relies on ``BatchGenerator._find_uids`` (stage 1: prompt batch, 2:
    generation batch), ``_prompt_batch``, ``_generation_batch`` and their
    ``prompt_cache`` (mlx-lm 0.32). The public ``extract_cache`` copies the whole
    history, which at every block boundary would make capture quadratic.
    """
    stage, row = generator._find_uids([uid])[uid]
    if stage not in (1, 2):
        raise KeyError(f"request {uid} is not in a running batch (stage {stage})")
    batch = generator._prompt_batch if stage == 1 else generator._generation_batch
    return batch.prompt_cache, row


def install_decode_step(generator: Any, step: Callable[[DecodeRows], list]) -> None:
    """Route the generator's decode steps through ``step`` (speculative decoding).

    Relies on ``BatchGenerator._generation_batch`` (made once, in ``__init__``, and only
    extended and filtered after) and on its ``next`` being what ``BatchGenerator._next``
    calls for one decode step of the whole batch (mlx-lm 0.32). ``step`` gets the batch
    wrapped in ``DecodeRows`` and returns ``GenerationBatch.Response`` objects.
    """
    batch = generator._generation_batch
    rows = DecodeRows(batch)
    batch.next = lambda: step(rows)


class DecodeRows:
    """What a decode step needs of mlx-lm's ``GenerationBatch`` (mlx-lm 0.32), by name.

    The batch is pipelined: ``pending`` holds each row's token sampled last step and
    not yet fed to the model (``pending_logprobs`` its distribution); ``tokens(i)`` is
    what row ``i``'s cache holds. ``plain_step`` is mlx-lm's own one-token step.
    """

    def __init__(self, batch: Any) -> None:
        self._batch = batch
        self._plain_next = type(batch).next.__get__(batch)

    def plain_step(self) -> list:
        return self._plain_next()

    @property
    def model(self) -> Any:
        return self._batch.model

    @property
    def uids(self) -> list[int]:
        return self._batch.uids

    @property
    def caches(self) -> list[Any]:
        return self._batch.prompt_cache

    def pending(self) -> Any:
        return self._batch._next_tokens

    def pending_logprobs(self) -> list[Any]:
        return self._batch._next_logprobs

    def set_pending(self, tokens: Any, logprobs: list[Any]) -> None:
        self._batch._next_tokens = tokens
        self._batch._next_logprobs = logprobs

    def tokens(self, row: int) -> list[int]:
        return self._batch.tokens[row]

    def processors(self, row: int) -> list:
        return list(self._batch.logits_processors[row] or ())

    def sampler(self, row: int) -> Any:
        """The row's sampler: the very object mlx-lm's plain step calls (a verify step
        draws with it too, so both step kinds share its state)."""
        samplers = self._batch.samplers
        sampler = samplers[row] if samplers else None
        return self._batch.fallback_sampler if sampler is None else sampler

    def context(self, row: int) -> Any:
        """The tokens the row's processors have seen (an ``mx.array``)."""
        return self._batch._token_context[row].tokens

    def feed_context(self, row: int, tokens: Any) -> None:
        self._batch._token_context[row].update_and_fetch(tokens)

    def remaining(self, row: int) -> int:
        """Tokens the row may still emit before its ``max_tokens``."""
        return self._batch.max_tokens[row] - self._batch._num_tokens[row]

    def count(self, row: int, token: int) -> str | None:
        """Count one emitted token of ``row``: its finish reason, if it ends the row."""
        batch = self._batch
        batch._num_tokens[row] += 1
        reason = "length" if batch._num_tokens[row] >= batch.max_tokens[row] else None
        if batch._matchers[row].advance(token):
            reason = "stop"
        return reason

    def response(self, row: int, token: int, logprobs: Any, finish_reason: str | None,
                 cache: list | None = None) -> Any:
        """One emitted token as mlx-lm's ``GenerationBatch.Response``; ``cache``: the row's
        own cache (``extract``) once it ends."""
        batch = self._batch
        return type(batch).Response(
            uid=batch.uids[row], token=token, logprobs=logprobs, finish_reason=finish_reason,
            prompt_cache=cache, all_tokens=batch.tokens[row] if cache is not None else None)

    def extract(self, row: int) -> list:
        return self._batch.extract_cache(row)

    def keep(self, rows: list[int]) -> None:
        if len(rows) < len(self._batch.uids):
            self._batch.filter(rows)


# Where a decoder layer keeps its recurrent mixer (GDN in Qwen3-Next and Qwen3.5).
MIXER_NAMES = ("linear_attn", "mixer", "mamba")
_recording = threading.local()  # per engine thread: mixers watched, inputs seen


def recurrent_mixers(model: Any, caches: list) -> list[tuple[int, Any]] | None:
    """``(layer index, mixer module)`` of every layer whose cache is an ``ArraysCache``;
    None when a recurrent layer keeps its mixer under a name we do not know.

    Relies on ``model.layers`` lining up with the model's cache list (``make_cache`` of
    every mlx-lm model with recurrent layers, 0.32) and on the mixer being called as
    ``mixer(x, mask, cache)`` (the decoder layers of ``qwen3_next`` and ``qwen3_5``).
    """
    from mlx_lm.models.cache import ArraysCache

    out = []
    for i, (layer, cache) in enumerate(zip(model.layers, caches, strict=False)):
        if not isinstance(cache, ArraysCache):
            continue
        mixer = next((getattr(layer, n) for n in MIXER_NAMES if hasattr(layer, n)), None)
        if mixer is None:
            return None
        out.append((i, mixer))
    return out


@contextlib.contextmanager
def recording_mixer_inputs(mixers: list[tuple[int, Any]]) -> Iterator[dict[int, Any]]:
    """While open, each watched mixer's input (by layer index) lands in the dict yielded:
    a rollback can then run the recurrent mixers alone again, not the whole model.

    Patches the mixers' classes' ``__call__`` once per class (a pass-through unless this
    thread is recording), since MLX modules cannot be wrapped per instance without
    changing their parameter tree.
    """
    for _, mixer in mixers:
        _record_inputs_of(type(mixer))
    seen: dict[int, Any] = {}
    _recording.watch = {id(m): i for i, m in mixers}
    _recording.seen = seen
    try:
        yield seen
    finally:
        _recording.watch = None


def _record_inputs_of(cls: type) -> None:
    if cls.__dict__.get("_serve_app_records_inputs"):
        return
    original = cls.__call__

    def __call__(self, inputs, *args, **kwargs):
        watch = getattr(_recording, "watch", None)
        if watch is not None and id(self) in watch:
            _recording.seen[watch[id(self)]] = inputs
        return original(self, inputs, *args, **kwargs)

    cls.__call__ = __call__  # type: ignore[method-assign]
    cls._serve_app_records_inputs = True  # type: ignore[attr-defined]


@dataclasses.dataclass(frozen=True)
class TrunkParts:
    """What a model's own MTP head shares with the model (``serve_app.models.mtp``):
    the token embedding, the output head, the text config, and where a full-attention
    decoder layer is (the MTP layer is one of those)."""

    inner: Any  # the decoder stack; its output is the final, normed hidden state
    embed: Callable[[Any], Any]
    logits: Callable[[Any], Any]
    args: Any
    layer_class: type
    layer_index: int


def trunk_parts(model: Any) -> TrunkParts:
    """The parts of a Qwen3-Next or Qwen3.5 model an MTP head reads.

    Relies on mlx-lm 0.32's layout of those models: ``model.model`` is the decoder
    stack (``language_model.model`` for Qwen3.5, through a property), whose ``layers``
    are decoder layers built as ``cls(args, layer_idx)`` with ``is_linear`` false for
    full attention; the head is ``lm_head`` unless ``tie_word_embeddings``.
    """
    text = getattr(model, "language_model", model)
    inner = text.model
    args = text.args
    index = next((i for i, layer in enumerate(inner.layers)
                  if not getattr(layer, "is_linear", True)), None)
    if index is None:
        raise ValueError(f"{type(model).__module__}: no full-attention decoder layer for "
                         "an MTP head")
    head = (inner.embed_tokens.as_linear if args.tie_word_embeddings else text.lm_head)
    return TrunkParts(inner, inner.embed_tokens, head, args, type(inner.layers[index]), index)


_hidden = threading.local()  # per engine thread: the decoder stack watched, outputs seen


@contextlib.contextmanager
def recording_final_hidden(inner: Any) -> Iterator[list[Any]]:
    """While open, each output of the decoder stack ``inner`` (the hidden state the
    output head reads, ``(batch, positions, hidden)``) is appended to the list yielded:
    an MTP head drafts from it. Patches the stack's class once, as
    ``recording_mixer_inputs`` does; nothing is computed that the model does not.
    ``inner`` None records nothing."""
    if inner is None:
        yield []
        return
    cls = type(inner)
    if not cls.__dict__.get("_serve_app_records_output"):
        original = cls.__call__

        def __call__(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            if getattr(_hidden, "watch", None) == id(self):
                _hidden.seen.append(out)
            return out

        cls.__call__ = __call__
        cls._serve_app_records_output = True
    seen: list[Any] = []
    _hidden.watch, _hidden.seen = id(inner), seen
    try:
        yield seen
    finally:
        _hidden.watch = None


_sync = threading.local()  # per engine thread: the group whose ranks share sampled tokens


def sync_sampled_tokens(group: Any | None) -> None:
    """From now on, on this thread, every decode step's sampled tokens are rank 0's on
    every rank of ``group`` (None: off): one collective of a token per request, inside
    the step's own graph, so mlx-lm's pipelined step is not stalled. Other ranks then
    need neither the requests' samplers nor their logits processors.

    Patches ``GenerationBatch._step`` (mlx-lm 0.32), where every sampled token of a
    batch is made (the first one too: a new batch steps once as it is built), and which
    leaves them in ``_next_tokens``.
    """
    from mlx_lm.generate import GenerationBatch

    cls = GenerationBatch
    if not cls.__dict__.get("_serve_app_syncs_tokens"):
        original = cls._step

        def _step(self):
            out = original(self)
            group = getattr(_sync, "group", None)
            if group is not None:
                import mlx.core as mx

                tokens = self._next_tokens
                mine = tokens if group.rank() == 0 else mx.zeros_like(tokens)
                self._next_tokens = mx.distributed.all_sum(mine, group=group)
                mx.async_eval(self._next_tokens)
            return out

        cls._step = _step  # type: ignore[method-assign]
        cls._serve_app_syncs_tokens = True  # type: ignore[attr-defined]
    _sync.group = group


def record_metric_zero(metric: Any, labels: dict[str, str]) -> None:
    """Record 0 on a Ray metric series, so a known series exists before its first event.

    Relies on ``ray.util.metrics.Metric._record`` (Ray 2.60): the public
    ``Counter.inc`` refuses 0, and a counter that is missing until its first
    event makes ``rate()`` absent rather than 0.
    """
    metric._record(0.0, tags=labels)


# Ray Serve (2.60) reads these at import time in each replica process
# (``ray.serve._private.constants``), so they travel in the deployment's
# runtime_env. By default a replica runs user code on a second event-loop thread
# and hands every request and every streamed item between the two loops
# (``_enqueue_thread_safe``, chained futures): Python work that takes the GIL
# from the engine thread at each chunk. On the main loop that handoff is gone:
# the decode step in the replica measured 3.8 ms instead of 4.2-4.7 ms (in-process
# engine 4.0 ms) on the tiny hybrid model; see bench/results/HISTORY.md.
SERVE_REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
}


# The resource every Ray head node has (1.0, Ray 2.60's ``HEAD_NODE_RESOURCE_NAME``):
# asking for a sliver of it places an actor on the head; its presence marks the head in
# ``ray.nodes()``.
HEAD_NODE_RESOURCE = "node:__internal_head__"


async def assigned_to_replica(response: Any) -> None:
    """Return once Serve's router has assigned a handle call (``DeploymentResponse`` or
    ``DeploymentResponseGenerator``) to a replica: before that, the call waits in the
    router (no replica taken, or probing one). Serve's own ``_to_object_ref`` waits on the
    same, but only for calls made by reference and gives no generator."""
    await response._fetch_future_result_async()


def prefix_cache_affinity_router() -> type:
    """Ray's ``PrefixCacheAffinityRouter`` class, from the module that defines it: its
    public path (``ray.serve.llm.request_router``) also imports ``KVAwareRouter``, whose
    configuration needs pyarrow, which a Serve install does not have."""
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter,
    )

    return PrefixCacheAffinityRouter


# Ray's internal settings (``ray.init(_system_config=...)``, names from Ray 2.60's
# ``ray_config_def.h``) for ``serve_app.cli.launch``: Ray keeps up to one idle worker process
# per CPU for tasks and prestarts one for the driver (``ray::IDLE``, ~80 MiB each); Serve
# runs every replica, the controller, the proxy and our cache store as actors, each in a
# process of its own, so a pooled idle worker serves nothing here.
LEAN_RAY_SYSTEM_CONFIG = {"num_workers_soft_limit": 0, "prestart_worker_first_driver": False}


def run_serve_cli(args: list[str]) -> int:
    """Serve's ``serve run`` command (``ray.serve.scripts.run``, a click command) in this
    process, on the Ray this process has already started; its exit status.

    Relies on ``serve run`` skipping its own ``ray.init`` when Ray is initialized, and
    on its ``KeyboardInterrupt`` ending in ``sys.exit()`` (Ray 2.60): the command, not a
    copy of its deployment code, is what ``serve_app.cli.launch`` runs.
    """
    import click
    from ray.serve.scripts import run

    try:
        run.main(args=args, prog_name="serve run", standalone_mode=False)
    except click.ClickException as exc:  # a usage error: shown as ``serve run`` shows it
        exc.show()
        return exc.exit_code
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def serve_replica_env() -> dict[str, str]:
    """Environment variables for our Serve replicas (see ``SERVE_REPLICA_ENV``)."""
    return dict(SERVE_REPLICA_ENV)


def wrapped_hf_tokenizer(tokenizer: Any) -> Any | None:
    """The Hugging Face tokenizer inside mlx-lm's ``TokenizerWrapper`` (its private
    ``_tokenizer``, mlx-lm 0.32: the wrapper has no public way to it), or None for any
    other tokenizer. Imports nothing: without ``mlx_lm.tokenizer_utils`` loaded, no
    wrapper exists to unwrap (the ingress compiles grammars without MLX)."""
    utils = sys.modules.get("mlx_lm.tokenizer_utils")
    if utils is None or not isinstance(tokenizer, utils.TokenizerWrapper):
        return None
    return tokenizer._tokenizer


def token_bytes_table(tokenizer: Any) -> Callable[[int], bytes] | None:
    """Each token id's raw bytes (logprobs' ``bytes``: a token may hold part of a UTF-8
    character, which its decoded text cannot show), from the tables of the streaming
    detokenizer mlx-lm picked (mlx-lm 0.32: ``BPEStreamingDetokenizer.tokenmap`` of
    byte-level strings with ``_byte_decoder``, ``SPMStreamingDetokenizer.tokenmap`` of
    bytes). None for another detokenizer: then the caller encodes the decoded text.
    Built once per tokenizer: the tables cover the whole vocabulary."""
    from mlx_lm import tokenizer_utils as tu

    detokenizer = tokenizer.detokenizer
    table = getattr(detokenizer, "tokenmap", None)
    if table is None:
        return None
    if isinstance(detokenizer, tu.SPMStreamingDetokenizer):
        return lambda token: table[token] if token < len(table) else b""
    if isinstance(detokenizer, tu.BPEStreamingDetokenizer):
        decoder = tu._byte_decoder()

        def byte_level(token: int) -> bytes:
            text = table[token] if token < len(table) else ""
            if token in special:  # added tokens are text, not byte-level strings
                return text.encode()
            return b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in text)

        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        special |= set(getattr(getattr(tokenizer, "_tokenizer", None), "added_tokens_decoder",
                               {}) or {})
        return byte_level
    return None



def kv_put(namespace: str, key: str, value: bytes) -> None:
    """Write ``key`` in Ray's cluster-wide KV store (the GCS), overwriting it.

    Relies on ``ray.experimental.internal_kv`` (Ray 2.60), the store Serve keeps its own
    checkpoints in: a replica still in its constructor can write there, and any process
    of the cluster read it, with no actor of ours to start first.
    """
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def kv_delete(namespace: str, key: str) -> None:
    """Remove ``key`` from Ray's KV store (see ``kv_put``)."""
    from ray.experimental import internal_kv

    if internal_kv._internal_kv_initialized():
        internal_kv._internal_kv_del(key, namespace=namespace)


def kv_items(namespace: str, prefix: str) -> dict[str, bytes]:
    """Every key under ``prefix`` in Ray's KV store with its value (see ``kv_put``)."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        return {}
    out: dict[str, bytes] = {}
    for key in internal_kv._internal_kv_list(prefix, namespace=namespace):
        value = internal_kv._internal_kv_get(key, namespace=namespace)
        if value is not None:
            out[key.decode() if isinstance(key, bytes) else key] = value
    return out


def log_dir() -> str:
    """Where this Ray session writes its logs (Serve's are in ``serve/`` below it).

    Relies on ``ray._private.worker.global_worker.node`` (Ray 2.60): Ray has no public
    call for its session's log directory; ``/tmp/ray/session_latest/logs`` when unknown.
    """
    try:
        import ray._private.worker as worker

        node: Any = worker.global_worker.node
        return str(node.get_logs_dir_path())
    except Exception:
        return "/tmp/ray/session_latest/logs"


# The vision-language families whose images this server places, by ``model_type``: the
# layout of mlx-vlm's multimodal rotary embedding for each (its language modules' ``style``:
# Qwen3.5's sections interleaved, Qwen2.5-VL's in chunks). Both add the image features to
# the embeddings only (no deepstack, no bidirectional image attention), which is what the
# splice does.
MROPE_STYLES = {"qwen3_5": "interleaved", "qwen3_5_moe": "interleaved",
                "qwen2_5_vl": "chunked"}


def mrope_positions(tokens: list[int], grids: list[tuple[int, int, int]],
                    config: dict) -> tuple[Any, int]:
    """A prompt's multimodal rotary positions, (3, len) int32, and its delta (a generated
    token at index ``i`` sits at ``i + delta``), as mlx-vlm computes them for the model.

    Relies on ``mlx_vlm.models.<model_type>.language.LanguageModel.get_rope_index``
    (mlx-vlm 0.7; Qwen3.5's and Qwen2.5-VL's read the same four config fields), called
    unbound with the config it reads (no text stack is built for it): one home for the
    positions mlx-vlm's own generation gives the same model.
    """
    import importlib
    import types

    import mlx.core as mx
    import numpy as np

    language = importlib.import_module(f"mlx_vlm.models.{config['model_type']}.language")
    vision = types.SimpleNamespace(spatial_merge_size=config["vision_config"].get(
        "spatial_merge_size", 2))
    owner = types.SimpleNamespace(config=types.SimpleNamespace(
        vision_config=vision, image_token_id=config["image_token_id"],
        video_token_id=config.get("video_token_id", -1),
        vision_start_token_id=config["vision_start_token_id"]))
    grid = mx.array(grids, dtype=mx.int32) if grids else None
    positions, delta = language.LanguageModel.get_rope_index(owner, mx.array([tokens]), grid)
    return np.asarray(positions[:, 0, :], dtype=np.int32), int(np.asarray(delta).reshape(-1)[0])


def vision_tower_classes(model_type: str) -> tuple[type, type]:
    """mlx-vlm's (VisionModel, VisionConfig) for a model type (mlx-vlm 0.7's module
    layout: ``mlx_vlm.models.<type>.vision`` and ``.config``)."""
    import importlib

    vision = importlib.import_module(f"mlx_vlm.models.{model_type}.vision")
    config = importlib.import_module(f"mlx_vlm.models.{model_type}.config")
    return vision.VisionModel, config.VisionConfig


def override_call(module: Any, call: Callable[..., Any], tag: str) -> None:
    """Make ``module(...)`` run ``call(module, original_call, ...)``, leaving its
    parameters where they are (a wrapper module would move them in the model's tree).

    Python looks special methods up on the class, so the instance gets a subclass of its
    own class; ``tag`` names it (and marks it: overriding twice raises)."""
    cls = type(module)
    if getattr(cls, "_serve_app_override", None):
        raise RuntimeError(f"{cls.__name__} is already overridden")
    original = cls.__call__

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return call(self, original, *args, **kwargs)

    module.__class__ = type(f"{tag}{cls.__name__}", (cls,),
                            {"__call__": __call__, "_serve_app_override": tag})


def final_hidden(model: Any, ids: Any) -> Any:
    """A decoder's final, normed hidden states (B, L, D) for token ids (B, L), without its
    output head: mlx-lm 0.32's ``model.model`` (``language_model.model`` for a vision
    checkpoint loaded as text), called with no cache (a causal mask)."""
    text = getattr(model, "language_model", model)
    return text.model(ids)


def output_logits(model: Any, hidden: Any) -> Any:
    """A decoder's output head over final hidden states (..., D): its ``lm_head``, or its
    tied embedding (``args.tie_word_embeddings``; mlx-lm 0.32's layout, as ``trunk_parts``)."""
    text = getattr(model, "language_model", model)
    if getattr(text.args, "tie_word_embeddings", False):
        return text.model.embed_tokens.as_linear(hidden)
    return text.lm_head(hidden)
