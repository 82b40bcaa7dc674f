"""The SSD tier: one safetensors file per block, recurrent-state sidecars apart.

Layout under the cache directory::

    v1/LOCK                                      held (flock) by the serving process
    v1/blocks/<id[:2]>/<block id>.safetensors    KV of one block (+ checkpoint if embedded)
    v1/sidecars/<layout[:16]>/<id[:2]>/<block id>.safetensors   recurrent checkpoint

``SSDStore`` keeps the index (rebuilt at start from headers alone), the budgets and the
pins. Writes go to a temporary file, are fsynced, renamed into place and the directory
fsynced: a reader never sees half a file, and a crash leaves at most a temporary file,
removed at the next start. Files are created 0600 and directories 0700: prompts can be
recovered from cached KV, so the cache is private to its user. The file format is
``ssd_format.py``; opening files without following symlinks, and refusing directories
other users could write to, is ``ssd_fs.py``. A file's ``sha256`` names that one written
file: removals compare it with the indexed entry, so a caller holding a stale view never
deletes a file written after it looked.

Plain Python: the cache-store actor wraps it, ``python -m serve_app gc``
uses it without MLX or a model, and tests drive it directly.
"""

from __future__ import annotations

import enum
import errno
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from serve_app.cache.ssd_format import (
    DiskEntry,
    SSDError,
    check_id,
    digest_of,
    entry_from_file,
    read_file,
    tensor_digest,
)
from serve_app.cache.ssd_fs import (
    _CLOEXEC,
    FORMAT_VERSION,
    TMP_MARK,
    _locate,
    _unlink_at,
    dir_in_use,
    lock_dir,
    lock_holder,
    open_dir,
    walk_files,
)
from serve_app.cache.stats import SSDStats, Usage
from serve_app.cache.wear import RollingByteBudget


class WriteResult(enum.Enum):
    """How a write ended; only ``DONE`` is truthy."""

    DONE = "done"
    SKIPPED = "skipped"  # free-space floor, the budget full of pinned files, or the hourly
    # write budget spent (counted)
    FAILED = "failed"  # an I/O error (counted)

    def __bool__(self) -> bool:
        return self is WriteResult.DONE


class SSDStore:
    """Index, budget and file I/O of the SSD tier. Thread-safe."""

    def __init__(self, root: Path, budget_bytes: int, min_free_bytes: int = 0,
                 write_budget_per_hour: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root)
        self.base = self.root / f"v{FORMAT_VERSION}"
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        # Bytes written in any rolling hour (``cache/wear.py``); None: no limit.
        self.write_budget = (None if write_budget_per_hour is None
                             else RollingByteBudget(write_budget_per_hour, clock=clock))
        self.stats = SSDStats()
        self.active: set[tuple[str, str]] = set()  # (model identity, layout) being served
        self._blocks: dict[str, DiskEntry] = {}
        self._sidecars: dict[tuple[str, str], DiskEntry] = {}  # (layout, block id)
        # Kept current by _index/_unindex, so budgets and stats never walk the index.
        self._layouts_of: dict[str, set[str]] = {}  # block id -> layouts with a sidecar
        self._usage: dict[str, dict[str, int]] = {}  # model identity[:16] -> files, evictions
        self._bytes = 0
        self._orphans = 0  # sidecars whose block is not indexed
        self._pins: dict[str, int] = {}
        self._lock = threading.RLock()
        self._lock_fd: int | None = None
        self.ready = threading.Event()
        # Told the id of every block file indexed or unindexed (the block directory's feed).
        self.on_block_change: Callable[[str], None] = lambda block_id: None

    # ---- opening ---------------------------------------------------------------------

    def lock_directory(self) -> bool:
        """Take the directory's lock (a serving process holds it; ``gc`` checks it)."""
        fd = lock_dir(self.root, self.base.name)
        if fd is None:
            return False
        self._lock_fd = fd
        return True

    def lock_holder(self) -> str:
        """The pid written in the LOCK file by the process holding it ("?" if unreadable)."""
        return lock_holder(self.base)

    def directory_in_use(self) -> bool:
        """True if another process holds the lock."""
        return dir_in_use(self.base)

    def open(self, clean: bool = True) -> None:
        """Rebuild the index from file headers; remove temporary files of a crash.

        ``clean=False`` only counts them (``temp_files``), for a dry run.
        """
        os.close(open_dir(self.root, [self.base.name], create=True))
        blocks: dict[str, DiskEntry] = {}
        sidecars: dict[tuple[str, str], DiskEntry] = {}
        self.temp_files: list[Path] = []
        for path in walk_files(self.root, self.base.name):
            if TMP_MARK in path.name:
                if clean:
                    self._unlink(path)
                    self.stats.temp_files_removed += 1
                else:
                    self.temp_files.append(path)
                continue
            try:
                entry = entry_from_file(path)
            except (SSDError, OSError):
                self.stats.foreign_files += 1
                continue
            if entry is None:
                self.stats.foreign_files += 1
            elif entry.kind == "block":
                blocks[entry.block_id] = entry
            else:
                sidecars[(entry.layout, entry.block_id)] = entry
        with self._lock:
            for entry in [*blocks.values(), *sidecars.values()]:
                self._index(entry)
        self.ready.set()

    # ---- paths -------------------------------------------------------------------------

    def block_path(self, block_id: str) -> Path:
        check_id(block_id)
        return self.base / "blocks" / block_id[:2] / f"{block_id}.safetensors"

    def sidecar_path(self, layout: str, block_id: str) -> Path:
        check_id(block_id)
        check_id(layout)
        return self.base / "sidecars" / layout[:16] / block_id[:2] / f"{block_id}.safetensors"

    # ---- writing -----------------------------------------------------------------------

    def write(self, kind: str, block_id: str, tensors: dict[str, np.ndarray],
              meta: dict[str, str]) -> WriteResult:
        """Write one file atomically and index it; a falsy result (counted) if it was not.

        The temporary file is written and fsynced outside the lock; the rename
        into place and the index update happen together under it, so a remover
        never sees a renamed file that is not indexed yet (or the other way).
        """
        layout = meta["layout"]
        # safetensors writes raw memory, ignoring strides: make every array C-contiguous.
        tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
        path = self.block_path(block_id) if kind == "block" else self.sidecar_path(layout,
                                                                                    block_id)
        meta = {**meta, "format_version": FORMAT_VERSION, "kind": kind, "block_id": block_id,
                "created": meta.get("created") or f"{time.time():.3f}",
                "write_id": secrets.token_hex(8)}  # makes the checksum name this write
        meta["sha256"] = tensor_digest(tensors, meta)
        data = save(tensors, metadata=meta)
        # The wear budget first: a write it drops must not evict files to make room.
        if self.write_budget is not None and not self.write_budget.try_take(len(data)):
            self._count("writes_skipped_write_budget")
            return WriteResult.SKIPPED
        result = self._write_checked(kind, block_id, path, data, meta)
        if result is not WriteResult.DONE and self.write_budget is not None:
            self.write_budget.give_back(len(data))  # nothing reached the disk for good
        return result

    def _write_checked(self, kind: str, block_id: str, path: Path, data: bytes,
                       meta: dict[str, str]) -> WriteResult:
        """``write`` past the wear budget: the byte budget, the free-space floor, the file."""
        if not self._room_for(len(data)):
            return WriteResult.SKIPPED
        if shutil.disk_usage(self.root).free - len(data) < self.min_free_bytes:
            self._count("writes_skipped_low_space")
            return WriteResult.SKIPPED
        try:
            dfd = self._dir_of(path, create=True)
        except OSError:  # e.g. a symlink planted where a directory should be
            self._count("writes_failed")
            return WriteResult.FAILED
        try:
            return self._write_in(dfd, path, data, DiskEntry(
                kind, block_id, path, len(data), meta.get("model", ""), meta["layout"],
                time.time(), meta))
        finally:
            os.close(dfd)

    def _dir_of(self, path: Path, create: bool = False) -> int:
        """The descriptor of the directory of ``path`` (a path of this tier)."""
        root, dirs, _ = _locate(path)
        if root != self.root or not dirs or dirs[0] != self.base.name:
            raise OSError(errno.EINVAL, "not a path of this cache directory", str(path))
        return open_dir(self.root, dirs, create)

    def _write_in(self, dfd: int, path: Path, data: bytes, entry: DiskEntry) -> WriteResult:
        """Temp file, fsync, rename and index, all relative to the directory ``dfd``."""
        tmp = f"{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}"
        try:
            self._write_temp(dfd, tmp, data)
        except OSError:
            self._count("writes_failed")
            return WriteResult.FAILED
        try:
            with self._lock:
                # Other writes may have filled the budget meanwhile: check again.
                if not self._room_for(len(data)):
                    _unlink_at(dfd, tmp)
                    return WriteResult.SKIPPED
                os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
                self._index(entry)
                self.stats.writes_done += 1
                self.stats.bytes_written += len(data)
        except OSError:
            self._count("writes_failed")
            _unlink_at(dfd, tmp)
            return WriteResult.FAILED
        try:
            os.fsync(dfd)
        except OSError:  # the file is in place; only its durability across a crash is at stake
            pass
        return WriteResult.DONE

    def _count(self, name: str) -> None:
        """Writes run on several threads (the writer, inline writes): count under the lock."""
        with self._lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _room_for(self, nbytes: int) -> bool:
        """Evict until ``nbytes`` more fit; False (counted) if pinned files fill the budget."""
        with self._lock:
            self._evict_for(nbytes)
            if self._bytes + nbytes > self.budget_bytes:
                self.stats.writes_skipped_budget += 1
                return False
            return True

    def _write_temp(self, dfd: int, tmp: str, data: bytes) -> None:
        """A fsynced temporary file ``tmp`` (0600) in directory ``dfd``, to be renamed."""
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | _CLOEXEC,
                     0o600, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError:
            os.close(fd)
            _unlink_at(dfd, tmp)
            raise
        os.close(fd)

    # ---- reading -------------------------------------------------------------------------

    def block_ids(self) -> list[str]:
        with self._lock:
            return list(self._blocks)

    def has_block(self, block_id: str) -> bool:
        with self._lock:
            return block_id in self._blocks

    def has_sidecar(self, layout: str, block_id: str) -> bool:
        with self._lock:
            return (layout, block_id) in self._sidecars

    def block_entry(self, block_id: str) -> DiskEntry | None:
        with self._lock:
            return self._blocks.get(block_id)

    def sidecar_entry(self, layout: str, block_id: str) -> DiskEntry | None:
        with self._lock:
            return self._sidecars.get((layout, block_id))

    def read(self, entry: DiskEntry, expect: dict[str, str]) -> tuple[dict, dict[str, str]]:
        """Tensors and metadata of one file; a file that fails is removed (``SSDError``)."""
        self.stats.reads += 1
        try:
            out = read_file(entry.path, expect)
        except SSDError:
            self.stats.read_failures += 1
            self.remove(entry)
            raise
        self.touch(entry)
        return out

    def touch(self, entry: DiskEntry | None) -> None:
        """Mark recently used; the file's mtime carries recency across restarts."""
        if entry is None:  # evicted meanwhile: the read will miss cleanly
            return
        entry.last_used = time.time()
        try:
            dfd = self._dir_of(entry.path)
        except OSError:
            return
        try:
            os.utime(entry.path.name, dir_fd=dfd, follow_symlinks=False)
        except OSError:
            pass
        finally:
            os.close(dfd)

    # ---- pins, removal, budget -----------------------------------------------------------

    def pin(self, block_ids: list[str]) -> None:
        with self._lock:
            for b in block_ids:
                self._pins[b] = self._pins.get(b, 0) + 1

    def unpin(self, block_ids: list[str]) -> None:
        with self._lock:
            for b in block_ids:
                n = self._pins.get(b, 0) - 1
                if n > 0:
                    self._pins[b] = n
                else:
                    self._pins.pop(b, None)

    def remove(self, entry: DiskEntry) -> bool:
        """Delete the file ``entry`` describes, and only that one; False if it was rewritten.

        The caller's entry may be stale: if the index holds another file under
        the same key (a different checksum), that newer file stays. Removing a
        block also removes its sidecars (worthless alone). Unindex and unlink
        happen under the lock, so no write can slip in between.
        """
        with self._lock:
            indexed = self._indexed_as(entry.kind, entry.layout, entry.block_id)
            if indexed is not None and digest_of(indexed) != digest_of(entry):
                return False
            if indexed is not None:
                self._unindex(indexed)
                if entry.kind == "block":
                    for layout in list(self._layouts_of.get(entry.block_id, ())):
                        sidecar = self._sidecars[(layout, entry.block_id)]
                        self._unindex(sidecar)
                        self._unlink(sidecar.path)
            # Not indexed: renames are indexed under this lock, so no newer file is there.
            self._unlink(entry.path)
            return True

    def remove_model(self, identities: frozenset[str]) -> tuple[int, int, int]:
        """Delete every file of the model identities given (a cache clear): blocks with
        their sidecars, and sidecars alone. A file a restore has pinned stays. Returns the
        files and bytes deleted and the files kept (pinned)."""
        files = nbytes = kept = 0
        with self._lock:
            entries = [e for e in [*self._blocks.values(), *self._sidecars.values()]
                       if e.model in identities]
            for entry in entries:
                if self._pins.get(entry.block_id):
                    kept += 1
                elif self._indexed(entry):  # a sidecar goes with its block: count it then
                    group = [entry, *(self._sidecars[(layout, entry.block_id)] for layout in
                                      self._layouts_of.get(entry.block_id, ())
                                      if entry.kind == "block")]
                    if self.remove(entry):
                        files += len(group)
                        nbytes += sum(e.nbytes for e in group)
        return files, nbytes, kept

    def remove_file(self, kind: str, layout: str, block_id: str, digest: str | None) -> bool:
        """Remove the indexed file of a key if it is the one ``digest`` names (None: any)."""
        with self._lock:
            entry = self._indexed_as(kind, layout, block_id)
            if entry is None or (digest is not None and digest_of(entry) != digest):
                return False
            return self.remove(entry)

    def remove_path(self, path: Path) -> list[Path]:
        """Delete one file of this tier by its path, under the store's lock (``gc
        --apply``): an indexed file through ``remove`` (the index and byte count stay
        right; a block takes its sidecars with it), a temporary or unindexed file
        directly, never through a symlink. Returns the paths deleted."""
        path = Path(path)
        with self._lock:
            entry = self._entry_at(path)
            if entry is None:
                return [path] if self._unlink(path) else []
            group = [entry.path]
            if entry.kind == "block":
                group += [self._sidecars[(layout, entry.block_id)].path
                          for layout in self._layouts_of.get(entry.block_id, ())]
            self.remove(entry)
            return [p for p in group if not os.path.lexists(p)]

    def _entry_at(self, path: Path) -> DiskEntry | None:
        """The indexed entry whose file is ``path``. Under the lock."""
        block = self._blocks.get(path.stem)
        if block is not None and block.path == path:
            return block
        for layout in self._layouts_of.get(path.stem, ()):
            sidecar = self._sidecars[(layout, path.stem)]
            if sidecar.path == path:
                return sidecar
        return None

    def _indexed_as(self, kind: str, layout: str, block_id: str) -> DiskEntry | None:
        if kind == "block":
            return self._blocks.get(block_id)
        return self._sidecars.get((layout, block_id))

    def activate(self, model: str, layout: str) -> None:
        """Files of a (model, layout) being served are evicted after everyone else's."""
        with self._lock:
            self.active.add((model, layout))

    def _index(self, entry: DiskEntry) -> None:
        """Add a file to the index (replacing one of the same key). Under the lock."""
        if entry.kind == "block":
            old = self._blocks.get(entry.block_id)
            if old is not None:
                self._unindex(old)
            self._blocks[entry.block_id] = entry
            self._orphans -= len(self._layouts_of.get(entry.block_id, ()))
            self.on_block_change(entry.block_id)
        else:
            old = self._sidecars.get((entry.layout, entry.block_id))
            if old is not None:
                self._unindex(old)
            self._sidecars[(entry.layout, entry.block_id)] = entry
            self._layouts_of.setdefault(entry.block_id, set()).add(entry.layout)
            self._orphans += entry.block_id not in self._blocks
        self._account(entry, +1)

    def _unindex(self, entry: DiskEntry) -> None:
        """Take an indexed file out of the index. Under the lock."""
        if entry.kind == "block":
            del self._blocks[entry.block_id]
            self._orphans += len(self._layouts_of.get(entry.block_id, ()))
            self.on_block_change(entry.block_id)
        else:
            del self._sidecars[(entry.layout, entry.block_id)]
            layouts = self._layouts_of[entry.block_id]
            layouts.discard(entry.layout)
            if not layouts:
                del self._layouts_of[entry.block_id]
            self._orphans -= entry.block_id not in self._blocks
        self._account(entry, -1)

    def _usage_of(self, model: str) -> dict[str, int]:
        return self._usage.setdefault(model[:16], {"blocks": 0, "block_bytes": 0, "sidecars": 0,
                                                   "sidecar_bytes": 0, "evictions": 0})

    def _account(self, entry: DiskEntry, sign: int) -> None:
        usage = self._usage_of(entry.model)
        usage[f"{entry.kind}s"] += sign
        usage[f"{entry.kind}_bytes"] += sign * entry.nbytes
        self._bytes += sign * entry.nbytes

    def bytes_used(self) -> int:
        with self._lock:
            return self._bytes

    def orphans(self) -> list[DiskEntry]:
        """Sidecars whose KV block is gone."""
        with self._lock:
            return [e for (_, b), e in self._sidecars.items() if b not in self._blocks]

    def _evict_for(self, incoming: int) -> None:
        """Evict until ``incoming`` more bytes fit: other models first, then LRU."""
        if self._bytes + incoming <= self.budget_bytes:
            return
        for entry in self.eviction_plan(incoming):
            if self._indexed(entry):  # else already gone with its block
                self._evict(entry)

    def _evict(self, entry: DiskEntry) -> None:
        """Remove an indexed file (a block takes its sidecars with it), counted. Under the lock."""
        before = self._bytes
        self.remove(entry)
        self.stats.evictions += 1
        self.stats.evicted_bytes += before - self._bytes
        self._usage_of(entry.model)["evictions"] += 1

    def eviction_plan(self, incoming: int = 0,
                      gone: Sequence[DiskEntry] = ()) -> list[DiskEntry]:
        """Every file eviction deletes to fit ``incoming`` more bytes, in order.

        A block is followed by its sidecars (they go with it), each file listed
        once. ``gone`` are files treated as already deleted (``gc`` removes
        orphans first). The one plan behind eviction and ``gc``'s dry run.
        """
        with self._lock:
            skip = {id(e) for e in gone}
            used = self._bytes + incoming - sum(e.nbytes for e in gone)
            out: list[DiskEntry] = []
            for entry in self._eviction_order():
                if used <= self.budget_bytes:
                    break
                if self._pins.get(entry.block_id) or id(entry) in skip:
                    continue
                group = [entry]
                if entry.kind == "block":
                    group += [self._sidecars[(layout, entry.block_id)]
                              for layout in sorted(self._layouts_of.get(entry.block_id, ()))]
                for e in group:
                    if id(e) not in skip:
                        skip.add(id(e))
                        out.append(e)
                        used -= e.nbytes
            return out

    def _indexed(self, entry: DiskEntry) -> bool:
        if entry.kind == "block":
            return self._blocks.get(entry.block_id) is entry
        return self._sidecars.get((entry.layout, entry.block_id)) is entry

    def _eviction_order(self) -> list[DiskEntry]:
        orphans = self.orphans()
        entries = list(self._blocks.values()) + [
            e for (_, b), e in self._sidecars.items() if b in self._blocks]
        # Orphans first, then files of models or layouts nobody serves now, then LRU.
        return orphans + sorted(
            entries, key=lambda e: ((e.model, e.layout) in self.active, e.last_used))

    def enforce_budget(self) -> None:
        """Evict down to the budget (a restart with a smaller one may delete thousands of
        files): the lock is taken file by file, so lookups and writes go on meanwhile."""
        for entry in self.eviction_plan():
            with self._lock:
                if self._bytes <= self.budget_bytes:
                    return
                if self._indexed(entry) and not self._pins.get(entry.block_id):
                    self._evict(entry)

    def counters(self) -> SSDStats:
        """A copy of the counters."""
        with self._lock:
            return replace(self.stats)

    def usage(self) -> dict[str, Usage]:
        """Files, bytes and evictions by model identity[:16], from the running totals."""
        with self._lock:
            return {key: Usage(**u) for key, u in self._usage.items()}

    def snapshot(self) -> dict:
        """Counts and bytes from the running totals: cheap at any index size."""
        with self._lock:
            by_model = {key: dict(usage) for key, usage in self._usage.items()}
            return {
                "dir": str(self.root),
                "budget_bytes": self.budget_bytes,
                "block_bytes": sum(u["block_bytes"] for u in self._usage.values()),
                "sidecar_bytes": sum(u["sidecar_bytes"] for u in self._usage.values()),
                "blocks": len(self._blocks),
                "sidecars": len(self._sidecars),
                "orphans": self._orphans,
                "index_ready": self.ready.is_set(),
                "write_budget_per_hour": (None if self.write_budget is None
                                          else self.write_budget.limit_bytes),
                "written_last_hour": (None if self.write_budget is None
                                      else self.write_budget.used()),
                **self.stats.__dict__,
                "by_model": by_model,
            }

    # ---- safety --------------------------------------------------------------------------

    def _unlink(self, path: Path) -> bool:
        """Delete a file inside our directory, never through a symlink (a symlink itself
        is removed, not what it points to). True if deleted."""
        try:
            dfd = self._dir_of(Path(path))
        except OSError:  # outside the directory, gone, or below a symlink: not ours
            return False
        try:
            return _unlink_at(dfd, Path(path).name)
        finally:
            os.close(dfd)


