"""The SSD tier's file format: one safetensors file per block (or recurrent-state
sidecar), its metadata in the header (format version, kind, ids, model identity,
layout, block size, token count, created time, codec) so the index is rebuilt from
headers alone; a file's ``sha256`` names that one written file. Every read is checked
(fail closed): a file that does not match is a miss, never data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import load

from serve_app.cache.ssd_fs import FORMAT_VERSION, _open_file, _parent_fd

_HEX = re.compile(r"^[0-9a-f]{64}$")


_MAX_HEADER = 16 * 1024 * 1024




class SSDError(Exception):
    """A file that cannot be trusted: wrong header, wrong ids, unreadable."""


@dataclass
class DiskEntry:
    """One file of the tier, as known from its header."""

    kind: str  # "block" or "sidecar"
    block_id: str
    path: Path
    nbytes: int
    model: str
    layout: str
    last_used: float
    meta: dict[str, str] = field(default_factory=dict)


def digest_of(entry: DiskEntry) -> str | None:
    """What names one written file: its checksum (unique per write, see ``write``)."""
    return entry.meta.get("sha256")


def check_id(block_id: str) -> str:
    if not _HEX.match(block_id):
        raise SSDError(f"not a block id: {block_id[:80]!r}")
    return block_id


def read_header(path: Path) -> tuple[dict, dict[str, str]]:
    """The safetensors header (tensor table, metadata) without reading tensor data."""
    path = Path(path)
    with os.fdopen(_open_file(path), "rb") as f:
        return _parse_header(path, f.read(8), f)


def _parse_header(path: Path, raw: bytes, f) -> tuple[dict, dict[str, str]]:
    if len(raw) != 8:
        raise SSDError(f"{path.name}: truncated header")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER:
        raise SSDError(f"{path.name}: header of {n} bytes")
    try:
        header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise SSDError(f"{path.name}: header is not JSON") from None
    if not isinstance(header, dict):
        raise SSDError(f"{path.name}: header is not an object")
    meta = header.pop("__metadata__", None) or {}
    return header, meta


def read_file(path: Path | str, expect: dict[str, str]) -> tuple[dict, dict[str, str]]:
    """Tensors and metadata of one file; ``SSDError`` if it is not what ``expect`` says.

    Used by replicas too: they read block files directly (same node), so the
    cache-store actor never copies tensor bytes.
    """
    path = Path(path)
    try:
        # One open, never through a symlink: the bytes checked are the bytes loaded.
        with os.fdopen(_open_file(path), "rb") as f:
            data = f.read()
        _, meta = _parse_header(path, data[:8], _Bytes(data, 8))
        if meta.get("format_version") != FORMAT_VERSION:
            raise SSDError(f"{path.name}: format version {meta.get('format_version')!r}")
        for key, value in expect.items():
            if meta.get(key) != value:
                raise SSDError(f"{path.name}: {key} is {meta.get(key)!r}, expected {value!r}")
        tensors = load(data)
        if meta.get("sha256") != tensor_digest(tensors, meta):
            raise SSDError(f"{path.name}: checksum mismatch")
    except SSDError:
        raise
    except Exception as exc:  # safetensors raises its own error type on truncated files
        raise SSDError(f"{path.name}: {exc}") from None
    return tensors, meta


def tensor_digest(tensors: dict[str, np.ndarray], meta: dict[str, str]) -> str:
    """A checksum of a file's metadata, tensor dtypes, shapes and bytes.

    Kept in the file itself: bit rot anywhere is a miss, never a wrong token.
    """
    h = hashlib.sha256()
    h.update(json.dumps({k: v for k, v in meta.items() if k != "sha256"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = np.ascontiguousarray(tensors[name])
        h.update(f"{name}|{t.dtype.str}|{t.shape}".encode())
        h.update(t.tobytes())
    return h.hexdigest()


class _Bytes:
    """``read(n)`` over bytes already read, from ``offset``."""

    def __init__(self, data: bytes, offset: int) -> None:
        self.data, self.offset = data, offset

    def read(self, n: int) -> bytes:
        out = self.data[self.offset : self.offset + n]
        self.offset += n
        return out


def entry_from_file(path: Path) -> DiskEntry | None:
    """The index entry of a file, from its header: None for another format version;
    ``SSDError`` for a header that does not match the file's name."""
    _, meta = read_header(path)
    if meta.get("format_version") != FORMAT_VERSION:
        return None
    kind = meta.get("kind")
    block_id = check_id(meta.get("block_id", ""))
    if kind not in ("block", "sidecar") or path.stem != block_id:
        raise SSDError(f"{path.name}: metadata does not match its name")
    with _parent_fd(path) as (dfd, name):
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    return DiskEntry(kind, block_id, path, st.st_size, meta.get("model", ""),
                     meta.get("layout", ""), st.st_mtime, meta)


@dataclass(frozen=True)
class DiskInfo:
    """What the SSD tier records of a block besides its tensors."""

    model: str  # model identity digest
    layout: str  # layout digest
    block_size: int
    storage: str  # "ssd_sidecar" or "embedded"
    codec: str
    # The K/V's format: "float", or quantized ("q8g64-bfloat16": bits, group, scales).
    # The layout digest already tells formats apart; the file names its own for people.
    kv_format: str = "float"
