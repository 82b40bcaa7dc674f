"""Pydantic error locations, cleaned for humans (profiles and API requests alike)."""

from __future__ import annotations

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def is_type_tag(part: object) -> bool:
    """Pydantic puts union members ('str', 'list[int]', 'TextPart') in error locations."""
    if isinstance(part, int):
        return False
    text = str(part)
    return text in _TYPE_TAGS or "[" in text or "-" in text or text[:1].isupper()


def clean_loc(loc: tuple) -> list:
    return [p for p in loc if not is_type_tag(p)]
