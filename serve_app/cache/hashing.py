"""Block identity: chained sha256 ids over a canonical encoding.

A block id is ``H(parent_id, token ids, extra keys)``. The root binds the
model identity (weights, tokenizer, chat template), the cache-layout signature
and the block size, so no other model or layout can ever produce the same id.
A per-tenant salt (``cache_salt`` or a digest of the API key) forks the root,
so one tenant cannot probe another's prefixes.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

_WEIGHTS_HASH_LIMIT = 256 * 1024 * 1024


def _h(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.hexdigest()


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_identity(model_dir: Path, source: str, chat_template: str | None) -> str:
    """A digest of what determines a model's KV: config, weights, tokenizer, template.

    Weights are hashed in full when small (embedded models); large real models
    are identified by their safetensors file names and sizes plus the source
    and (for hub models) the snapshot directory, which names the commit.
    """
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    weights = [p for p in files if p.suffix == ".safetensors"]
    total = sum(p.stat().st_size for p in weights)
    desc: dict = {
        "source": source,
        "snapshot": model_dir.name,
        "weights": {p.name: p.stat().st_size for p in weights},
    }
    if total <= _WEIGHTS_HASH_LIMIT:
        desc["weights_sha256"] = {p.name: _file_sha256(p) for p in weights}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            desc[name] = _file_sha256(model_dir / name)
    desc["chat_template"] = chat_template or ""
    return _h(b"model", json.dumps(desc, sort_keys=True).encode())


def root_id(identity: str, layout_digest: str, block_size: int) -> str:
    return _h(b"root", identity.encode(), layout_digest.encode(), str(block_size).encode())


def salted_root(root: str, salt: str | None) -> str:
    """The root a request's chain starts from; unsalted requests share ``root``."""
    if not salt:
        return root
    return _h(b"salt", root.encode(), salt.encode())


def block_id(parent: str, tokens: list[int], extra: dict | None = None) -> str:
    encoded = struct.pack(f"<{len(tokens)}I", *tokens)
    extra_bytes = json.dumps(extra, sort_keys=True).encode() if extra else b""
    return _h(b"block", parent.encode(), encoded, extra_bytes)


def chain(root: str, tokens: list[int], block_size: int, start_parent: str | None = None,
          start_block: int = 0) -> list[str]:
    """Ids of every full block of ``tokens`` (from block ``start_block`` on)."""
    ids: list[str] = []
    parent = start_parent or root
    for b in range(start_block, len(tokens) // block_size):
        parent = block_id(parent, tokens[b * block_size : (b + 1) * block_size])
        ids.append(parent)
    return ids
