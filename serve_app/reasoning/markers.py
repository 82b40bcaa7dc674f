"""The tokens that open and close a model's thought, as a profile's ``reasoning_parser``
names them or as mlx-lm's tokenizer infers them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ReasoningParser = Literal["auto", "qwen3", "deepseek_r1", "gpt_oss", "none"]
PARSERS: tuple[str, ...] = ("auto", "qwen3", "deepseek_r1", "gpt_oss", "none")

# Qwen3 and DeepSeek-R1 write a thought between the same two tokens; they differ in
# whether the template opens it in the generation prompt, which the prompt itself tells
# (``split.opens_in_thought``), so one pair of markers serves both.
_THINK_TAGS = ("<think>", "</think>")
# gpt-oss (OpenAI's harmony format) thinks on the analysis channel and answers on the final
# one: the thought runs from the first text to the second, whose special tokens are
# single tokens and whose words the tokenizer splits as it will.
_HARMONY = ("<|channel|>analysis<|message|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>")
_HARMONY_SPECIALS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")


@dataclass(frozen=True)
class ThinkingMarkers:
    """A thought's opening and closing token sequences (one token each for most models)."""

    start: tuple[int, ...]
    end: tuple[int, ...]
    start_text: str
    end_text: str


def markers_of(tokenizer: Any, parser: str = "auto") -> ThinkingMarkers | None:
    """The markers of ``tokenizer`` (mlx-lm's ``TokenizerWrapper``) for ``parser``; None
    when it splits nothing (``none``, or ``auto`` on a model without thinking tokens).
    Raises ValueError when a named parser's tokens are not in the vocabulary."""
    if parser == "none":
        return None
    if parser == "auto":
        if not getattr(tokenizer, "has_thinking", False):
            vocab = tokenizer.get_vocab()
            if all(t in vocab for t in _HARMONY_SPECIALS):
                return _harmony(tokenizer)
            return None
        start, end = tokenizer.think_start_tokens, tokenizer.think_end_tokens
        if not start or not end:
            return None
        return ThinkingMarkers(tuple(start), tuple(end), tokenizer.think_start,
                               tokenizer.think_end)
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}: one of {', '.join(PARSERS)}")
    vocab = tokenizer.get_vocab()
    if parser == "gpt_oss":
        missing = [t for t in _HARMONY_SPECIALS if t not in vocab]
        if missing:
            raise ValueError(f"reasoning parser 'gpt_oss' needs the harmony format's "
                             f"special tokens; this tokenizer has no {' or '.join(missing)}")
        return _harmony(tokenizer)
    missing = [t for t in _THINK_TAGS if t not in vocab]
    if missing:
        raise ValueError(f"reasoning parser {parser!r} needs the tokens "
                         f"{' and '.join(_THINK_TAGS)}; this tokenizer has no "
                         f"{' or '.join(missing)}")
    open_tag, close_tag = _THINK_TAGS
    return ThinkingMarkers((vocab[open_tag],), (vocab[close_tag],), open_tag, close_tag)


def _harmony(tokenizer: Any) -> ThinkingMarkers:
    """gpt-oss's analysis channel as a thought's markers, as its tokenizer writes them."""
    start, end = (tuple(tokenizer.encode(text, add_special_tokens=False)) for text in _HARMONY)
    return ThinkingMarkers(start, end, *_HARMONY)
