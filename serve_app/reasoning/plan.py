"""What one request's thinking is: the markers, whether its prompt left a thought open,
and the budget its thought may spend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from serve_app.reasoning.markers import ThinkingMarkers
from serve_app.reasoning.split import closes_at_end, opens_in_thought

EFFORTS = ("minimal", "low", "medium", "high")


@dataclass(frozen=True)
class ThinkingPlan:
    """A thinking model's request: its output is split into thought and answer."""

    markers: ThinkingMarkers
    in_thought: bool  # the prompt opened the thought (the template or a client did)
    budget: int | None  # thought tokens allowed before the server closes it; None: any
    # The generation prompt holds a thought, open or closed and empty (thinking off): a
    # template that renders one there drops it from the turn next time.
    prompt_thought: bool = False


def plan_thinking(markers: ThinkingMarkers | None, generation_prompt: Sequence[int],
                  budget: int | None) -> ThinkingPlan | None:
    """The plan of a chat request; None for a model that does not think (no markers).
    ``generation_prompt``: the prompt's tokens after the conversation (what the template
    adds to start the answer, or a continued final message): markers elsewhere, in a
    user's or a tool's text, say nothing of where the output starts."""
    if markers is None:
        return None
    opened = opens_in_thought(generation_prompt, markers)
    return ThinkingPlan(markers, opened, budget,
                        opened or closes_at_end(generation_prompt, markers))


def budget_of(*, tokens: int | None, effort: str | None, default: int | None,
              efforts: Mapping[Any, int]) -> int | None:
    """A request's thought budget: its own token count (Anthropic's ``budget_tokens``),
    else its effort's budget from the profile, else the profile's default."""
    if tokens is not None:
        return tokens
    if effort is not None and effort in efforts:
        return efforts[effort]
    return default
