"""A model's cache settings as the manager takes them, from its profile: block size,
checkpoint interval, and why a cache is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.cache.layout import Layout

from dataclasses import dataclass
from pathlib import Path

from serve_app.cache import codecs
from serve_app.cache.client import (
    CacheClient,
)
from serve_app.config.profile import ModelProfile


@dataclass(frozen=True)
class CacheSettings:
    """One model's cache settings, resolved from its profile and its probed layout."""

    model: str  # the name the model is served under
    block_size: int
    checkpoint_every: int = 0  # 0: attention-only, no recurrent checkpoints
    storage: str = "ssd_sidecar"  # where SSD checkpoints go: "ssd_sidecar" or "embedded"
    codec: str = codecs.EXACT  # the sidecar codec

    @classmethod
    def from_profile(cls, profile: ModelProfile, hybrid: bool,
                     layout: Layout | None = None) -> CacheSettings:
        """Defaults: blocks of 64 tokens (256 for hybrid models); with both unset, a
        hybrid model's checkpoint interval from its ``layout``
        (``default_checkpoint_interval``)."""
        cache = profile.cache
        block_size = cache.block_size or (256 if hybrid else 64)
        # A block size set by hand without an interval keeps a checkpoint every block:
        # the finest restore points, as asked.
        interval = cache.checkpoint_interval or (
            default_checkpoint_interval(layout, block_size)
            if hybrid and layout is not None and cache.block_size is None else block_size)
        if interval % block_size:
            raise ValueError(f"model {profile.name}: cache.checkpoint_interval ({interval}) "
                             f"must be a multiple of the block size ({block_size})")
        storage = cache.gdn_snapshot_storage
        return cls(profile.name, block_size, interval if hybrid else 0,
                   "ssd_sidecar" if storage == "auto" else storage, cache.sidecar_codec)


# The longest default checkpoint interval: a prompt that diverges inside a long message
# restores at most this far back (message boundaries are branch points, always kept).
MAX_DEFAULT_CHECKPOINT_INTERVAL = 4096


def default_checkpoint_interval(layout: Layout, block_size: int) -> int:
    """A hybrid model's recurrent checkpoints, by default, weigh about what the KV they sit
    beside weighs: one every k blocks, k = one checkpoint's bytes / one block's KV bytes
    (at least 1; at most ``MAX_DEFAULT_CHECKPOINT_INTERVAL`` tokens).

    Each checkpoint pauses prefill (measured on a 2-core CPU: no difference between every
    256 and every 2,048 tokens, ``bench/checkpoints.py``) and is stored in the hot tier and
    on SSD. The embedded tiny hybrid (38 KB of state, 262 KB of KV per 256-token block)
    keeps one every block; a Qwen3.5-27B-style model on a Mac (~150 MiB of state, 16 MiB
    of KV per block at 4-bit) one every ~2,300 tokens instead of 9x its KV in checkpoints.
    """
    kv = layout.block_nbytes(block_size)
    blocks = max(1, round(layout.state_nbytes() / kv)) if kv else 1
    return min(blocks, max(1, MAX_DEFAULT_CHECKPOINT_INTERVAL // block_size)) * block_size


def disabled_reason(profile: ModelProfile, layout: Layout, client: CacheClient | None,
                    model_dir: Path | None) -> str | None:
    """Why a model is served without prefix caching, or None."""
    if not profile.cache.enabled:
        return "caching disabled in the profile"
    if not layout.supported:
        return layout.unsupported
    if client is None or model_dir is None:
        return "no cache store"
    return None
