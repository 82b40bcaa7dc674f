"""Block identity: chained sha256 ids over a canonical encoding.

A block id is ``H(parent_id, token ids)``. The root binds the model identity
(weight bytes, config, tokenizer, chat template), the cache-layout signature
(array shapes and dtypes, mlx-lm cache epoch) and the block size, so no other
model, format or layout can ever produce the same id.
A per-tenant salt (``cache_salt`` or a digest of the API key) forks the root,
so one tenant cannot probe another's prefixes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from pathlib import Path

_memo_lock = threading.Lock()
_memo: dict[str, tuple] = {}  # real path -> (*memo key, sha256)
SAMPLES = 8  # data samples in a memo key, spread over the file
SAMPLE_BYTES = 64 * 1024
MAX_HEADER_BYTES = 16 * 1024 * 1024


def _h(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _load_memo(memo: Path | None) -> dict:
    if memo is None:
        return {}
    try:
        data = json.loads(memo.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_memo(memo: Path, entries: dict) -> None:
    """Atomic replace; a lost update between two processes only costs a re-hash."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f"{memo.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, memo)
    except OSError:
        pass


def _sample_digest(path: str) -> str:
    """sha256 of a file's safetensors header (tensor names, dtypes, shapes, offsets and
    metadata) and of ``SAMPLES`` slices of its bytes spread from start to end: cheap
    (well under a MiB read), and different for new weights of the same size."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        h.update(head)
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            h.update(f.read(min(n, MAX_HEADER_BYTES)))
        for i in range(SAMPLES):
            f.seek(max(0, (size - SAMPLE_BYTES) * i // max(1, SAMPLES - 1)))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _memo_key(real: str) -> tuple:
    """What must be unchanged for a remembered digest to stand: size, mtime, inode and
    ctime (``rsync -a`` keeps size and mtime, but its rename gives a new inode and no tool
    can set ctime) and a digest of the header and sampled bytes."""
    st = os.stat(real)
    return (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns,
            _sample_digest(real))


def weights_digest(path: Path, memo: Path | None = None) -> str:
    """sha256 of a weights file, computed once per ``_memo_key``.

    Real checkpoints are gigabytes: the digest is remembered in this process
    and in ``memo`` (a JSON file), so a restart does not read them again. A file
    re-fused or replaced in place (a new size, mtime, inode or ctime, or other
    header or sampled bytes, as after ``rsync -a`` of new weights) is hashed again.
    """
    real = str(Path(path).resolve())
    key = _memo_key(real)
    with _memo_lock:
        known = _memo.get(real)
        if known is not None and known[:-1] == key:
            return known[-1]
        stored = _load_memo(memo).get(real)
    if (isinstance(stored, list) and len(stored) == len(key) + 1
            and tuple(stored[:-1]) == key):
        digest = str(stored[-1])
    else:
        digest = _file_sha256(Path(real))
        if memo is not None:
            with _memo_lock:
                entries = _load_memo(memo)
                entries[real] = [*key, digest]
                _save_memo(memo, entries)
    with _memo_lock:
        _memo[real] = (*key, digest)
    return digest


def model_identity(model_dir: Path, source: str, chat_template: str | None,
                   memo: Path | None = None) -> str:
    """A digest of what determines a model's KV: config, weights, tokenizer, template.

    The weights are identified by their content (``weights_digest``), never by
    names and sizes alone: a model re-fused in place never restores stale KV.
    """
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    desc: dict = {
        "source": source,
        "weights_sha256": {p.name: weights_digest(p, memo) for p in files
                           if p.suffix == ".safetensors"},
    }
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            desc[name] = _file_sha256(model_dir / name)
    desc["chat_template"] = chat_template or ""
    return _h(b"model", json.dumps(desc, sort_keys=True).encode())


def shard_identity(identity: str, shard: str) -> str:
    """A rank's own identity of a model sharded over ranks (``shard``: ``tensor:0/2``):
    its blocks hold its share of the KV, which no other rank, size or mode can read."""
    return _h(b"shard", identity.encode(), shard.encode())


def root_id(identity: str, layout_digest: str, block_size: int) -> str:
    return _h(b"root", identity.encode(), layout_digest.encode(), str(block_size).encode())


def salted_root(root: str, salt: str | None, api_key_digest: str | None = None) -> str:
    """The root a request's chain starts from; unsalted requests share ``root``.

    The API-key fork has its own tag, so no ``cache_salt`` a client sends can
    reach another tenant's root.
    """
    if salt:
        root = _h(b"salt", root.encode(), salt.encode())
    if api_key_digest:
        root = _h(b"api-key", root.encode(), api_key_digest.encode())
    return root


def block_id(parent: str, tokens: list[int]) -> str:
    """A block's id: its parent's id and its tokens (salts fork the root instead)."""
    encoded = struct.pack(f"<{len(tokens)}I", *tokens)
    # The trailing empty part was once "extra keys": kept so ids on disk stay valid.
    return _h(b"block", parent.encode(), encoded, b"")


def chain(root: str, tokens: list[int], block_size: int) -> list[str]:
    """Ids of every full block of ``tokens``, chained from ``root``."""
    ids: list[str] = []
    parent = root
    for b in range(len(tokens) // block_size):
        parent = block_id(parent, tokens[b * block_size : (b + 1) * block_size])
        ids.append(parent)
    return ids
