"""The SSD tier's file-system layer: directories only this user may change, files opened
relative to their directory's descriptor with ``O_NOFOLLOW`` (a symlink planted anywhere
below the cache directory is never followed), the directory lock, the walk that finds
every file, the budget a disk affords.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

TMP_MARK = ".tmp-"  # in the name of a file being written (a crash leaves it)
FORMAT_VERSION = "1"  # the layout's version: its files live under v<FORMAT_VERSION>/

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC


def untrusted_reason(root: Path) -> str | None:
    """Why the cache directory ``root`` cannot be trusted, or None.

    It must be owned by this process's user and not writable by group or others
    (else another local user can plant or swap files in it). A missing directory is
    fine: it is created 0700. The directory itself may be a symlink an operator made
    (its target is checked); nothing below it is ever followed.
    """
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot inspect it: {exc}"
    return _untrusted_stat(st)


def _untrusted_stat(st: os.stat_result) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return (f"it is owned by uid {st.st_uid}, not by this server's user "
                f"(uid {os.geteuid()})")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002))
                           if st.st_mode & bit)
        return (f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}; "
                "chmod go-w it or use another directory)")
    return None


def open_dir(root: Path, parts: Sequence[str] = (), create: bool = False) -> int:
    """A descriptor of ``root/parts...``: the root is checked (``untrusted_reason``)
    on the open descriptor, then each component is opened relative to the one
    before with ``O_NOFOLLOW`` (a symlink fails with ``OSError``), and created 0700
    when missing if ``create``. The caller closes it."""
    if create and not os.path.lexists(root):
        make_dirs(Path(root))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        reason = _untrusted_stat(os.fstat(fd))
        if reason is not None:
            raise PermissionError(errno.EPERM, f"untrusted cache directory: {reason}", str(root))
        for name in parts:
            if name in ("", ".", "..") or "/" in name:
                raise OSError(errno.EINVAL, "bad path component", name)
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = sub
            _check_owned(fd, name, directory=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_owned(fd: int, name: str, directory: bool) -> None:
    """Refuse (``PermissionError``) a directory or file below the cache directory that is
    not this user's, or a directory group or others may write to (one made before the
    cache directory was locked down, say)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or (directory and st.st_mode & 0o022):
        raise PermissionError(errno.EPERM, "not this server's user's, or writable by others",
                              name)


def _locate(path: Path) -> tuple[Path, list[str], str]:
    """(cache directory, directories below it, file name) of a path in the tier: the
    cache directory is the parent of the last ``v<FORMAT_VERSION>`` component."""
    parts = Path(path).parts
    marker = f"v{FORMAT_VERSION}"
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == marker:
            return Path(*parts[:i]), list(parts[i:-1]), parts[-1]
    return Path(path).parent, [], Path(path).name


@contextlib.contextmanager
def _parent_fd(path: Path, create: bool = False) -> Iterator[tuple[int, str]]:
    """The descriptor of a tier path's directory (``open_dir``) and the file's name."""
    root, dirs, name = _locate(path)
    fd = open_dir(root, dirs, create)
    try:
        yield fd, name
    finally:
        os.close(fd)


def _open_file(path: Path, flags: int = os.O_RDONLY) -> int:
    """A file of the tier opened without following a symlink anywhere below the root."""
    with _parent_fd(path) as (dfd, name):
        fd = os.open(name, flags | os.O_NOFOLLOW | _CLOEXEC, dir_fd=dfd)
    try:
        _check_owned(fd, name, directory=False)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs(path: Path) -> None:
    """Create ``path`` and missing parents 0700 (existing directories are left as they are)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass


def _unlink_at(dfd: int, name: str) -> bool:
    """Unlink ``name`` (not a directory) in directory ``dfd``; False if it was not there."""
    try:
        os.unlink(name, dir_fd=dfd)
        return True
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        return False
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EISDIR, errno.EPERM):
            return False
        raise


def auto_budget(root: Path, cap_bytes: int = 64 << 30, fraction: float = 0.5) -> int:
    """``auto``: the smaller of a cap and a fraction of the disk space we could use."""
    make_dirs(root)
    free = shutil.disk_usage(root).free
    used = sum(p.stat().st_size for p in root.rglob("*.safetensors") if not p.is_symlink())
    return int(min(cap_bytes, fraction * (free + used)))


def lock_dir(root: Path, base_name: str) -> int | None:
    """Take the lock of ``root/base_name`` (a serving process holds it; ``gc`` checks
    it): its descriptor, or None where another holds it. ``flock`` belongs to an open
    file description, so a second store in the same process is refused too."""
    make_dirs(root)
    dfd = open_dir(root, [base_name], create=True)
    try:
        fd = os.open("LOCK", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | _CLOEXEC, 0o600,
                     dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def lock_holder(base: Path) -> str:
    """The pid written in ``base/LOCK`` by the process holding it ("?" if unreadable)."""
    try:
        with os.fdopen(_open_file(base / "LOCK"), "rb") as f:
            return f.read(32).decode("ascii", "replace").strip() or "?"
    except OSError:
        return "?"


def dir_in_use(base: Path) -> bool:
    """True if another process holds ``base/LOCK``."""
    try:
        fd = _open_file(base / "LOCK")
    except OSError:  # none (or a symlink): no server holds it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def walk_files(root: Path, base_name: str) -> list[Path]:
    """Every block, sidecar and temporary file under ``root/base_name``, walked by
    directory descriptors: a symlink anywhere below the cache directory is skipped,
    never followed."""
    found: list[Path] = []
    for top in ("blocks", "sidecars"):
        try:
            stack = [(open_dir(root, [base_name, top]), [base_name, top])]
        except OSError:  # none yet (or a symlink: not ours)
            continue
        while stack:
            fd, parts = stack.pop()
            try:
                with os.scandir(fd) as it:
                    entries = list(it)
                for d in entries:
                    if d.is_symlink():
                        continue
                    if d.is_dir(follow_symlinks=False):
                        try:
                            sub = os.open(d.name, _DIR_FLAGS, dir_fd=fd)
                        except OSError:
                            continue
                        try:
                            _check_owned(sub, d.name, directory=True)
                        except OSError:  # another user's, or open to others: skipped
                            os.close(sub)
                            continue
                        stack.append((sub, [*parts, d.name]))
                    elif d.is_file(follow_symlinks=False) and (
                        d.name.endswith(".safetensors") or TMP_MARK in d.name
                    ):
                        found.append(root.joinpath(*parts, d.name))
            finally:
                os.close(fd)
    return found
