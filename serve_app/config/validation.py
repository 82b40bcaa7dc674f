"""Pydantic error locations, cleaned for humans (profiles and API requests alike), and
the byte sizes profiles write."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ByteSize, ConfigDict, TypeAdapter, ValidationError

_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def is_type_tag(part: object) -> bool:
    """Pydantic puts union members ('str', 'list[int]', 'TextPart') in error locations."""
    if isinstance(part, int):
        return False
    text = str(part)
    return text in _TYPE_TAGS or "[" in text or "-" in text or text[:1].isupper()


def clean_loc(loc: tuple) -> list:
    return [p for p in loc if not is_type_tag(p)]


_BYTES = TypeAdapter(ByteSize)
_SIZE = re.compile(r"\s*\d+(\.\d+)?\s*[A-Za-z]*\s*")


def _size_or_auto(value: Any) -> Any:
    """``auto``, an integer of bytes, or a size string (``24GB``, ``512MiB``, ``1MB``)."""
    if value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str):
        try:
            if not _SIZE.fullmatch(value):  # pydantic alone reads "1 TB/h" as 1 TB
                raise ValueError(value)
            size = int(_BYTES.validate_python(value))
        except (ValidationError, ValueError):
            raise ValueError(f"{value!r} is not a size: write bytes as an integer, a size "
                             "such as 24GB, 512MiB or 1MB, or auto") from None
    else:
        raise ValueError(f"{value!r} is not a size: write bytes as an integer, a size such "
                         "as 24GB, 512MiB or 1MB, or auto")
    if size < 1:
        raise ValueError(f"{value!r}: a size must be at least 1 byte")
    return size


# A byte count or ``auto`` (one error message for a bad value, not one per union member).
SizeOrAuto = Annotated[int | Literal["auto"], BeforeValidator(_size_or_auto)]


class Strict(BaseModel):
    """A section of a profile: unknown keys refused, no coercion, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
