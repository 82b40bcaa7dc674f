"""Block payloads as typed data: every array carries its own dtype.

A block's payload holds, for each attention layer, the keys and values of
its tokens, and, when it carries a checkpoint, each recurrent layer's state
exactly at the block's end boundary. Arrays leave MLX as numpy; numpy has no
bfloat16, so a bf16 array travels as its ``uint16`` bit pattern, and the
``Tensor`` beside it says so. Nothing ever reads a dtype from a key name or
casts bit patterns numerically.

``check`` says whether a payload fits a model's layout (shapes and dtypes);
``to_tensors`` / ``from_tensors`` are the one place where a payload becomes
named tensors of a safetensors file and back.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from serve_app.cache.match import Partial

# MLX dtype name -> the numpy dtype that carries its bits (``uint32``: quantized K/V,
# packed: ``serve_app/kvquant/format.py``).
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
           "uint32": np.uint32}


class PayloadError(ValueError):
    """A payload that does not describe arrays of the expected kind."""


@dataclass(frozen=True)
class Tensor:
    """One array out of MLX: its bits as numpy and its MLX dtype name."""

    data: np.ndarray
    dtype: str

    def __post_init__(self) -> None:
        storage = STORAGE.get(self.dtype)
        if storage is None:
            raise PayloadError(f"unsupported dtype {self.dtype!r}")
        if self.data.dtype != np.dtype(storage):
            raise PayloadError(f"{self.dtype} carried as {self.data.dtype}, not "
                               f"{np.dtype(storage)}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @classmethod
    def from_mlx(cls, a) -> Tensor:
        """A C-ordered copy (a cache slice can be a transposed view in MLX)."""
        import mlx.core as mx

        dtype = str(a.dtype).removeprefix("mlx.core.")
        if dtype == "bfloat16":
            a = a.view(mx.uint16)
        return cls(np.array(a, order="C"), dtype)

    def to_mlx(self):
        import mlx.core as mx

        arr = mx.array(self.data)
        return arr.view(mx.bfloat16) if self.dtype == "bfloat16" else arr

    def to_float32(self) -> np.ndarray:
        """The values, widened exactly to float32 (for lossy codecs)."""
        if self.dtype == "bfloat16":
            return (self.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return self.data.astype(np.float32)

    @classmethod
    def from_float32(cls, x: np.ndarray, dtype: str) -> Tensor:
        """Values narrowed to ``dtype`` (round to nearest even), as MLX would cast them."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if dtype == "bfloat16":
            bits = x.view(np.uint32)
            rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            return cls((rounded >> np.uint32(16)).astype(np.uint16), dtype)
        if dtype not in STORAGE:
            raise PayloadError(f"unsupported dtype {dtype!r}")
        return cls(x.astype(STORAGE[dtype]), dtype)

    def is_finite(self) -> bool:
        return bool(np.isfinite(self.to_float32()).all())


@dataclass
class BlockPayload:
    """The KV of one block and, for a checkpoint, the recurrent state at its end."""

    kv: dict[int, tuple[Tensor, Tensor]]  # layer index -> (keys, values)
    state: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)  # layer -> arrays

    @property
    def has_state(self) -> bool:
        return bool(self.state)

    @property
    def tokens(self) -> int:
        """Tokens of KV it holds (a full block, or fewer for a tail)."""
        shape = next(iter(self.kv.values()))[0].shape if self.kv else ()
        return shape[-2] if len(shape) >= 2 else 0  # keys are (1, heads, tokens, dim)

    @property
    def nbytes(self) -> int:
        kv = sum(k.nbytes + v.nbytes for k, v in self.kv.values())
        return kv + sum(t.nbytes for arrays in self.state.values() for t in arrays)

    def without_state(self) -> BlockPayload:
        return BlockPayload(self.kv)

    def cut(self, tokens: int) -> BlockPayload:
        """The KV of its first ``tokens`` tokens, no state (the state is at its end).

        KV is position-wise: the first tokens' keys and values do not depend on
        the tokens after them, so an attention-only model can restore a stored
        block up to where a prompt leaves it.
        """
        if not 0 < tokens <= self.tokens:
            raise PayloadError(f"cannot cut a block of {self.tokens} tokens to {tokens}")
        return BlockPayload({layer: (_first(k, tokens), _first(v, tokens))
                             for layer, (k, v) in self.kv.items()})

    def with_state(self, state: dict[int, tuple[Tensor, ...]]) -> BlockPayload:
        return BlockPayload(self.kv, state)


def _first(t: Tensor, tokens: int) -> Tensor:
    """The first ``tokens`` positions of a KV array ``(1, heads, T, dim)``, C-ordered."""
    return Tensor(np.ascontiguousarray(t.data[..., :tokens, :]), t.dtype)


@dataclass
class CapturedBlock:
    """One block on its way to the store (captured, or read from SSD and promoted)."""

    block_id: str
    parent_id: str
    payload: BlockPayload
    lossy: bool = False  # its checkpoint was decoded from a lossy sidecar codec
    token_ids: tuple[int, ...] = ()  # its own tokens, for the store's prefix tree
    # False: its conversation is larger than the model's share of the hot tier, so the
    # store keeps it out of RAM (on SSD only, when there is an SSD tier).
    keep_hot: bool = True

    @property
    def has_checkpoint(self) -> bool:
        return self.payload.has_state

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


@dataclass
class RestorePlan:
    """What a request starts from: the KV of its first blocks, the last one's checkpoint.

    Every block holds ``block_size`` tokens but the last, which may be
    ``partial``: a tail (a partial block captured where a conversation branches)
    or, for an attention-only model, a stored block or tail that shares only its
    first tokens with the prompt: it holds ``partial.stored`` tokens and only its
    first ``block_tokens[-1]`` are restored.
    """

    block_tokens: list[int]
    blocks: list[BlockPayload]
    partial: Partial | None = None

    @property
    def tokens(self) -> int:
        return sum(self.block_tokens)

    @property
    def cut_from(self) -> int:
        """Tokens the last block holds when it is cut; 0 when it is not."""
        return self.partial.stored if self.partial is not None and self.partial.cut else 0

    @property
    def stored_tokens(self) -> list[int]:
        """Tokens each block holds as stored (what its payload is checked against)."""
        if not self.cut_from or not self.block_tokens:
            return list(self.block_tokens)
        return [*self.block_tokens[:-1], self.cut_from]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks)


# ---- safetensors naming: the file format, in one place ---------------------------------

MAX_TOKEN_IDS = 1 << 16  # more than any block size: a longer ``token_ids`` is no block's


def encode_token_ids(token_ids: Sequence[int]) -> str:
    """A block's own tokens for its file's metadata (little-endian uint32, base64), so a
    restart knows them without promoting the block: the prefix tree can cut it."""
    return base64.b64encode(struct.pack(f"<{len(token_ids)}I", *token_ids)).decode()


def decode_token_ids(text: str) -> tuple[int, ...]:
    """The tokens ``encode_token_ids`` wrote; () for none or anything malformed."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        return ()
    if len(raw) % 4 or len(raw) > 4 * MAX_TOKEN_IDS:
        return ()
    return struct.unpack(f"<{len(raw) // 4}I", raw)


def kv_tensors(payload: BlockPayload) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The KV arrays as named tensors (``k{layer}``, ``v{layer}``) and their dtypes."""
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for layer, (k, v) in payload.kv.items():
        for name, t in ((f"k{layer}", k), (f"v{layer}", v)):
            tensors[name], dtypes[name] = t.data, t.dtype
    return tensors, dtypes


def state_tensors(state: dict[int, tuple[Tensor, ...]]) -> dict[str, Tensor]:
    """Recurrent arrays by name (``s{layer}.{j}``)."""
    return {f"s{layer}.{j}": t for layer, arrays in state.items() for j, t in enumerate(arrays)}


def to_tensors(payload: BlockPayload, with_state: bool) -> tuple[dict[str, np.ndarray], str]:
    """Named tensors of a block file and the JSON of their dtypes."""
    tensors, dtypes = kv_tensors(payload)
    if with_state:
        for name, t in state_tensors(payload.state).items():
            tensors[name], dtypes[name] = t.data, t.dtype
    return tensors, json.dumps(dtypes, sort_keys=True)


def from_tensors(tensors: dict[str, np.ndarray], dtypes_json: str) -> BlockPayload:
    """The payload of a block file; ``PayloadError`` on any name or dtype it cannot place."""
    try:
        dtypes = json.loads(dtypes_json)
    except (json.JSONDecodeError, TypeError):
        raise PayloadError("dtypes metadata is not JSON") from None
    if not isinstance(dtypes, dict) or set(dtypes) != set(tensors):
        raise PayloadError("dtypes metadata does not name exactly the file's tensors")
    kv: dict[int, list] = {}
    named_state: dict[str, Tensor] = {}
    for name, data in tensors.items():
        t = Tensor(data, dtypes[name])
        if name[:1] in ("k", "v") and name[1:].isdigit():
            kv.setdefault(int(name[1:]), [None, None])["kv".index(name[0])] = t
        else:
            named_state[name] = t
    if any(None in pair for pair in kv.values()):
        raise PayloadError("a layer has keys without values or values without keys")
    return BlockPayload({layer: (k, v) for layer, (k, v) in kv.items()},
                        state_from_names(named_state))


def state_from_names(named: dict[str, Tensor]) -> dict[int, tuple[Tensor, ...]]:
    """Recurrent arrays named ``s{layer}.{j}`` back into layers; ``PayloadError`` if odd."""
    layers: dict[int, dict[int, Tensor]] = {}
    for name, t in named.items():
        try:
            layer, j = (int(x) for x in name.removeprefix("s").split("."))
        except ValueError:
            raise PayloadError(f"unknown tensor name {name!r}") from None
        if not name.startswith("s"):
            raise PayloadError(f"unknown tensor name {name!r}")
        layers.setdefault(layer, {})[j] = t
    out = {}
    for layer, arrays in layers.items():
        if sorted(arrays) != list(range(len(arrays))):
            raise PayloadError(f"recurrent layer {layer} has gaps in its arrays")
        out[layer] = tuple(arrays[j] for j in range(len(arrays)))
    return out
