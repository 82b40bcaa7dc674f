"""What the engine does for a request with images: encode what its cache does not cover,
give the batch virtual ids for it, place its decoding rows, and show its logits
processors the real tokens."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve_app.models.compat import MROPE_STYLES, install_decode_step
from serve_app.multimodal.fetch import UrlFetch
from serve_app.multimodal.images import ImageLimits
from serve_app.multimodal.processor import ProcessedImage
from serve_app.multimodal.prompt import ImagePrompts, VisionPrompt
from serve_app.multimodal.splice import SpliceState, SpliceTable, install
from serve_app.multimodal.tower import FeatureCache, VisionStats, VisionTower, has_vision

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    delta: int
    uid: int | None = None


@dataclass
class _Held:
    """A request waiting for the tower: the images its restored prefix will not cover."""

    req: Any
    missing: list[ProcessedImage]


class VisionRuntime:
    """Owned by the engine thread; every method runs there."""

    def __init__(self, model: Any, tower: VisionTower, feature_bytes: int) -> None:
        text = tower.config.get("text_config") or tower.config
        section = (text.get("rope_parameters") or text.get("rope_scaling") or {}).get(
            "mrope_section")
        if not section:
            raise ValueError("the model's text config names no mrope_section")
        embed = next(m for n, m in model.named_modules() if n.endswith("embed_tokens"))
        vocab = int(getattr(embed, "num_embeddings", 0) or embed.weight.shape[0])
        self.stats = VisionStats()
        self.features = FeatureCache(tower, feature_bytes, self.stats)
        # One splice per model (two services sharing weights, as tests do, share it; each
        # keys its table entries by itself, and one engine runs a model at a time).
        state = getattr(model, "_serve_app_splice", None)
        if state is None:
            state = SpliceState(SpliceTable(vocab), MROPE_STYLES[tower.config["model_type"]])
            if install(model, state, list(section)) == 0:
                raise ValueError("the model has no rotary embedding to place images with")
            model._serve_app_splice = state
        self.state = state
        self._requests: dict[int, _Request] = {}
        self._deltas: dict[int, int] = {}  # by batch uid, for decode steps
        # Requests waiting for their images (``hold``), and the features encoded for them,
        # kept until they join whatever the feature cache's bound drops meanwhile.
        self._held: deque[_Held] = deque()
        self._pinned: dict[str, Any] = {}
        self._ready: dict[int, set[str]] = {}  # released by encode_step, joining: their images

    # ---- before a request joins: its images, a prefill chunk's worth of tower a step

    @property
    def busy(self) -> bool:
        """Requests wait for the tower: the engine must not sleep on its queue."""
        return bool(self._held)

    @property
    def held(self) -> int:
        """Requests waiting for the tower (their KV is reserved: they count as running)."""
        return len(self._held)

    def hold(self, req: Any) -> bool:
        """Keep ``req`` until the tower has encoded the images its planned restore does not
        cover (``encode_step``); False: none, it can join now."""
        vision: VisionPrompt = req.vision
        plan = req.cache.restore if req.cache is not None else None
        lo = max(vision.first_image, plan.tokens if plan is not None else 0)
        missing: dict[str, ProcessedImage] = {}
        for span in vision.spans:
            digest = span.image.digest
            if span.end > lo and digest not in self.features and digest not in self._pinned:
                missing[digest] = span.image
        if not missing:
            return False
        self._held.append(_Held(req, list(missing.values())))
        return True

    def encode_step(self, budget: int) -> list:
        """One tower call over the held requests' next images, across requests, up to
        ``budget`` image tokens (one prefill chunk's worth; at least one image, so a larger
        one still goes): the requests now ready to join, in the order they came."""
        batch: dict[str, ProcessedImage] = {}
        tokens = 0
        for image in (i for held in self._held for i in held.missing):
            if image.digest in batch:
                continue
            if batch and tokens + image.tokens > budget:
                break
            batch[image.digest] = image
            tokens += image.tokens
        failed: set[str] = set()
        if batch:
            images = list(batch.values())
            try:
                self._pinned.update(zip(batch, self.features.encode(images), strict=True))
            except Exception:  # each request then encodes alone as it joins, and fails alone
                logger.exception("the vision tower failed on %d images", len(images))
                failed = set(batch)
        ready = []
        for held in list(self._held):
            held.missing = [i for i in held.missing
                            if i.digest not in self._pinned and i.digest not in failed]
            if not held.missing:
                self._held.remove(held)
                ready.append(held.req)
                self._ready[held.req.rid] = {s.image.digest for s in held.req.vision.spans}
        return ready

    def drop(self, rid: int) -> Any | None:
        """The held request ``rid``, no longer waiting (cancelled), or None."""
        for held in self._held:
            if held.req.rid == rid:
                self._held.remove(held)
                self._unpin()
                return held.req
        return None

    def drop_all(self) -> list:
        """Every held request (the engine stops)."""
        held = [h.req for h in self._held]
        self._held.clear()
        self._pinned.clear()
        self._ready.clear()
        return held

    def _unpin(self) -> None:
        """Features no held or joining request needs leave (the feature cache may keep them)."""
        wanted = {s.image.digest for h in self._held for s in h.req.vision.spans}
        wanted.update(*self._ready.values())
        for digest in [d for d in self._pinned if d not in wanted]:
            del self._pinned[digest]

    def _features(self, image: ProcessedImage) -> Any:
        pinned = self._pinned.get(image.digest)
        return pinned if pinned is not None else self.features.features(image)

    def install(self, generator: Any) -> None:
        """A new batch: nothing of the old one stays; its decode steps place the rows."""
        self.clear()
        install_decode_step(generator, lambda rows: self.step(rows.uids, rows.plain_step))

    def begin(self, req: Any, segments: list[list[int]],
              processors: list) -> tuple[list[list[int]], list, list[list[int]] | None]:
        """What ``BatchGenerator.insert_segments`` takes for engine request ``req``: its
        segments, logits processors and restored tokens (``all_tokens``)."""
        vision: VisionPrompt = req.vision
        restored = [vision.tokens[: req.restored]] if req.restored else None
        return (self._segments(req.rid, vision, req.restored, segments),
                self.processors(vision, processors), restored)

    def _segments(self, rid: int, vision: VisionPrompt, restored: int,
                  segments: list[list[int]]) -> list[list[int]]:
        """The request's segments (which cover ``prompt[restored:]``) with every token from
        its first image on replaced by a virtual id: the last one too, which mlx-lm feeds
        in the new rows' first decode step (``GenerationBatch.__init__``, a step that no
        decode-step hook sees: only a virtual id places it)."""
        last = len(vision.tokens)
        lo = max(vision.first_image, restored)
        self.stats.prefix_hits += sum(s.end <= lo for s in vision.spans)
        self._requests[rid] = _Request(vision.delta)
        if lo < last:
            features = [(max(s.start, lo) - lo, self._features(s.image)[max(0, lo - s.start):])
                        for s in vision.spans if s.end > lo]
            base = self.state.table.add((id(self), rid), np.asarray(vision.tokens[lo:last]),
                                        vision.positions[:, lo:last], features)
            out, at = [], restored
            for segment in segments:
                ids = [base + (i - lo) if lo <= i < last else vision.tokens[i]
                       for i in range(at, at + len(segment))]
                out.append(ids)
                at += len(segment)
            return out
        return segments

    def _joined_or_not(self, rid: int) -> None:
        if self._ready.pop(rid, None) is not None:
            self._unpin()

    def joined(self, rid: int, uid: int) -> None:
        self._requests[rid].uid = uid
        self._deltas[uid] = self._requests[rid].delta
        self._joined_or_not(rid)

    def prefilled(self, rid: int) -> None:
        """The request's prompt is in its cache: its virtual ids are free."""
        self.state.table.remove((id(self), rid))

    def ended(self, rid: int) -> None:
        self._joined_or_not(rid)  # a released request that failed to join
        self.state.table.remove((id(self), rid))
        request = self._requests.pop(rid, None)
        if request is not None and request.uid is not None:
            self._deltas.pop(request.uid, None)

    def clear(self) -> None:
        """A new batch: nothing of the old one stays."""
        for rid in self._requests:
            self.state.table.remove((id(self), rid))
        self._requests.clear()
        self._deltas.clear()

    def step(self, uids: list[int], inner: Callable[[], list]) -> list:
        """One decode step of the batch whose rows are ``uids``."""
        import mlx.core as mx

        if any(uid in self._deltas for uid in uids):
            self.state.rows = mx.array([self._deltas.get(uid, 0) for uid in uids])
        self.state.decoding = True
        try:
            return inner()
        finally:
            self.state.rows, self.state.decoding = None, False

    @staticmethod
    def processors(vision: VisionPrompt, processors: list) -> list:
        """The logits processors, shown the prompt's real tokens where the batch's history
        has virtual ids (a repetition penalty would index past the vocabulary)."""
        if not processors:
            return processors
        import mlx.core as mx

        real = mx.array(vision.tokens)
        n = len(vision.tokens)

        def shown(tokens: Any) -> Any:
            if tokens.size <= n:
                return real[: tokens.size]
            return mx.concatenate([real, tokens[n:].astype(real.dtype)])

        return [lambda tokens, logits, p=p: p(shown(tokens), logits) for p in processors]


def vision_for(profile: Any, model: Any, model_dir: Path | None) -> tuple[
        VisionRuntime | None, ImagePrompts | None]:
    """A vision-language model's engine side and request side (None, None: text only, or
    a profile that turns images off). Speculative decoding does not place images yet: a
    profile with both is refused, naming its key."""
    if model_dir is None or not has_vision(model_dir) or not profile.vision.enabled:
        return None, None
    if profile.speculative is not None:
        raise ValueError(f"models[{profile.name}].speculative: speculative decoding does not "
                         "take images yet; set vision.enabled: false to serve this model's "
                         "text with it")
    settings = profile.vision
    limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels,
                         settings.max_images, UrlFetch(settings.fetch_urls,
                                                       settings.fetch_timeout_s,
                                                       tuple(h.lower() for h in
                                                             settings.fetch_hosts)))
    runtime = VisionRuntime(model, VisionTower(model_dir), settings.feature_cache_mb << 20)
    return runtime, ImagePrompts(model_dir, limits)
