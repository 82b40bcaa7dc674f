"""What the tests of a model over several ranks share (one node or several): the
conversation they ask and the length of answer they compare."""

from __future__ import annotations

from openai import OpenAI
from openai.types.chat import ChatCompletion

from tests.support.clients import chat

ANSWER_TOKENS = 16
"""Long enough an answer that ranks combining a layer wrongly would show in it."""


def conversation(name: str) -> list[dict]:
    """A system prompt several blocks long (its prefix is what a second turn restores) and
    one question; ``name`` keeps each test's prefix its own."""
    return [{"role": "system", "content": f"You are {name}, sharded over two ranks. " * 6},
            {"role": "user", "content": "Say something about rings."}]


def ask(client: OpenAI, model: str, messages: list[dict], n: int = ANSWER_TOKENS,
        salt: str | None = None) -> ChatCompletion:
    """A greedy answer of ``n`` tokens (``salt``: none of another salt's blocks reused)."""
    return chat(client, model, messages, n, salt=salt)
