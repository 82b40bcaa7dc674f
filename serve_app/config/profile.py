"""Profiles: the application ``args`` of a Ray Serve config file.

A profile names the models to serve and how. It is validated before any
actor starts, and every error names the file (when known) and the key, e.g.
``configs/qwen.yaml: applications[0].args.models[0].max_batch_size: ...``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    ByteSize,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from serve_app.config.catalog import (
    EMBEDDED_PREFIX,
    default_task,
    embedded_names,
    profile_defaults,
)
from serve_app.config.chat_templates import check_chat_template, check_tool_call_format
from serve_app.config.chat_templates import tokenizer_config as _tokenizer_config
from serve_app.config.model_sections import (
    KVCacheProfile,
    PoolingProfile,
    ReasoningProfile,
    VisionProfile,
)
from serve_app.config.normalize_rules import RULE_NAMES
from serve_app.config.validation import SizeOrAuto, Strict, clean_loc

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ProfileError(ValueError):
    """A profile is invalid; the message names the file and the key."""


PositiveInt = Annotated[int, Field(ge=1)]



class SamplingDefaults(Strict):
    """Sampling used when a request does not say."""

    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0


class CacheProfile(Strict):
    """Prefix caching for one model."""

    enabled: bool = True
    # Tokens per block. Default: 64 for attention-only models; 256 for hybrid
    # models, whose every block boundary stores a recurrent-state checkpoint
    # (tens of MB per checkpoint on real Qwen3.5/3-Next models).
    block_size: Annotated[int, Field(ge=1, le=65536)] | None = None
    isolate_by_api_key: bool = False
    # Where hybrid models keep recurrent checkpoints on SSD: "auto" (sidecar
    # files whenever the SSD tier is on), "ssd_sidecar", or "embedded" in the
    # block file.
    gdn_snapshot_storage: Literal["auto", "ssd_sidecar", "embedded"] = "auto"
    sidecar_codec: Literal["fp32", "bf16", "int8", "rht_int8", "rht_int16"] = "fp32"
    # Hybrid models: a recurrent checkpoint every this many tokens (a multiple of
    # block_size; default: as many blocks as weigh one checkpoint in KV, or every block
    # when block_size is set), plus one at each prompt's last block
    # boundary and the newest one reached while decoding. Larger values pause
    # prefill less often and store fewer checkpoints, but restore at coarser points.
    checkpoint_interval: Annotated[int, Field(ge=1)] | None = None


class CacheStoreProfile(Strict):
    """The per-node cache-store actor, shared by every model replica on the node."""

    # Bytes, or ``auto``: what the memory plan leaves once the models are loaded, within
    # 256 MiB-16 GiB (``serve_app/memory/plan.py``).
    hot_budget: SizeOrAuto = 1 << 30
    ssd: bool = True
    # Default: ~/.cache/serve_app/kv. "{node_id}" in it becomes the Ray node's id:
    # for several Ray nodes on one machine (each needs a directory of its own).
    ssd_dir: str | None = None
    ssd_cache_max_size: ByteSize | Literal["auto"] = "auto"
    ssd_min_free: ByteSize = ByteSize(1 << 30)
    gdn_ssd_pending_max_size: ByteSize = ByteSize(512 * 1000 * 1000)
    # Bytes the SSD tier may write in any rolling hour; writes over it are dropped and
    # counted. ``auto``: 2% of the cache volume's size an hour (``serve_app/cache/wear.py``
    # says why: about half a typical SSD's rated endurance over five years of 8-hour days).
    ssd_write_budget_per_hour: SizeOrAuto = "auto"
    # Report this node's blocks to the cluster's block directory: "auto" once the
    # cluster has a second node (a one-node server pays nothing for it).
    directory: Literal["auto", "on", "off"] = "auto"
    # A request waits at most this long for one call to a cache store (a lookup, a
    # release) or another node's store (a fetch); then it prefills cold. After
    # ``breaker_failures`` failed or late calls in a row a store (or a node) is skipped
    # for ``breaker_cool_down_s``, then tried again.
    call_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = 5.0
    breaker_failures: Annotated[int, Field(ge=1)] = 3
    breaker_cool_down_s: Annotated[float, Field(gt=0.0)] = 10.0


class RoutingProfile(Strict):
    """How requests pick one of a model's replicas."""

    # "prefix": the replica that has the least to prefill, by the cluster's block
    # directory (the ingress tokenizes each request for it); "default": Ray Serve's
    # own router (power of two choices); "ray_prefix": Ray's PrefixCacheAffinityRouter
    # (ray.serve.llm: a prefix tree of prompt text); "auto": "prefix" when the model has
    # more than one replica.
    mode: Literal["auto", "prefix", "default", "ray_prefix"] = "auto"
    # What one request waiting for a batch slot (the replica's batch is full) counts for,
    # in prompt tokens to prefill. A replica with free slots costs about nothing more per
    # request it runs: cached prefixes win until a batch is full.
    load_cost_tokens: Annotated[float, Field(ge=0.0)] = 512.0
    # mode "ray_prefix": Ray's imbalanced_threshold (prefix affinity while replicas' queue
    # lengths differ by less than this; null: Ray's default, no limit).
    ray_imbalanced_threshold: Annotated[float, Field(gt=0.0)] | None = None


class SpeculativeProfile(Strict):
    """Speculative decoding (``serve_app/serving/speculative.py``): each decode step drafts
    up to ``num_draft_tokens`` per request and the model verifies them in one forward.
    Output is exactly what plain decoding gives at temperature 0, and distributed as it
    above. ``adaptive`` lets each step's depth follow acceptance and the verify cost
    measured on this host (down to plain steps); false keeps it fixed."""

    # "ngram": prompt lookup (the n-gram that followed the same context earlier in the
    # prompt or the output); no model. "draft": ``draft_model`` (same tokenizer) drafts.
    # "mtp": the model's own multi-token-prediction head (``mtp.*`` weights of a Qwen3-Next
    # or Qwen3.5 checkpoint).
    method: Literal["ngram", "draft", "mtp"]
    num_draft_tokens: Annotated[int, Field(ge=1, le=16)] = 4
    adaptive: bool = True
    ngram_max: Annotated[int, Field(ge=1, le=8)] = 3  # longest n-gram matched
    ngram_min: Annotated[int, Field(ge=1, le=8)] = 1  # shortest n-gram matched
    draft_model: str | None = None  # a source, as ``models[].source``
    # the most recent tokens of a request the draft model (or MTP head) reads when it
    # starts drafting
    draft_context: Annotated[int, Field(ge=16)] = 1024

    @field_validator("draft_model")
    @classmethod
    def _check_draft_source(cls, value: str | None) -> str | None:
        if value is not None:
            source_kind(value)
        return value

    @model_validator(mode="after")
    def _check_sizes(self) -> SpeculativeProfile:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) is larger than ngram_max "
                             f"({self.ngram_max})")
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("method draft needs draft_model: the source of a smaller model "
                             "with the same tokenizer")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError("draft_model applies to method: draft only")
        return self


class ParallelProfile(Strict):
    """One model across several processes (Macs) over ``mlx.distributed``
    (``serve_app/parallel``): ``tensor: N`` splits every layer's heads and MLP over N
    ranks, ``pipeline: N`` splits its layers. The replica is rank 0; the others run as
    Ray actors in its placement group, one per node (``spread``) or all on its node
    (``pack``: tests, and trying it on one Mac)."""

    tensor: Annotated[int, Field(ge=2, le=64)] | None = None
    pipeline: Annotated[int, Field(ge=2, le=64)] | None = None
    placement: Literal["spread", "pack"] = "spread"
    # "ring": TCP between the ranks' nodes; "jaccl": RDMA over Thunderbolt 5 (Macs only).
    distributed_backend: Literal["ring", "jaccl"] = "ring"
    # A rank that does not answer a ping within this many seconds is lost: the replica
    # turns unhealthy and its requests end with 503.
    rank_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = 10.0

    @model_validator(mode="after")
    def _one_mode(self) -> ParallelProfile:
        if (self.tensor is None) == (self.pipeline is None):
            raise ValueError("set exactly one of tensor: N or pipeline: N (mlx-lm shards "
                             "one model over one group in one mode)")
        return self

    @property
    def mode(self) -> str:
        return "tensor" if self.tensor is not None else "pipeline"

    @property
    def size(self) -> int:
        return self.tensor or self.pipeline or 1


class ModelProfile(Strict):
    """One served model: where it comes from and how it is batched."""

    name: str
    source: str
    revision: str | None = None
    # The model pool (issue 22): a pinned model is never unloaded; an unpinned one may be
    # unloaded after ``idle_unload_s`` seconds without requests (None: only to make room).
    pinned: bool = False
    idle_unload_s: Annotated[float, Field(gt=0.0)] | None = None
    context_length: Annotated[int, Field(ge=16)] = 4096
    max_batch_size: Annotated[int, Field(ge=1, le=512)] = 8
    max_queued_requests: Annotated[int, Field(ge=0)] = 64
    max_tokens: PositiveInt = 512
    prefill_step_size: PositiveInt = 512
    stream_interval_ms: Annotated[float, Field(ge=0.0, le=1000.0)] = 25.0
    # All of a replica's streams together send at most this many chunks a second:
    # with many streams running each one's interval stretches (up to 1 s). Every
    # chunk costs CPU in the replica, the ingress and the proxy, taken from decoding.
    stream_chunks_per_second: Annotated[float, Field(gt=0.0)] = 80.0
    sampling: SamplingDefaults = SamplingDefaults()
    num_replicas: PositiveInt = 1
    # At most this many replicas on one node: 1 for one replica per Mac of a cluster.
    max_replicas_per_node: PositiveInt | None = None
    # Custom Ray resources each replica needs (to pin replicas to nodes started with
    # ``ray start --resources``).
    resources: dict[str, Annotated[float, Field(gt=0.0)]] = {}
    routing: RoutingProfile = RoutingProfile()
    num_cpus: Annotated[float, Field(ge=0.0)] = 0.0
    cpu_threads: Annotated[int, Field(ge=1)] | None = None
    # Bound on a prompt's characters, checked before tokenizing so a huge
    # prompt costs no tokenizer time. Default: 32 x context_length.
    max_prompt_chars: PositiveInt | None = None
    # Bound on a chat's messages, checked before they are validated one by one:
    # a body of many tiny messages must not cost templating time.
    max_messages: PositiveInt = 4096
    cache: CacheProfile = CacheProfile()
    # Speculative decoding; None (the default): plain decode steps.
    speculative: SpeculativeProfile | None = None
    # One model over several ranks (Macs); None (the default): one process holds it.
    parallel: ParallelProfile | None = None
    # Prompt normalization rules (``serve_app/serving/normalize.py``) applied before templating:
    # client quirks that would defeat the prefix cache. Default: all; [] turns them off.
    normalize: list[str] = Field(default_factory=lambda: list(RULE_NAMES))
    # The chat template, instead of the checkpoint's: a builtin name ("chatml-tools",
    # "smollm2-tools") or a Jinja file (a relative path from the config file's directory,
    # else the working directory; kept absolute). None: the checkpoint's own.
    chat_template: str | None = None
    # The tool-call format, instead of the one mlx-lm infers from the template: one of
    # mlx-lm's tool parsers (mlx_lm/tool_parsers: "json_tools", "qwen3_coder", ...).
    # Embedded models may bring defaults for both (serve_app.config.catalog.PROFILE_DEFAULTS).
    tool_call_format: str | None = None
    # How a thinking model's thought is told from its answer (``serve_app/reasoning``):
    # "auto" (the default) by the thinking tokens mlx-lm's tokenizer knows of the model,
    # "qwen3" / "deepseek_r1" by <think> and </think>, "gpt_oss" by the harmony format's
    # analysis and final channels, "none" leaves thoughts in the answer.
    reasoning_parser: Literal["auto", "qwen3", "deepseek_r1", "gpt_oss", "none"] = "auto"
    reasoning: ReasoningProfile = ReasoningProfile()
    vision: VisionProfile = VisionProfile()
    # What it serves: chat and completions (generate), /v1/embeddings (embed), /v1/rerank
    # and /v1/score (rerank). Default: the checkpoint's (an encoder embeds, a
    # cross-encoder reranks; catalog.default_task), else generate.
    task: Literal["generate", "embed", "rerank"] = "generate"
    pooling: PoolingProfile = PoolingProfile()
    # The attention layers' K/V format (``serve_app/kvquant``): float by default.
    kv_cache: KVCacheProfile = KVCacheProfile()

    @model_validator(mode="before")
    @classmethod
    def _embedded_defaults(cls, data: Any) -> Any:
        """An embedded model's defaults for keys the profile does not set (a key set to
        null stays null: the checkpoint's own template or format), and the task."""
        if isinstance(data, dict) and isinstance(data.get("source"), str):
            return {"task": default_task(data["source"]), **profile_defaults(data["source"]),
                    **data}
        return data

    @field_validator("chat_template")
    @classmethod
    def _check_template(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        base = (info.context or {}).get("base_dir")
        return check_chat_template(value, Path(base) if base is not None else None)

    @field_validator("tool_call_format")
    @classmethod
    def _check_tool_call_format(cls, value: str | None) -> str | None:
        return None if value is None else check_tool_call_format(value)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                "must be 1-128 characters of letters, digits and . _ : / - "
                "starting with a letter or digit"
            )
        return value

    @field_validator("normalize")
    @classmethod
    def _check_rules(cls, value: list[str]) -> list[str]:
        unknown = [n for n in value if n not in RULE_NAMES]
        if unknown:
            raise ValueError(f"unknown normalization rule(s) {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(RULE_NAMES)}")
        return value

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        source_kind(value)
        return value

    @property
    def prefix_routing(self) -> bool:
        """Whether requests are routed on cached prefixes (see ``RoutingProfile``)."""
        mode = self.routing.mode  # an embedding or rerank model keeps no prefixes
        return self.task == "generate" and (mode == "prefix" or (
            mode == "auto" and self.num_replicas > 1))

    @property
    def always_loaded(self) -> bool:
        """Never unloaded by the model pool: pinned, with several replicas (an unload
        reaches one replica only), or sharded over ranks (they hold it together)."""
        return self.pinned or self.num_replicas > 1 or self.parallel is not None

    def tokenizer_config(self) -> dict:
        """What ``mlx_lm.load`` (or ``load_tokenizer``) takes as ``tokenizer_config`` for
        this model's ``chat_template`` and ``tool_call_format`` ({} when neither is set)."""
        return _tokenizer_config(self.chat_template, self.tool_call_format)

    def prompt_char_limit(self) -> int:
        """``max_prompt_chars``, or 32 characters per token of context when unset."""
        return self.max_prompt_chars or 32 * self.context_length


class IngressProfile(Strict):
    num_cpus: Annotated[float, Field(ge=0.0)] = 0.0
    num_replicas: PositiveInt = 1
    # A file of API keys, one a line (with SERVE_APP_API_KEYS, see serve_app/api/auth.py):
    # refused unless owned by the server's user and mode 0600 (no group or other bits).
    api_keys_file: str | None = None
    # A file of admin keys (with SERVE_APP_ADMIN_KEYS; the same checks): API keys that
    # alone may use the controls (/admin/*) once any is set.
    admin_keys_file: str | None = None
    # With API keys on, each key gets its own prefix-cache namespace unless this is
    # true (then keys share blocks, and cached_tokens and timing tell one key about
    # another's prompts).
    share_cache_between_keys: bool = False
    # Larger request bodies get 413 before they are read (Content-Length) or
    # as soon as the bytes read pass it (chunked uploads).
    max_request_bytes: Annotated[ByteSize, Field(ge=1024)] = ByteSize(16 << 20)
    # A request whose model has not answered in this many seconds gets 504 and its
    # replica work is cancelled; a stream is bounded until the replica admits it.
    request_timeout_s: Annotated[float, Field(gt=0.0)] = 600.0
    # On a cluster: the ingress runs on the head node (where Serve's HTTP proxy is, and
    # which the cluster cannot lose anyway), so losing any other node never takes the
    # ingress, and every request in flight through it, with it. False: Ray places it.
    on_head_node: bool = True

    @field_validator("api_keys_file", "admin_keys_file")
    @classmethod
    def _check_key_file(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None:
            from serve_app.config.api_keys import ADMIN_FILE, keys_from_file

            # Serve's builder runs in a Ray worker, whose working directory is not yours.
            if not Path(value).expanduser().is_absolute():
                raise ValueError(f"{value!r}: must be an absolute path (or start with ~)")
            # raises naming the file: mode, owner, no key
            keys_from_file(value, ADMIN_FILE if info.field_name == "admin_keys_file"
                           else "API key file")
        return value


class MemoryProfile(Strict):
    """The node's memory plan (``serve_app/memory/plan.py``): what models, KV and the hot tier
    may take of unified memory together."""

    # Bytes, or ``auto``: 75% of physical memory, leaving at least 4 GiB to the OS (on
    # Metal also at most the GPU's recommended working set).
    budget: SizeOrAuto = "auto"
    # At most this many models loaded at once (pinned ones included); None: no cap.
    max_loaded_models: PositiveInt | None = None


class Profile(Strict):
    """The whole of an application's ``args``."""

    models: Annotated[list[ModelProfile], Field(min_length=1)]
    ingress: IngressProfile = IngressProfile()
    cache_store: CacheStoreProfile = CacheStoreProfile()
    memory: MemoryProfile = MemoryProfile()
    model_home: str | None = None

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: list[ModelProfile]) -> list[ModelProfile]:
        seen: set[str] = set()
        for m in models:
            if m.name in seen:
                raise ValueError(f"model name {m.name!r} appears more than once")
            seen.add(m.name)
        return models

    def model(self, name: str) -> ModelProfile | None:
        return next((m for m in self.models if m.name == name), None)


def _cross_checks(profile: Profile) -> list[tuple[tuple[Any, ...], str]]:
    """Contradictions between keys, each with the key it is reported at."""
    out: list[tuple[tuple[Any, ...], str]] = []
    for i, m in enumerate(profile.models):
        out += [(("models", i, key), f"task {m.task} generates nothing: drop {key}")
                for key in ("speculative", "parallel")
                if m.task != "generate" and getattr(m, key) is not None]
        if m.routing.ray_imbalanced_threshold is not None and m.routing.mode != "ray_prefix":
            out.append((("models", i, "routing", "ray_imbalanced_threshold"),
                        f"Ray's router only reads it (mode ray_prefix), not mode "
                        f"{m.routing.mode}: drop it or set routing.mode: ray_prefix"))
        if m.task != "generate" and m.kv_cache.bits is not None:
            out.append((("models", i, "kv_cache", "bits"),
                        f"task {m.task} keeps no K/V cache: drop kv_cache"))
        if m.pinned and m.idle_unload_s is not None:
            out.append((("models", i, "idle_unload_s"),
                        "a pinned model is never unloaded: drop idle_unload_s or pinned"))
        if m.idle_unload_s is not None and m.num_replicas > 1:
            out.append((("models", i, "idle_unload_s"),
                        f"the model pool unloads a model with one replica only ({m.name!r} "
                        f"has num_replicas {m.num_replicas}): drop idle_unload_s or set "
                        "num_replicas: 1"))
        if m.parallel is not None and m.speculative is not None:
            out.append((("models", i, "speculative"),
                        "speculative decoding is not available on a model sharded over "
                        "ranks (parallel): drop one of them"))
        if m.parallel is not None and m.revision is not None:
            out.append((("models", i, "revision"),
                        "a model sharded over ranks loads its source's default revision "
                        "(mlx-lm's sharded_load takes none): drop revision"))
        if m.parallel is not None and m.num_replicas > 1:
            out.append((("models", i, "num_replicas"),
                        "a model sharded over ranks (parallel) runs as one replica: its "
                        "ranks already span the nodes"))
    cap = profile.memory.max_loaded_models
    pinned = [m.name for m in profile.models if m.always_loaded]
    if cap is not None and len(pinned) > cap:
        out.append((("memory", "max_loaded_models"),
                    f"{cap} is fewer than the {len(pinned)} models that always stay loaded "
                    f"({', '.join(pinned)}: pinned, or with more than one replica)"))
    pooled = cap is not None or any(m.idle_unload_s is not None for m in profile.models)
    if pooled and profile.ingress.num_replicas > 1:
        key = (("memory", "max_loaded_models") if cap is not None else
               ("models", next(i for i, m in enumerate(profile.models)
                               if m.idle_unload_s is not None), "idle_unload_s"))
        out.append((key, "the model pool runs in the ingress, which must then be one "
                         f"(ingress.num_replicas is {profile.ingress.num_replicas})"))
    return out


def source_kind(source: str) -> str:
    """Classify a model source: ``embedded``, ``path`` or ``hub``; raise if neither."""
    if source.startswith(EMBEDDED_PREFIX):
        name = source[len(EMBEDDED_PREFIX) :]
        if name not in embedded_names():
            known = ", ".join(EMBEDDED_PREFIX + k for k in embedded_names())
            raise ValueError(f"unknown embedded model {source!r}; known: {known}")
        return "embedded"
    looks_like_path = source.startswith(("/", ".", "~")) or Path(source).expanduser().exists()
    if looks_like_path:
        path = Path(source).expanduser()
        if not path.is_dir():
            raise ValueError(f"model directory {source!r} does not exist")
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {source!r} has no config.json")
        return "path"
    if _HF_REPO.match(source):
        return "hub"
    raise ValueError(
        f"{source!r} is neither 'embedded:NAME', an existing model directory, "
        "nor a Hugging Face repo id 'org/name'"
    )


def _format_loc(prefix: str, loc: tuple[Any, ...]) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _describe(err: ErrorDetails) -> str:
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "extra_forbidden":
        return "unknown key"
    if err["type"] == "missing":
        return "required key is missing"
    if "input" in err and err["type"] not in ("value_error",):
        return f"{msg} (got {err['input']!r})"
    return msg


def parse_profile(args: Any, where: str = "profile", key_prefix: str = "",
                  base_dir: Path | None = None) -> Profile:
    """Validate application args into a ``Profile`` or raise ``ProfileError``.
    ``base_dir``: where relative paths in it start (the config file's directory); the
    working directory when None."""
    if not isinstance(args, dict):
        raise ProfileError(f"{where}: {key_prefix or 'args'}: must be a mapping")
    try:
        profile = Profile.model_validate(args, context={"base_dir": base_dir})
    except ValidationError as exc:
        lines = [
            f"{where}: {_format_loc(key_prefix, tuple(clean_loc(e['loc']))) or 'args'}: "
            f"{_describe(e)}"
            for e in exc.errors()
        ]
        raise ProfileError("\n".join(lines)) from None
    problems = _cross_checks(profile)
    if problems:
        raise ProfileError("\n".join(f"{where}: {_format_loc(key_prefix, loc)}: {msg}"
                                      for loc, msg in problems))
    return profile


def load_serve_config(path: str | Path) -> list[tuple[str, Profile]]:
    """Validate every application of a Serve config file that uses our builder."""
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(config, dict):
        raise ProfileError(f"{path}: must be a mapping with an 'applications' list")
    apps = config.get("applications")
    if not isinstance(apps, list) or not apps:
        raise ProfileError(f"{path}: applications: must be a non-empty list")
    out = []
    for i, app in enumerate(apps):
        if not isinstance(app, dict):
            raise ProfileError(f"{path}: applications[{i}]: must be a mapping")
        if not str(app.get("import_path", "")).startswith("serve_app"):
            continue
        name = app.get("name", f"app{i + 1}")
        out.append((name, parse_profile(app.get("args"), str(path), f"applications[{i}].args",
                                        base_dir=path.resolve().parent)))
    if not out:
        raise ProfileError(f"{path}: applications: no application uses serve_app")
    return out
