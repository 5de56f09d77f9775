"""The cache stack that config resolution consults, and the on-disk caches.

Order, first hit wins: active `AutotuningResult`s (innermost first) -> the user
cache (`$TOKAMAX_PASS_CACHE_DIR` or `~/.cache/tokamax_pass/`, one
`<device_kind_key>.json` per device kind) -> the library cache shipped as package
data (`tokamax_pass/data/autotuning/<device_kind_key>/*.json`). Every file is an
`AutotuningResult` document. Entries whose provenance no longer matches (another
library or jax version, a changed implementation source) are reported once and
skipped; a corrupt file is reported and left in place, never overwritten.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
import math
import os
import pathlib
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import filelock

from tokamax_pass.autotuning import keys
from tokamax_pass.autotuning.result import AutotuningResult, Entry, active_results
from tokamax_pass.core import spec
from tokamax_pass.core.device import device_kind_key
from tokamax_pass.core.op import BoundArguments, snake_case_name

ENV_CACHE_DIR = "TOKAMAX_PASS_CACHE_DIR"
_log = logging.getLogger("tokamax_pass.autotuning")


class CacheError(RuntimeError):
    """A cache file cannot be read or safely written."""


def cache_dir(directory: str | os.PathLike | None = None) -> pathlib.Path:
    if directory is not None:
        return pathlib.Path(directory)
    env = os.environ.get(ENV_CACHE_DIR)
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "tokamax_pass"


def cache_file(device_kind: str | None, directory: str | os.PathLike | None = None) -> pathlib.Path:
    return cache_dir(directory) / f"{device_kind_key(device_kind)}.json"


_reported: set[Any] = set()


def _report_once(key: Any, message: str) -> None:
    if key not in _reported:
        _reported.add(key)
        _log.warning(message)
        warnings.warn(message, stacklevel=3)


def read(path: str | os.PathLike) -> AutotuningResult | None:
    """The result stored at `path`, `None` if there is no file; `spec.SpecError` if corrupt."""
    try:
        text = pathlib.Path(path).read_text()
    except FileNotFoundError:
        return None
    return AutotuningResult.loads(text, what=f"cache file {os.fspath(path)!r}")


def _write_atomic(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _with_provenance(result: AutotuningResult) -> AutotuningResult:
    entries = [
        e if e.provenance else Entry(e.bound, e.data, keys.provenance(e.bound.op))
        for e in result.without_errors().entries
    ]
    return AutotuningResult(result.device_kind, entries)


def save(result: AutotuningResult, directory: str | os.PathLike | None = None) -> str:
    """Merges `result` (failures dropped) into the user cache file of its device kind.

    Holds a file lock across read-merge-write and replaces the file atomically, so
    concurrent writers lose nothing. A corrupt existing file raises `CacheError`.
    """
    path = cache_file(result.device_kind, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock"):
        try:
            existing = read(path)
        except spec.SpecError as e:
            raise CacheError(
                f"{e}; the file was left in place: move it away or run "
                f"`tokamax-pass cache clear` before saving to this cache"
            ) from None
        new = _with_provenance(result)
        merged = new if existing is None else existing | new
        _write_atomic(path, merged.dumps())
    _USER.invalidate()
    return str(path)


def clear(directory: str | os.PathLike | None = None, device_kind: str | None = None) -> list[str]:
    """Deletes the user cache files (of one device kind, or all); returns their paths."""
    folder = cache_dir(directory)
    pattern = f"{device_kind_key(device_kind)}.json" if device_kind else "*.json"
    removed = []
    for path in sorted(folder.glob(pattern)):
        with filelock.FileLock(f"{path}.lock"):
            path.unlink()
        removed.append(str(path))
    _USER.invalidate()
    return removed


class _UserCache:
    """The parsed user cache files, re-read when a file changes on disk."""

    def __init__(self) -> None:
        self._parsed: dict[pathlib.Path, tuple[Any, AutotuningResult | None]] = {}

    def invalidate(self) -> None:
        self._parsed.clear()

    def result(self, device_kind: str | None) -> AutotuningResult | None:
        path = cache_file(device_kind)
        try:
            stat = path.stat()
        except OSError:
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        cached = self._parsed.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            result = read(path)
        except spec.SpecError as e:
            _report_once(("corrupt", path, stamp), f"ignoring the user autotuning cache: {e}")
            result = None
        self._parsed[path] = (stamp, result)
        return result


_USER = _UserCache()


def library_cache_dir(device_kind: str | None) -> Any:
    return importlib.resources.files("tokamax_pass") / "data" / "autotuning" / device_kind_key(
        device_kind)


@functools.cache
def library_result(device_kind: str | None) -> AutotuningResult | None:
    """Every shipped file for this device kind, merged; unreadable files are reported."""
    folder = library_cache_dir(device_kind)
    if not folder.is_dir():
        return None
    merged = None
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if not item.name.endswith(".json"):
            continue
        try:
            result = AutotuningResult.loads(item.read_text(), what=f"library cache {item.name}")
        except spec.SpecError as e:
            _report_once(("library", str(item)), f"ignoring a library cache file: {e}")
            continue
        merged = result if merged is None else merged | result
    return merged


def write_library_cache(result: AutotuningResult, directory: str | os.PathLike) -> list[str]:
    """Writes `result` as library-cache files, one per implementation class.

    `directory` is the `data/autotuning` folder (the package's, to ship a cache);
    files land in `<directory>/<device_kind_key>/<snake_case_class>.json`.
    """
    folder = pathlib.Path(directory) / device_kind_key(result.device_kind)
    by_class: dict[str, list[Entry]] = {}
    for entry in _with_provenance(result).entries:
        by_class.setdefault(snake_case_name(entry.bound.op), []).append(entry)
    written = []
    for name, entries in sorted(by_class.items()):
        path = folder / f"{name}.json"
        new = AutotuningResult(result.device_kind, entries)
        existing = read(path)
        _write_atomic(path, (new if existing is None else existing | new).dumps())
        written.append(str(path))
    library_result.cache_clear()
    return written


def _fresh(entry: Entry | None, label: str) -> Entry | None:
    if entry is None:
        return None
    reason = keys.stale_reason(entry.bound.op, entry.provenance)
    if reason is None:
        return entry
    _report_once(("stale", label, entry.key),
                 f"ignoring a stale {label} entry for {entry.bound!r}: {reason}")
    return None


Lookup = Callable[[BoundArguments], Entry | None]


def layers(device_kind: str | None, *, caches: bool = True) -> list[tuple[str, Lookup]]:
    """`(label, lookup)` for each source in resolution order."""
    found: list[tuple[str, Lookup]] = [
        ("autotuning result", r.entry) for r in active_results()
        if device_kind is None or r.device_kind in (None, device_kind)
    ]
    if caches:
        user = _USER.result(device_kind)
        if user is not None:
            found.append(("user cache", lambda ba: _fresh(user.entry(ba), "user cache")))
        library = library_result(device_kind)
        if library is not None:
            found.append(("library cache", lambda ba: _fresh(library.entry(ba), "library cache")))
    return found


class CacheStack:
    """The `ConfigSource` registered with `core.resolution`: results, user and library caches."""

    def find_config(self, ba: BoundArguments, device_kind: str | None) -> tuple[Any, str] | None:
        for label, lookup in layers(device_kind):
            entry = lookup(ba)
            fastest = None if entry is None else entry.fastest
            if fastest is not None:
                return fastest[0], label
        return None

    def rank(self, candidates: Sequence[BoundArguments],
             device_kind: str | None) -> list[int] | None:
        for _, lookup in layers(device_kind):
            times = []
            for ba in candidates:
                entry = lookup(ba)
                times.append(None if entry is None else entry.best_time_ms)
            # A candidate that failed every config (out of memory, say) ranks last; one
            # that was never measured leaves the order to the next layer.
            if all(t is not None for t in times) and min(times) < math.inf:
                return _rank_by_time(times)
        return None


# Timings this close to the fastest are a tie (H200 run-to-run noise is ~4%): ties keep the
# family's automatic order, which prefers kernels whose backward pass is fast too (a
# forward-only timing says nothing about the residuals a training step needs).
TIE_MARGIN = 0.05


def _rank_by_time(times: Sequence[float]) -> list[int]:
    """Candidate indices: those within `TIE_MARGIN` of the fastest in their given order,
    then the rest fastest first."""
    best = min(times)
    ties = [i for i, t in enumerate(times) if t <= best * (1 + TIE_MARGIN)]
    rest = sorted((i for i, t in enumerate(times) if t > best * (1 + TIE_MARGIN)),
                  key=lambda i: times[i])
    return ties + rest


SOURCE = CacheStack()
