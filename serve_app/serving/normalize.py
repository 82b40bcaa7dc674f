"""Prompt normalization: client quirks that would defeat the prefix cache, undone
before templating.

A prefix cache only helps a request whose tokens start like an earlier one's.
Some clients put text that changes on every request at the very start of the
prompt; nothing after it can then be reused. Each quirk is one ``Rule`` in
``RULES``, with its reason; ``Preparer.template_input`` applies the rules the
model's profile enables (``normalize``, default: all) to every chat request,
whichever API it came through (OpenAI chat, Anthropic Messages, Responses).

Rules touch only system (and developer) messages, and change nothing in a
message they do not match: a request without the quirk renders exactly the
tokens it always did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve_app.config.normalize_rules import RULES, Rule
from serve_app.serving.request import ChatMessage

SYSTEM_ROLES = ("system", "developer")


@dataclass(frozen=True)
class Normalized:
    """Messages as the chat template takes them, and the rules that changed them."""

    messages: list[dict[str, Any]]
    applied: tuple[str, ...] = ()


def rules_named(names: Sequence[str]) -> tuple[Rule, ...]:
    """The rules a profile enables, in ``RULES`` order (names were validated)."""
    return tuple(r for r in RULES if r.name in names)


def normalize(messages: Sequence[ChatMessage], rules: Sequence[Rule]) -> Normalized:
    """``messages`` as template dicts, with ``rules`` applied to system text blocks.

    A matched message keeps its place (an emptied one stays, empty), so message
    positions, such as Anthropic's ``cache_control`` points, still hold.
    """
    out = [m.to_template() for m in messages]
    if not rules:
        return Normalized(out)
    applied: list[str] = []
    for message, rendered in zip(messages, out, strict=True):
        if message.role not in SYSTEM_ROLES or message.content is None:
            continue
        content = message.content
        blocks = [getattr(p, "text", "") for p in content] if isinstance(content, list) \
            else [content]
        kept: list[str] = []
        for block in blocks:
            changed = False
            for rule in rules:
                rest = rule.apply(block)
                if rest is not None:
                    block, changed = rest, True
                    applied.append(rule.name)
            if block or not changed:
                kept.append(block)
        rendered["content"] = "".join(kept)  # as ChatMessage.text() joins parts
    return Normalized(out, tuple(dict.fromkeys(applied)))
