"""Prefix arithmetic on token lists, plain Python: the cache's store and planner and
the request preparer (which may run in the ingress, without MLX) share it."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

Renderer = Callable[[list[dict[str, str]]], list[int]]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share, compared in C where they agree:
    equal runs are checked with one slice comparison, a difference found by halving."""
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def find_branch_points(messages: list[dict[str, str]], prompt: list[int],
                       render: Renderer) -> tuple[int, ...]:
    """Prompt positions where another conversation is likely to branch off this one.

    The end of the system prompt (the next session of an agent shares it) and
    the start of the last message's content (the next turn, or a retry, shares all
    before it, its header too), found much as mlx_lm.server does: ``render`` the
    conversation with that content empty (no generation prompt) and take the common
    prefix with the prompt. Emptying rather than dropping the last message keeps the
    rest rendered as it is: Qwen3's template, for one, renders the last assistant turn
    differently from earlier ones.
    """
    n_system = system_messages(messages)
    shorter = [messages[:-1] + [{**messages[-1], "content": ""}]] if len(messages) > 1 else []
    if 0 < n_system < len(messages):
        shorter.append(messages[:n_system] + [{"role": "user", "content": ""}])
    points = set()
    for conversation in shorter:
        if not conversation:
            continue
        try:
            tokens = render(conversation)
        except Exception:  # a template that refuses the shorter form: no point
            continue
        common = common_prefix(tokens, prompt)
        if 0 < common < len(prompt) - 1:
            points.add(common)
    return tuple(sorted(points))


def branch_points_in_text(messages: list[dict[str, Any]], text: str,
                          token_ends: Sequence[int]) -> tuple[int, ...] | None:
    """``find_branch_points`` without rendering again: the same positions, found in the
    prompt's own rendered ``text`` where the contents start (a message's content
    follows its header), mapped to tokens by each token's end offset in ``text``.

    None where a content is not in the text as it is (a template that trims or
    rewrites it) or the conversation does not start the way the render-based search
    assumes: the caller renders instead.
    """
    starts: list[int | None] = []
    cursor = 0
    for message in messages:
        content = _first_text(message.get("content"))
        if not content:
            starts.append(None)
            continue
        at = text.find(content, cursor)
        if at < 0:
            return None
        starts.append(at)
        cursor = at + len(content)
    n_system = system_messages(messages)
    chars = []
    if len(messages) > 1:
        if starts[-1] is None:
            return None
        chars.append(starts[-1])
    if 0 < n_system < len(messages):
        first = starts[n_system]
        if messages[n_system]["role"] != "user" or first is None:
            return None
        chars.append(first)
    prompt_len = len(token_ends)
    points = {bisect_right(token_ends, c) for c in chars}  # tokens ending at or before c
    return tuple(sorted(p for p in points if 0 < p < prompt_len - 1))


def _first_text(content: Any) -> str:
    """A message's text as a template renders it first: the string, or its first text part."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                return str(part.get("text") or "")
            if isinstance(part, str):
                return part
    return ""


def system_messages(messages: list[dict[str, Any]]) -> int:
    """How many messages lead the conversation as its system prompt (system, developer)."""
    return next((i for i, m in enumerate(messages)
                 if m["role"] not in ("system", "developer")), len(messages))
