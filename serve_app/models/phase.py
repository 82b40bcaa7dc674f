"""What a model's replica is doing: its phase, told to the ingress through Ray's KV store.

A replica that downloads or loads a model answers no call until its constructor returns, so
it cannot be asked; it writes its phase instead (``PhaseBoard``), and the ingress reads
the phases of a model's replicas for ``/health`` and ``/v1/models``. One entry per replica,
overwritten at each change; a few hundred bytes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

# In order of a load; ``unloaded`` (the model pool freed it) and ``failed`` stand apart.
PHASES = ("starting", "downloading", "materializing", "loading", "warming", "ready",
          "unloaded", "failed")
# A model in one of these serves requests (an unloaded one loads on its first request).
SERVING = ("ready", "unloaded")


@dataclass(frozen=True)
class ModelPhase:
    """One replica's phase; bytes while ``downloading``, the reason when ``failed``."""

    phase: str
    done_bytes: int | None = None
    total_bytes: int | None = None
    reason: str | None = None
    since: float = 0.0  # time.time() when the replica entered it
    # A model sharded over ranks: {mode, size, ranks: [{rank, node}, ...]} once they run.
    parallel: dict | None = None
    # What the loaded model takes: ["text", "image"] for a vision model (None: text).
    inputs: list[str] | None = None

    def public(self) -> dict:
        """The fields a user sees (``/health``, ``/v1/models``): none that are empty."""
        out: dict = {"phase": self.phase}
        if self.phase == "downloading" and self.total_bytes:
            out["progress"] = {"done_bytes": self.done_bytes or 0,
                               "total_bytes": self.total_bytes}
        if self.reason:
            out["reason"] = self.reason
        if self.parallel:
            out["parallel"] = self.parallel
        if self.inputs:
            out["input_modalities"] = self.inputs
        return out

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ModelPhase:
        return cls(**json.loads(raw))


def model_phase(replicas: list[ModelPhase], answered: bool) -> ModelPhase:
    """A model's phase from its replicas' (``answered``: one answered the readiness probe).

    Any replica serving makes the model serve; otherwise the furthest phase of a load in
    progress, or a failure when every replica failed.
    """
    if not replicas:
        return ModelPhase("ready" if answered else "starting")
    for wanted in SERVING:
        for p in replicas:
            if p.phase == wanted and (answered or wanted != "ready"):
                return p
    loading = [p for p in replicas if p.phase not in ("failed", "ready", "unloaded")]
    if loading:
        return max(loading, key=lambda p: PHASES.index(p.phase))
    failed = [p for p in replicas if p.phase == "failed"]
    if failed:
        return max(failed, key=lambda p: p.since)
    ready = [p for p in replicas if p.phase == "ready"]
    if ready:  # loaded, its constructor returning: the probe has not answered yet
        return ModelPhase("warming", since=ready[0].since)
    return ModelPhase("starting")


class PhaseBoard:
    """A replica's phase under ``app/model/replica`` in Ray's KV store (cluster-wide)."""

    def __init__(self, app: str, model: str, replica: str) -> None:
        self.key = f"{app}/{model}/{replica}"
        self.current = ModelPhase("starting", since=time.time())
        self.parallel: dict | None = None  # the ranks, once a sharded model's run
        self.inputs: list[str] | None = None  # what the loaded model takes

    def set(self, phase: str, done_bytes: int | None = None, total_bytes: int | None = None,
            reason: str | None = None) -> None:
        from serve_app.models.compat import kv_put

        since = self.current.since if phase == self.current.phase else time.time()
        self.current = ModelPhase(phase, done_bytes, total_bytes, reason, since,
                                  self.parallel, self.inputs)
        try:
            kv_put(PHASE_NAMESPACE, self.key, self.current.encode())
        except Exception:  # a phase is information: never fail a load for it
            pass

    def clear(self) -> None:
        from serve_app.models.compat import kv_delete

        try:
            kv_delete(PHASE_NAMESPACE, self.key)
        except Exception:
            pass


PHASE_NAMESPACE = "serve_app_phase"


def read_phases(app: str, model: str) -> list[ModelPhase]:
    """The phases the replicas of ``app``'s ``model`` wrote (empty before any wrote)."""
    from serve_app.models.compat import kv_items

    out = []
    for raw in kv_items(PHASE_NAMESPACE, f"{app}/{model}/").values():
        try:
            out.append(ModelPhase.decode(raw))
        except (ValueError, TypeError):
            continue
    return out


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message names the cause and what to do."""


def replica_identity(model: str) -> tuple[str, str, str]:
    """(application, model, replica) of this Serve replica; placeholders outside Serve."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
        return ctx.app_name, model, ctx.replica_id.unique_id
    except Exception:  # not in a Serve replica (a unit test)
        import os

        return "local", model, str(os.getpid())


def load_failure_reason(source: str, exc: Exception) -> str:
    """Why a model failed to load, with what to change, from the exception it raised."""
    from serve_app.models.compat import log_dir

    text = str(exc) or type(exc).__name__
    name = type(exc).__name__
    if name == "MaterializeError":
        return text  # says what to do already
    if isinstance(exc, MemoryError):
        return (f"out of memory loading {source}: choose a smaller quantization, or lower "
                "context_length / max_batch_size (python -m serve_app check CONFIG shows "
                "the memory plan)")
    if name in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
        return (f"{source} cannot be downloaded from the Hugging Face hub ({name}): check the "
                "repo id and revision, and for a gated repo log in (huggingface-cli login "
                f"or HF_TOKEN): {text}")
    if name in ("LocalEntryNotFoundError", "ConnectionError", "OfflineModeIsEnabled") or \
            "connect" in text.lower():
        return (f"{source} could not be downloaded ({name}: {text}): check the network (or "
                "HF_HUB_OFFLINE), or set the model's source to a local directory")
    if isinstance(exc, FileNotFoundError):
        return (f"{source}: a file is missing ({text}): a model directory needs config.json, "
                "the tokenizer's files and *.safetensors weights in mlx-lm's format "
                "(mlx_lm.convert makes one)")
    if isinstance(exc, ValueError) and "model type" in text.lower():
        return (f"{source}: mlx-lm cannot build this model ({text}): upgrade mlx-lm, or "
                "pick a model whose model_type it supports")
    return (f"{name}: {text} (loading {source}); the traceback is in the replica's log "
            f"under {log_dir()}")
