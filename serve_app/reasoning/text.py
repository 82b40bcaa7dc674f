"""A thinking request's thought as text, streamed: its tokens split from the answer's,
detokenized apart, with the newlines the templates put around a thought left out."""

from __future__ import annotations

from typing import Any

from serve_app.reasoning.plan import ThinkingPlan
from serve_app.reasoning.split import Part, ThoughtSplitter


class ThoughtText:
    """Feed every generated token: each call gives the thought's new text and the tokens
    that belong to the answer (in order). The thought's leading newlines are dropped and
    its trailing ones held back until more thought follows, as templates render
    ``<think>\\n...\\n</think>\\n\\n``; the newline tokens right after the closing marker
    are the closing's (so no stop string or logprob of the answer sees them)."""

    def __init__(self, tokenizer: Any, eos_ids: set[int], plan: ThinkingPlan) -> None:
        self.splitter = ThoughtSplitter(plan.markers, plan.in_thought)
        self._tokenizer = tokenizer
        self._detok = tokenizer.detokenizer
        self._closing = False  # just past the closing marker: its template newlines follow
        self._eos = eos_ids
        self._held_newlines = ""
        self._started = False  # thought text has been given out
        self._closed = False

    @property
    def had_thought(self) -> bool:
        """The output opened a thought (or its prompt did)."""
        return self.splitter.thought_tokens > 0 or self.splitter.in_thought

    def feed(self, token: int) -> tuple[str, list[int]]:
        return self._take(self.splitter.feed(token))

    def finish(self) -> tuple[str, list[int]]:
        """What is left at the output's end."""
        text, answer = self._take(self.splitter.flush())
        if not self._closed:
            text += self._close()
        return text, answer

    def _take(self, parts: list[tuple[Part, int]]) -> tuple[str, list[int]]:
        text, answer = "", []
        for part, token in parts:
            if part is Part.THOUGHT and token not in self._eos:
                self._detok.add_token(token)
                text += self._detok.last_segment
            elif part is Part.ANSWER:
                if self._closing and self._newlines(token):
                    self.splitter.thought_tokens += 1  # the template's, part of the closing
                    continue
                self._closing = False
                answer.append(token)
        text = self._trim(text)
        if self.splitter.thought_done and not self._closed:
            text += self._close()
        return text, answer

    def _newlines(self, token: int) -> bool:
        text = self._tokenizer.decode([token])
        return bool(text) and not text.strip("\n")

    def _close(self) -> str:
        """The thought's last text (its trailing newlines dropped)."""
        self._closed = True
        # only a thought's closing marker is followed by the template's newlines: an output
        # that never opened one keeps its own (a tool call's '<tool_call>\n' lost its newline)
        self._closing = self.splitter.thought_done and self.had_thought
        self._detok.finalize()
        tail = self._trim(self._detok.last_segment)
        self._held_newlines = ""
        return tail

    def _trim(self, text: str) -> str:
        if not self._started:
            text = text.lstrip("\n")
            if not text:
                return ""
            self._started = True
        text = self._held_newlines + text
        body = text.rstrip("\n")
        self._held_newlines = text[len(body):]
        return body
