"""What the ingress asks an embedding or rerank replica, and what it answers: the seam
between the HTTP API (``serve_app/api/pooling_api.py``) and the replica
(``serve_app/deploy/pooling_replica.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class EmbedCall:
    """Texts or token lists to embed (exactly one of the two), validated by the ingress."""

    texts: tuple[str, ...] = ()
    token_lists: tuple[tuple[int, ...], ...] = ()
    dimensions: int | None = None  # a Matryoshka cut
    truncate: bool | None = None  # None: the profile's ``pooling.truncate``
    param: str = "input"  # where the inputs are in the request (errors name it)


@dataclass(frozen=True)
class ScoreCall:
    """(query, document) pairs to score; ``order`` how many documents each query has."""

    pairs: tuple[tuple[str, str], ...]
    truncate: bool | None = None
    param: str = "documents"


PoolingCall = EmbedCall | ScoreCall


@dataclass(frozen=True)
class PoolingAnswer:
    """Vectors (N, D) float32, final (cut and normalised as the model's are), or scores
    (N,) in [0, 1]; and the tokens the inputs took."""

    kind: Literal["embed", "score"]
    values: np.ndarray
    tokens: int
