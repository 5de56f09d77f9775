"""Crash-safe writes: a file or a directory appears whole under its name, or not at all.

Every file the library writes (results, caches, bound arguments, artifacts) goes through
`write_atomic`: the data lands in a temporary file in the destination's directory (the
directory of the file a symbolic link points to), is flushed and fsynced, and is renamed
over the destination; the directory is fsynced so the rename survives a power cut. A
process killed at any point leaves the old file or the new one, never a truncated mix,
and a failed write removes its temporary file.
`replace_directory` does the same for a directory built next to its destination.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile

__all__ = [
    "fsync_directory", "remove_tree", "replace_directory", "temporary_directory_beside",
    "write_atomic",
]


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> pathlib.Path:
    """Replaces `path` with `data` (str is written as UTF-8) in one rename; returns it.

    A symbolic link is written through: the file it points to is replaced (its temporary
    file made beside it) and the link stays a link (a rename over the link replaced it
    with a regular file, and a cache file linked to a shared one stopped sharing it)."""
    given = pathlib.Path(path)
    path = pathlib.Path(os.path.realpath(given))
    payload = data.encode() if isinstance(data, str) else bytes(data)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file private (0600): give it the mode `open` would.
        os.fchmod(fd, _existing_mode(path, default=0o666 & ~_umask()))
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_directory(path.parent)
    return given


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Flushes a directory's entries (a rename in it) to disk where the system allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # a platform without directory handles (Windows): the rename stands alone
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def temporary_directory_beside(destination: pathlib.Path) -> pathlib.Path:
    """A fresh hidden directory next to `destination` (same file system: renames work),
    or inside it where `destination` is a directory in a folder this process may not
    write to (its files then move in one by one: `replace_directory` returns False)."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    try:
        built = pathlib.Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".tmp",
                                              dir=destination.parent))
    except PermissionError:
        if not destination.is_dir():
            raise
        return pathlib.Path(tempfile.mkdtemp(prefix=".tokamax_pass.", suffix=".tmp",
                                             dir=destination))
    # mkdtemp makes the directory private (0700): give it the mode `mkdir` would.
    os.chmod(built, _existing_mode(destination, default=0o777 & ~_umask()))
    return built


def replace_directory(built: pathlib.Path, destination: pathlib.Path) -> bool:
    """Renames the directory `built` (its files written by `write_atomic`) to
    `destination` when that is absent or an empty directory; returns whether it did.

    False leaves both in place where `destination` is a directory one rename cannot
    replace (it holds files, or it is the working directory): the caller moves the files.
    """
    fsync_directory(built)
    try:
        os.replace(built, destination)
    except OSError:
        if destination.is_dir():
            return False
        raise
    fsync_directory(destination.parent)
    return True


def _existing_mode(path: pathlib.Path, *, default: int) -> int:
    """The permission bits of `path` where it exists (a replaced file keeps its mode)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return default


def _umask() -> int:
    """This process's umask, read without changing it where the system shows it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def remove_tree(directory: pathlib.Path) -> None:
    """Removes a temporary directory left by a failed write, ignoring one already gone."""
    shutil.rmtree(directory, ignore_errors=True)
