"""How a stats field of several replicas combines into the model's, declared once on the
field itself and applied by one function (``merge``) to any stats dataclass.

``sum``: counters, and gauges whose sum is the model's (requests in flight now); ``max``:
the most one replica reached (batches never merge); ``sum_by_key``: a dict of counters;
``answering``: a setting or a last-seen value (the answering replica's, the first given);
``nested``: a stats dataclass of its own, merged field by field. A field that declares
none cannot be merged: ``merge`` refuses it, and a unit test reads every stats class, so
a field added in one place reaches the model's totals (``/v1/stats``) the way it says.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import field, fields, is_dataclass, replace
from typing import Any, Literal, TypeVar

Kind = Literal["sum", "max", "sum_by_key", "answering", "nested"]
KINDS: tuple[Kind, ...] = ("sum", "max", "sum_by_key", "answering", "nested")
MERGE = "merge"  # the field metadata key
T = TypeVar("T")


def merged(kind: Kind, **kwargs: Any) -> Any:
    """A dataclass field that combines across replicas as ``kind`` (``field``'s keywords
    otherwise)."""
    return field(metadata={MERGE: kind}, **kwargs)


def merge(items: Sequence[T]) -> T:
    """The model's stats from its replicas' (the answering replica first): each field as it
    declares. ``None`` items (a replica without that section) are left out."""
    present = [i for i in items if i is not None]
    first = present[0]
    cls = type(first)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        kind = f.metadata.get(MERGE)
        if kind not in KINDS:
            raise TypeError(f"{cls.__name__}.{f.name} declares no merge kind")
        got = [getattr(i, f.name) for i in present]
        if kind == "sum":
            values[f.name] = sum(v for v in got if isinstance(v, int | float))
        elif kind == "max":
            values[f.name] = max(v for v in got if isinstance(v, int | float))
        elif kind == "sum_by_key":
            out: dict[str, Any] = {}
            for d in got:
                for k, v in d.items():
                    out[k] = out.get(k, 0) + v
            values[f.name] = out
        elif kind == "nested":
            values[f.name] = (merge(got) if got[0] is not None and is_dataclass(got[0])
                              else got[0])
        else:
            values[f.name] = copy.deepcopy(got[0])
    return replace(first, **values)  # type: ignore[type-var]


def fields_of_kind(cls: type, kind: Kind) -> tuple[str, ...]:
    """The names of ``cls``'s fields that combine as ``kind``."""
    return tuple(f.name for f in fields(cls) if f.metadata.get(MERGE) == kind)
