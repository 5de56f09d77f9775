"""The cache stack that config resolution consults, and the on-disk caches.

Order, first hit wins: active `AutotuningResult`s (innermost first) -> the user
cache (`$TOKAMAX_PASS_CACHE_DIR`, else the platform's user cache directory, one
`<device_kind_key>.json` per device kind) -> the library cache shipped as package
data (`tokamax_pass/data/autotuning/<device_kind_key>/*.json`). Every file is an
`AutotuningResult` document. Entries whose provenance does not match (another
library or jax version, a changed implementation source) are reported once and
skipped; a corrupt file is reported and left in place, never overwritten.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import os
import pathlib
import stat
from collections.abc import Callable, Sequence
from typing import Any

import filelock
import platformdirs

from tokamax_pass.autotuning import keys, neighbours
from tokamax_pass.autotuning import result as results
from tokamax_pass.autotuning.entry import Entry
from tokamax_pass.autotuning.result import (
    AutotuningResult,
    active_results,
    loads_keeping_skipped,
    register_cache_writer,
)
from tokamax_pass.core import checks, selection, spec
from tokamax_pass.core.atomic_io import write_atomic
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.caller_warnings import warn_at_caller
from tokamax_pass.core.device import check_device_kind, device_kind_key
from tokamax_pass.core.op import snake_case_name

ENV_CACHE_DIR = "TOKAMAX_PASS_CACHE_DIR"


class CacheError(RuntimeError):
    """A cache file cannot be read or safely written."""


class UnsavedResultError(CacheError):
    """`autotune(..., cache=True)` measured a result but could not save it to the cache.

    The result is not lost: `result` holds it, and `fallback_path` names the file it was
    written to instead (`None` where that failed too).
    """

    def __init__(self, message: str, result: AutotuningResult,
                 fallback_path: str | None) -> None:
        super().__init__(message)
        self.result = result
        self.fallback_path = fallback_path


def cache_dir(directory: str | os.PathLike | None = None) -> pathlib.Path:
    """The user cache's directory: `directory` if given, else `$TOKAMAX_PASS_CACHE_DIR`,
    else the platform's user cache directory (`~/.cache/tokamax_pass` on Linux, or under
    `$XDG_CACHE_HOME`; `~/Library/Caches/tokamax_pass` on macOS)."""
    if directory is not None:
        return checks.as_path("user cache", "directory", directory)
    env = os.environ.get(ENV_CACHE_DIR)
    return pathlib.Path(env) if env else pathlib.Path(platformdirs.user_cache_dir("tokamax_pass"))


def cache_file(device_kind: str | None, directory: str | os.PathLike | None = None) -> pathlib.Path:
    return cache_dir(directory) / f"{device_kind_key(device_kind)}.json"


_reported: set[Any] = set()


def _report_once(key: Any, message: str) -> None:
    """Warns `message` once per `key`: a warning, not also a log record, which logging
    left unconfigured prints to stderr as well (its last-resort handler)."""
    if key not in _reported:
        _reported.add(key)
        warn_at_caller(message)


def read(path: str | os.PathLike, *, kind_key: str | None = None) -> AutotuningResult | None:
    """The result stored at `path`, `None` if there is no file; `spec.SpecError` if corrupt
    (not JSON, not UTF-8, not a result, a directory or a pipe where the file should be,
    or a file that cannot be read: a link that loops, no permission), or where
    `kind_key` is given and the file's device kind does not map to it
    (`device_kind_key`): a file of another device's configs under this one's name."""
    found = _read_keeping_skipped(path, kind_key=kind_key)
    return None if found is None else found[0]


def _read_keeping_skipped(path: str | os.PathLike, *, kind_key: str | None
                          ) -> tuple[AutotuningResult, list[Any]] | None:
    """`read`, and the entries (as JSON) it skipped (`result.loads_keeping_skipped`)."""
    what = f"cache file {os.fspath(path)!r}"
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise spec.SpecError(f"{what} is a directory, not a file")
        if not stat.S_ISREG(mode):
            # A pipe's read waits for a writer: every op call would hang reading it.
            raise spec.SpecError(f"{what} is not a regular file (a pipe or a device)")
        text = spec.read_file(path, what=what)
    except FileNotFoundError:
        return None
    except OSError as e:  # a link that loops, a file this user may not read
        raise spec.SpecError(f"{what} cannot be read: {e.strerror}") from None
    result, skipped = loads_keeping_skipped(text, what=what)
    if kind_key is not None and device_kind_key(result.device_kind) != kind_key:
        raise spec.SpecError(
            f"{what} records device kind {result.device_kind!r}, whose configs belong in "
            f"{device_kind_key(result.device_kind)}.json, not in {pathlib.Path(path).name}")
    return result, skipped


def _merged(existing: AutotuningResult | None, new: AutotuningResult) -> AutotuningResult:
    """`existing | new` for a file `read` with its `kind_key`: one device kind, maybe
    spelled otherwise in the file (`"CPU"`, `"cpu"`); `new`'s spelling is kept."""
    if existing is None:
        return new
    return AutotuningResult(new.device_kind, existing.entries) | new


def _merged_text(path: pathlib.Path, new: AutotuningResult, *, kind_key: str) -> str:
    """The text of the file at `path` merged with `new` (`_merged`). The entries of the file
    this process cannot read (ops registered, or called, only in the programs that tuned
    them; configs of another version's fields) are kept as they are: one program's save
    never drops another's measurements. `spec.SpecError` for a corrupt file; `CacheError`
    where the merged file would hold more entries than a result may (`MAX_ENTRIES`): the
    file written would be one no reader loads, and every later save would fail on it."""
    found = _read_keeping_skipped(path, kind_key=kind_key)
    existing, skipped = (None, []) if found is None else found
    merged = _merged(existing, new)
    if len(merged) + len(skipped) > results.MAX_ENTRIES:
        raise CacheError(
            f"{path} would hold {len(merged) + len(skipped)} entries, above the "
            f"{results.MAX_ENTRIES} a cache file may hold; it was left as it is: clear it "
            f"(`tokamax-pass cache clear`) or save to another directory")
    text = merged.dumps()
    if not skipped:
        return text
    document = json.loads(text)
    document["entries"] = [*skipped, *document["entries"]]
    return json.dumps(document, indent=1, sort_keys=True)


def _write_lock(path: pathlib.Path) -> filelock.FileLock:
    """The lock a read-merge-write of `path` holds: beside the file `path` resolves to, so
    two cache paths linked to one shared file take one lock (locking each name apart,
    concurrent saves through them would lose entries)."""
    return filelock.FileLock(f"{os.path.realpath(path)}.lock")


def save(result: AutotuningResult, directory: str | os.PathLike | None = None) -> str:
    """Merges `result` (failures dropped) into the user cache file of its device kind.

    Holds a file lock across read-merge-write and replaces the file atomically, so
    concurrent writers lose nothing; entries this process cannot read are kept as they
    are (`_merged_text`). A corrupt existing file raises `CacheError`.
    """
    if not isinstance(result, AutotuningResult):
        raise TypeError(f"save_to_cache: result must be an AutotuningResult, got "
                        f"{type(result).__name__}")
    path = cache_file(result.device_kind, directory)
    checks.directory_to_write("save_to_cache", "the cache directory (directory= or $"
                              f"{ENV_CACHE_DIR})", path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _write_lock(path):
        try:
            text = _merged_text(path, result.with_provenance(), kind_key=path.stem)
        except spec.SpecError as e:
            raise CacheError(
                f"{e}; the file was left in place: move it away or run "
                f"`tokamax-pass cache clear` before saving to this cache"
            ) from None
        write_atomic(path, text)
    _USER.invalidate()
    return str(path)


def clear(directory: str | os.PathLike | None = None, device_kind: str | None = None) -> list[str]:
    """Deletes the user cache files (of one device kind, or all); returns their paths.
    `ValueError` where `device_kind` has no file and misspells a shipped device kind
    (`"H200"`: `device.check_device_kind`), which removed nothing, silently."""
    _require_device_kind("clear", device_kind)
    folder = cache_dir(directory)
    pattern = f"{device_kind_key(device_kind)}.json" if device_kind else "*.json"
    removed = []
    for path in sorted(folder.glob(pattern)):
        with _write_lock(path):
            path.unlink()
        removed.append(str(path))
    _USER.invalidate()
    if device_kind and not removed:
        check_device_kind(device_kind, typed=True)
    return removed


def _require_device_kind(who: str, device_kind: Any) -> None:
    """A device kind is a non-empty str or `None` (every kind): `""` cleared every
    device kind's file, and an int failed as "'int' object has no attribute 'lower'"."""
    if device_kind is not None and not isinstance(device_kind, str):
        raise TypeError(f"{who}: device_kind must be a str (like 'NVIDIA H200') or None "
                        f"for every device kind, got {type(device_kind).__name__}")
    if device_kind is not None and not device_kind.strip():
        raise ValueError(f"{who}: device_kind must name a device kind (like 'NVIDIA H200'),"
                         f" got {device_kind!r}; pass None for every device kind")


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
        except NotADirectoryError:
            _report_once(("not a directory", path.parent),
                         f"ignoring the user autotuning cache: {path.parent} (${ENV_CACHE_DIR}"
                         f" or the platform's user cache directory) is a file, not a directory")
            return None
        except OSError:
            return None
        # Read again once this process lowers an op class for the first time: the file
        # may hold entries of it that could not be read before (`spec.remember_lowered`).
        stamp = (stat.st_mtime_ns, stat.st_size, spec.lowered_classes())
        cached = self._parsed.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            result = read(path, kind_key=path.stem)
        except (spec.SpecError, OSError) as e:
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
            # Bytes: their decoding fails as a `SpecError` (`read_text` raised a bare
            # `UnicodeDecodeError`, which nothing here caught).
            result = AutotuningResult.loads(item.read_bytes(), what=f"library cache {item.name}")
            if device_kind_key(result.device_kind) != device_kind_key(device_kind):
                raise spec.SpecError(f"library cache {item.name} records device kind "
                                     f"{result.device_kind!r}, not {device_kind!r}")
        except spec.SpecError as e:
            _report_once(("library", str(item)), f"ignoring a library cache file: {e}")
            continue
        merged = _merged(merged, result)
    return merged


def write_library_cache(result: AutotuningResult, directory: str | os.PathLike) -> list[str]:
    """Writes `result` as library-cache files, one per implementation class.

    `directory` is the `data/autotuning` folder (the package's, to ship a cache);
    files land in `<directory>/<device_kind_key>/<snake_case_class>.json`. Each file is
    merged under a file lock and replaced atomically, so concurrent writers lose nothing.
    """
    if not isinstance(result, AutotuningResult):
        raise TypeError(f"write_library_cache: result must be an AutotuningResult, got "
                        f"{type(result).__name__}")
    folder = checks.directory_to_write("write_library_cache", "directory", directory)
    folder = folder / device_kind_key(result.device_kind)
    by_class: dict[str, list[Entry]] = {}
    for entry in result.with_provenance().entries:
        by_class.setdefault(snake_case_name(entry.bound.op), []).append(entry)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, entries in sorted(by_class.items()):
        path = folder / f"{name}.json"
        new = AutotuningResult(result.device_kind, entries)
        # Locked across read-merge-write, like the user cache: concurrent tuning runs
        # that write one file each keep every entry.
        with _write_lock(path):
            write_atomic(path, _merged_text(path, new, kind_key=folder.name))
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


@dataclasses.dataclass(frozen=True)
class Layer:
    """One source of measurements in resolution order: its label, its result, and a
    lookup that ignores (and reports) stale entries."""

    label: str
    result: AutotuningResult
    lookup: Lookup


def layers(device_kind: str | None, *, caches: bool = True) -> list[Layer]:
    """Each source of measurements, in resolution order."""
    found = [Layer("autotuning result", r, r.entry) for r in active_results()
             if device_kind is None or r.device_kind in (None, device_kind)]
    if caches:
        for label, result in (("user cache", _USER.result(device_kind)),
                              ("library cache", library_result(device_kind))):
            if result is not None:
                found.append(Layer(label, result, functools.partial(_fresh_entry, result, label)))
    return found


def _fresh_entry(result: AutotuningResult, label: str, ba: BoundArguments) -> Entry | None:
    return _fresh(result.entry(ba), label)


class CacheStack:
    """The `ConfigSource` registered with `core.selection`: results, user and library caches."""

    def find_config(self, ba: BoundArguments, device_kind: str | None) -> tuple[Any, str] | None:
        found = _answering_entry(ba, device_kind)
        fastest = None if found is None else found[0].fastest
        return None if found is None or fastest is None else (fastest[0], found[1])

    def rank(self, candidates: Sequence[BoundArguments], device_kind: str | None,
             usable: Sequence[bool] | None = None) -> list[int] | None:
        stack = layers(device_kind)
        return selection.rank_measured(
            candidates,
            lambda calls: _exact_times(_evidence_slots(calls), stack),
            lambda calls: _summed([neighbours.nearest_times(slot, stack)
                                   for slot in _evidence_slots(calls)]),
            usable)


def measured_losers(ba: BoundArguments, best: Any, device_kind: str | None) -> frozenset:
    """The configs the entry `find_config` answers `ba` from measured, where `best` is
    that entry's fastest: each was timed at `ba`'s own shape and ran slower (failures
    are not counted: an out-of-memory or a timeout may not recur). Empty where no entry
    answers `ba` with `best`."""
    found = _answering_entry(ba, device_kind)
    fastest = None if found is None else found[0].fastest
    if found is None or fastest is None or fastest[0] != best:
        return frozenset()
    return frozenset(c for c, m in found[0].data.items() if m.ok and c != best)


def _answering_entry(ba: BoundArguments, device_kind: str | None) -> tuple[Entry, str] | None:
    """The first entry of the stack with a config of `ba` that ran, and its layer's label."""
    for layer in layers(device_kind):
        entry = layer.lookup(ba)
        if entry is not None and entry.fastest is not None:
            return entry, layer.label
    return None


def evidence_times(candidates: Sequence[BoundArguments],
                   device_kind: str | None) -> list[float | None]:
    """Each candidate's time as `CacheStack.rank` sees it first: at the call's own shape
    where every candidate was measured there, else at the nearest measured neighbour
    (`neighbours.nearest_times`; all `None` where none is near)."""
    stack = layers(device_kind)
    slots = _evidence_slots(candidates)
    exact = _exact_times(slots, stack)
    if all(t is not None for t in exact):
        return exact
    return _summed([neighbours.nearest_times(slot, stack) for slot in slots])


def _exact_times(slots: Sequence[Sequence[BoundArguments]],
                 stack: Sequence[Layer]) -> list[float | None]:
    return _summed([[_first_time(ba, stack) for ba in slot] for slot in slots])


def _evidence_slots(candidates: Sequence[BoundArguments]) -> list[list[BoundArguments]]:
    """The calls measured for each candidate, slot by slot: `[candidates]` for ops measured
    as themselves; for ops made of nested calls (`Op.evidence_calls`), one slot per nested
    call (the ragged-dot VJP: its dlhs calls, then its drhs calls)."""
    expanded = [ba.op.evidence_calls(ba) or [ba] for ba in candidates]
    if len({len(calls) for calls in expanded}) != 1:
        return [list(candidates)]
    return [list(slot) for slot in zip(*expanded, strict=True)]


def _summed(times_by_slot: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Each candidate's time over all slots; `None` where a slot was not measured."""
    totals: list[float | None] = []
    for times in zip(*times_by_slot, strict=True):
        totals.append(None if any(t is None for t in times) else sum(times))
    return totals


def _first_time(ba: BoundArguments, stack: Sequence[Layer]) -> float | None:
    for layer in stack:
        entry = layer.lookup(ba)
        if entry is not None:
            return entry.best_time_ms
    return None


SOURCE = CacheStack()
register_cache_writer(save)
