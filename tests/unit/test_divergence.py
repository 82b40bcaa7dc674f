"""Cache-bust diagnostics (serve_app/cache/divergence.py), no model, no Ray."""

from __future__ import annotations

import logging
import random

from serve_app.cache.divergence import DivergenceTracker, position_bucket
from serve_app.cache.manager_stats import CacheStats

LOGGER = "serve_app.cache.divergence"


def text(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50000) for _ in range(n)]


HEADER = [1, 2, 3, 4, 5]
SYSTEM = text(1, 2000)


def prompt(stamp: list[int], turn: list[int]) -> list[int]:
    """A template header, a changing stamp, a long system prompt, then the turn."""
    return HEADER + stamp + SYSTEM + turn


def test_a_changing_stamp_near_the_start_is_a_bust_with_its_position_and_lengths(caplog):
    tracker = DivergenceTracker("m", min_tokens=256)
    assert tracker.observe("root", prompt([7, 7, 7], text(2, 50))) is None
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        bust = tracker.observe("root", prompt([8, 9], text(3, 50)))
        assert bust is not None
        assert (bust.position, bust.differing_tokens, bust.differing_cached_tokens) == (5, 2, 3)
        assert bust.cached_prompt_tokens == 2058 and bust.prompt_tokens == 2057
        assert bust.matching_after == 2000
        assert not caplog.records  # once is not "repeatedly"
        for stamp in ([10], [11, 12, 13, 14]):
            assert tracker.observe("root", prompt(stamp, text(4, 50))).position == 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one per distinct case, not one per request
    message = warnings[0].getMessage()
    assert "diverged at token 5 of a" in message and "then 2000 tokens match" in message
    assert str(SYSTEM[0]) not in message  # lengths, never prompt text


def test_stats_count_by_position_bucket_and_keep_the_last_few():
    stats = CacheStats(True, None, 16)
    tracker = DivergenceTracker("m", min_tokens=64)
    for i in range(12):
        bust = tracker.observe("root", [9] * 100 + [i] + SYSTEM)
        if bust is not None:
            stats.cache_bust(bust)
    assert stats.cache_busts_by_position["64-255"] == 11
    assert sum(stats.cache_busts_by_position.values()) == 11
    assert len(stats.recent_cache_busts) == 8
    assert stats.recent_cache_busts[-1]["position"] == 100
    assert position_bucket(0) == "0-63" and position_bucket(5000) == "4096+"


def test_the_next_turn_of_a_conversation_is_no_bust_and_replaces_the_last():
    tracker = DivergenceTracker("m", min_tokens=64)
    others = [text(20 + i, 300) for i in range(3)]
    for other in others:
        tracker.observe("root", other)
    first = prompt([1], text(5, 40))
    assert tracker.observe("root", first) is None
    assert tracker.observe("root", first + text(6, 80)) is None
    kept = [k.length for k in tracker._prompts]
    assert kept == [300, 300, 300, len(first) + 80]


def test_a_new_session_sharing_only_the_system_prompt_is_no_bust():
    tracker = DivergenceTracker("m", min_tokens=64)
    long_session = prompt([1], text(7, 30000))  # the system prompt is under 10% of it
    assert tracker.observe("root", long_session) is None
    assert tracker.observe("root", prompt([1], text(8, 500))) is None


def test_unrelated_prompts_and_other_tenants_are_never_compared():
    tracker = DivergenceTracker("m", min_tokens=64)
    assert tracker.observe("root", text(9, 3000)) is None
    assert tracker.observe("root", text(10, 3000)) is None
    assert tracker.observe("tenant-a", prompt([1], [])) is None
    assert tracker.observe("tenant-b", prompt([2], [])) is None  # another salt: not compared
    assert tracker.observe("tenant-a", prompt([3], [])) is not None


def test_late_divergence_or_a_short_cached_prompt_is_no_bust():
    tracker = DivergenceTracker("m", min_tokens=4096)  # the cached prompt is "short"
    tracker.observe("root", prompt([1], []))
    assert tracker.observe("root", prompt([2], [])) is None
    tracker = DivergenceTracker("m", min_tokens=64)
    base = SYSTEM[:1000]
    tracker.observe("root", base + [1] + SYSTEM[1000:1500])
    assert tracker.observe("root", base + [2] + SYSTEM[1000:1500]) is None  # at 66%: late
