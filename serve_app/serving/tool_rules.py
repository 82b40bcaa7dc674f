"""The rules a request's tools and ``tool_choice`` follow, for the three APIs in one place.

OpenAI's chat completions and Responses name functions by ``TOOL_NAME_PATTERN``;
Anthropic's Messages by ``ANTHROPIC_TOOL_NAME_CHARS`` up to ``ANTHROPIC_MAX_TOOL_NAME``.
In every API a tool's name is used once, and a ``tool_choice`` that forces a call
(``forces_call``) needs tools, the named one among them. Each API words the refusal in
its own shape (its ``param`` path, its error body): the rule is decided here, the
message at the API (and in ``structured.compile_tool_choice``, which re-checks).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Literal

TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"  # OpenAI function names (chat, Responses)
ANTHROPIC_TOOL_NAME_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
ANTHROPIC_MAX_TOOL_NAME = 128

ChoiceProblem = Literal["needs_tools", "unknown_name"]


def first_duplicate(names: Iterable[str]) -> tuple[int, str] | None:
    """The index and name of the first tool whose name an earlier tool has, or None."""
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            return i, name
        seen.add(name)
    return None


def anthropic_name_ok(name: str) -> bool:
    """An Anthropic tool name: letters, digits, ``_`` and ``-`` (its length is the
    request model's ``max_length``)."""
    return set(name) <= ANTHROPIC_TOOL_NAME_CHARS


def forces_call(choice: object) -> bool:
    """A ``tool_choice`` that forces a call: ``"required"`` or a named tool (any choice
    that is not one of the words: the API's named-choice model or its dict form)."""
    return choice == "required" or (choice is not None and not isinstance(choice, str))


def choice_problem(forced: bool, name: str | None, names: Collection[str]
                   ) -> ChoiceProblem | None:
    """What is wrong with a ``tool_choice`` that forces a call (``forced``: any tool, or
    the one ``name``) given the request's tool ``names``: no tools at all, or no tool of
    that name; None when nothing is, or when the choice forces nothing."""
    if not forced:
        return None
    if not names:
        return "needs_tools"
    if name is not None and name not in names:
        return "unknown_name"
    return None
