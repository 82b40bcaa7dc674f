"""The prompt normalization rules a profile may enable (``normalize``): each client quirk
that would defeat the prefix cache, with its reason. Data only, so a profile is checked
without the serving layer; ``serve_app.serving.normalize`` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    """Drop the first line of a system text block that starts with ``prefix``.

    A block is one text part of a system message (one Anthropic system block) or
    its whole text when it is a plain string, where such a header is a line of
    its own. A block left empty is dropped.
    """

    name: str  # the metric label and the profile's name for the rule
    prefix: str
    why: str

    def apply(self, block: str) -> str | None:
        """``block`` without its first line, or None where the rule does not match."""
        if not block.startswith(self.prefix):
            return None
        return block.partition("\n")[2]


RULES: tuple[Rule, ...] = (
    Rule("claude_code_billing_header", "x-anthropic-billing-header:",
         "Claude Code (2.1.36 and later) sends `x-anthropic-billing-header: cc_version=...; "
         "cc_entrypoint=...; cch=...;` as the first system block of every request; `cch` "
         "changes on every request, so no request would reuse a cached token after it. "
         "Anthropic's API reads it for billing; a model has no use for it."),
)


RULE_NAMES: tuple[str, ...] = tuple(r.name for r in RULES)
