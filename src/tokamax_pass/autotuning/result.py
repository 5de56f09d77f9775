"""`AutotuningResult`: measured configs per op call, usable as a context, serializable.

`with result:` pushes the result on a context stack that config resolution reads
(innermost first) and changes a `jax.make_user_context` value, which is part of
jit's cache key, so a function jitted outside the block retraces inside it.
"""

from __future__ import annotations

import contextvars
import dataclasses
import io
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import IO, Any, cast

import jax

from tokamax_pass.autotuning import keys
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import checks, device, spec
from tokamax_pass.core.atomic_io import write_atomic
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.caller_warnings import warn_at_caller
from tokamax_pass.tables import render_table

FORMAT = "tokamax_pass.AutotuningResult"


# The entries one result document may hold.
MAX_ENTRIES = 2**16


class BadEntryWarning(UserWarning):
    """An entry of a result or cache file was skipped; the message names it and why."""


_serials = itertools.count()
_ACTIVE: contextvars.ContextVar[tuple[AutotuningResult, ...]] = contextvars.ContextVar(
    "tokamax_pass_active_results", default=()
)
# Part of jit's cache key: entering or leaving a result retraces jitted functions.
_JIT_CONTEXT = jax.make_user_context(default_value=())


# `autotuning.cache.save`, registered when the cache module is imported (it reads
# results, so this module cannot import it back without an import circle).
_CACHE_WRITER: list[Callable[..., str]] = []


def register_cache_writer(save: Callable[..., str]) -> None:
    _CACHE_WRITER[:] = [save]


def active_results() -> tuple[AutotuningResult, ...]:
    """The results of the enclosing `with result:` blocks, innermost first."""
    return tuple(reversed(_ACTIVE.get()))


@dataclasses.dataclass(frozen=True, init=False, eq=False, repr=False)
class AutotuningResult:
    """The measured configs of a set of op calls on one device kind.

    Constructed as upstream Tokamax's: `AutotuningResult(device_kind, data,
    tokamax_version)`, where `data` holds `Entry`s or `(BoundArguments, {config:
    Measurement, BenchmarkData or exception})` pairs (what `result.data` gives, so
    `AutotuningResult(kind, r.data)` and `dataclasses.replace(r, data=...)` work).
    Iterating yields `(BoundArguments, {config: Measurement})`; `a | b` merges (right wins
    per config, and wholly where the two entries' provenance differs: `Entry.merged`);
    `with result:` applies its fastest configs.
    """

    device_kind: str | None
    data: tuple[Entry, ...]
    tokamax_version: str
    jax_version: str
    # `data` by entry key; this result's number on the jit context; its `with` blocks.
    _entries: dict[tuple[str, str], Entry] = dataclasses.field(init=False)
    _serial: int = dataclasses.field(init=False)
    _contexts: list[tuple[contextvars.Token, Any]] = dataclasses.field(init=False)

    def __init__(self, device_kind: str | None, data: Any = (),
                 tokamax_version: str | None = None, *, jax_version: str | None = None,
                 tokamax_pass_version: str | None = None):
        if device_kind is not None and not isinstance(device_kind, str):
            raise TypeError(f"AutotuningResult: device_kind must be a str (like 'NVIDIA "
                            f"H200') or None, got {device_kind!r}")
        _check_device_kind(device_kind, ValueError, "AutotuningResult: ")
        if tokamax_version is not None and tokamax_pass_version is not None:
            raise TypeError("AutotuningResult: give tokamax_version or its other name "
                            "tokamax_pass_version, not both")
        version = tokamax_version or tokamax_pass_version or keys.library_version()
        if not isinstance(data, Iterable) or isinstance(data, (str, bytes, Mapping)):
            raise TypeError(f"AutotuningResult: data must be a sequence of Entry or "
                            f"(BoundArguments, {{config: Measurement}}) pairs, got "
                            f"{type(data).__name__}; AutotuningResult.loads reads JSON")
        entries: dict[tuple[str, str], Entry] = {}
        for item in data:
            entry = _as_entry(item)
            key = entry.key
            entries[key] = entries[key].merged(entry) if key in entries else entry
        for name, value in (("device_kind", device_kind), ("data", tuple(entries.values())),
                            ("tokamax_version", version),
                            ("jax_version", jax_version or jax.__version__),
                            ("_entries", entries), ("_serial", next(_serials)),
                            ("_contexts", [])):
            object.__setattr__(self, name, value)

    # --- lookups ----------------------------------------------------------------------

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self.data

    @property
    def tokamax_pass_version(self) -> str:
        """The version of tokamax_pass that measured the result (`tokamax_version`)."""
        return self.tokamax_version

    def entry(self, ba: BoundArguments) -> Entry | None:
        _require_bound(".entry", ba)
        return self._entries.get(keys.entry_key(ba))

    def best_config(self, ba: BoundArguments) -> Any | None:
        _require_bound(".best_config", ba)
        entry = self.entry(ba)
        fastest = None if entry is None else entry.fastest
        return None if fastest is None else fastest[0]

    def __iter__(self) -> Iterator[tuple[BoundArguments, Mapping[Any, Measurement]]]:
        return (tuple(e) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ba: BoundArguments) -> bool:
        _require_bound(" (`x in result`)", ba, argument="x")
        return keys.entry_key(ba) in self._entries

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AutotuningResult) and self._to_json() == other._to_json()

    __hash__ = None  # type: ignore[assignment]  # equal by content, and mutable contexts

    def __or__(self, other: AutotuningResult) -> AutotuningResult:
        if not isinstance(other, AutotuningResult):
            return NotImplemented
        if self.device_kind != other.device_kind:
            raise ValueError(
                f"cannot merge results for different device kinds ({self.device_kind!r} | "
                f"{other.device_kind!r}): configs tuned on one device do not carry over"
            )
        return AutotuningResult(self.device_kind, [*self.entries, *other.entries])

    def without_errors(self) -> AutotuningResult:
        return AutotuningResult(self.device_kind, [e.without_errors() for e in self.entries])

    def with_provenance(self) -> AutotuningResult:
        """Failures dropped, and each entry that records no provenance stamped with this
        process's: what a cache file keeps (`save_to_cache`)."""
        return AutotuningResult(self.device_kind,
                                [e.with_provenance() for e in self.without_errors().entries])

    # --- context ----------------------------------------------------------------------

    def __enter__(self) -> AutotuningResult:
        stack = (*_ACTIVE.get(), self)
        token = _ACTIVE.set(stack)
        jit_context = _JIT_CONTEXT(tuple(r._serial for r in stack))
        jit_context.__enter__()
        self._contexts.append((token, jit_context))
        return self

    def __exit__(self, *exc: Any) -> None:
        token, jit_context = self._contexts.pop()
        jit_context.__exit__(*exc)
        _ACTIVE.reset(token)

    # --- serialization ----------------------------------------------------------------

    def _to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "schema_version": spec.SCHEMA_VERSION,
            "device_kind": self.device_kind,
            "tokamax_pass_version": self.tokamax_pass_version,
            "jax_version": self.jax_version,
            "entries": [e.to_json() for e in self._entries.values()],
        }

    def dumps(self, *, indent: int | None = 1, prune_errors: bool = False) -> str:
        """The result as JSON; `prune_errors=True` leaves out the configs that failed."""
        import json

        checks.require_int("AutotuningResult.dumps", "indent", indent, minimum=0,
                           allow_none=True)
        if not isinstance(prune_errors, bool):
            raise TypeError(f"AutotuningResult.dumps: prune_errors must be a bool, got "
                            f"{prune_errors!r}")
        result = self.without_errors() if prune_errors else self
        return json.dumps(result._to_json(), indent=indent, sort_keys=True)

    @classmethod
    def loads(cls, text: str | bytes = checks.NOT_GIVEN, *, what: str = "autotuning result",
              strict: bool = False, json_data: str | bytes = checks.NOT_GIVEN
              ) -> AutotuningResult:
        """The result in a JSON document written by `dumps`; `spec.SpecError` names what is
        wrong with one that is not (`TypeError` for an argument that is not text).

        An entry that cannot be read (malformed, a config out of its limits, an op that is
        not registered) is skipped with a `BadEntryWarning` naming it, so one bad entry
        never costs the rest; `strict=True` raises its `spec.SpecError` instead.
        `json_data=` is upstream Tokamax's name for `text`.
        """
        text = checks.one_of("AutotuningResult.loads", "text", text, "json_data", json_data)
        if not isinstance(text, (str, bytes, bytearray)):
            raise TypeError(f"AutotuningResult.loads: text must be a JSON str or bytes, got "
                            f"{type(text).__name__} (AutotuningResult.load reads a path or "
                            f"an open file)")
        return _parse(cls, text, what=what, strict=strict, skipped=[])

    def dump(self, path_or_file: str | os.PathLike | IO[str] | IO[bytes] = checks.NOT_GIVEN,
             *, prune_errors: bool = False,
             fp: str | os.PathLike | IO[str] | IO[bytes] = checks.NOT_GIVEN) -> None:
        """Writes `dumps(prune_errors=...)` to a path (in an existing directory) or an open
        text file (`fp=`: upstream Tokamax's name for `path_or_file`).

        A path is replaced atomically (`core.atomic_io.write_atomic`): a full disk or a
        killed process leaves the old file whole, never a truncated one.
        """
        path_or_file = checks.one_of("AutotuningResult.dump", "path_or_file", path_or_file,
                                     "fp", fp)
        if isinstance(path_or_file, (str, os.PathLike)):
            path = checks.file_to_write("AutotuningResult.dump", "path_or_file", path_or_file)
            write_atomic(path, self.dumps(prune_errors=prune_errors))
        elif callable(getattr(path_or_file, "write", None)):
            text = self.dumps(prune_errors=prune_errors)
            # A file opened in binary mode (`load` reads one) raised a bare "a bytes-like
            # object is required, not 'str'".
            if _is_binary(path_or_file):
                cast(IO[bytes], path_or_file).write(text.encode())
            else:
                cast(IO[str], path_or_file).write(text)
        else:
            raise TypeError(f"AutotuningResult.dump: path_or_file must be a path or a "
                            f"writable file, got {type(path_or_file).__name__}")

    @classmethod
    def load(cls, path_or_file: str | os.PathLike | IO[str] = checks.NOT_GIVEN, *,
             fp: str | os.PathLike | IO[str] = checks.NOT_GIVEN) -> AutotuningResult:
        """Reads a result from a path or an open file (`FileNotFoundError`,
        `IsADirectoryError` or `spec.SpecError` naming the path when it holds none; `fp=`:
        upstream Tokamax's name for `path_or_file`)."""
        path_or_file = checks.one_of("AutotuningResult.load", "path_or_file", path_or_file,
                                     "fp", fp)
        if isinstance(path_or_file, (str, os.PathLike)):
            path = checks.file_to_read("AutotuningResult.load", "path_or_file", path_or_file)
            what = f"autotuning result {os.fspath(path_or_file)!r}"
            return cls.loads(spec.read_file(path, what=what), what=what)
        if not callable(getattr(path_or_file, "read", None)):
            raise TypeError(f"AutotuningResult.load: path_or_file must be a path or a readable "
                            f"file, got {path_or_file!r}")
        return cls.loads(path_or_file.read())

    def dump_cache_str(self) -> str:
        """The text of a cache file holding this result (`with_provenance`), as upstream
        Tokamax's `dump_cache_str`: written to `<device kind>.json` in the cache directory,
        it is read like one `save_to_cache` wrote."""
        return self.with_provenance().dumps()

    def save_to_cache(self, directory: str | os.PathLike | None = None) -> str:
        """Merges this result into the user cache for its device kind; returns the file."""
        return _CACHE_WRITER[0](self, directory)

    # --- display ----------------------------------------------------------------------

    def __repr__(self) -> str:
        rows: list[tuple[str, ...]] = []
        for entry in self._entries.values():
            fastest = entry.fastest
            arrays = [v for v in entry.bound.arguments_spec().values() if isinstance(v, str)]
            rows.append((
                type(entry.bound.op).__name__,
                " ".join(arrays)[:48],
                "-" if fastest is None else _config_repr(fastest[0]),
                "-" if fastest is None else f"{fastest[1].median_ms:.4g}",
                f"{sum(m.ok for m in entry.data.values())}/{len(entry.data)}",
            ))
        table = render_table(("op", "arguments", "best config", "median ms", "ok/configs"),
                             rows, right_aligned=("median ms", "ok/configs"), indent=2)
        return f"AutotuningResult(device_kind={self.device_kind!r}, {len(self)} ops)\n{table}"


def loads_keeping_skipped(text: str | bytes, *, what: str
                          ) -> tuple[AutotuningResult, list[Any]]:
    """`AutotuningResult.loads(text)` and the entries (as JSON) it skipped: what a cache
    save keeps as written, so one program's save never drops the entries another program
    (its own ops) or another version (configs of other fields) can read."""
    skipped: list[Any] = []
    return _parse(AutotuningResult, text, what=what, strict=False, skipped=skipped), skipped


def _parse(cls: type[AutotuningResult], text: str | bytes | bytearray, *, what: str,
           strict: bool, skipped: list[Any]) -> AutotuningResult:
    """`AutotuningResult.loads` of a text; each entry it skips is appended to `skipped`."""
    data = spec.loads(decode_text(text, what=what), what=what)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise spec.SpecError(f"{what} is not a tokamax_pass AutotuningResult JSON document")
    spec.check_schema(data, what=what)
    device_kind = data.get("device_kind")
    if device_kind is not None and not isinstance(device_kind, str):
        raise spec.SpecError(f"{what}: 'device_kind' must be a string or null, got "
                             f"{device_kind!r}")
    _check_device_kind(device_kind, spec.SpecError, f"{what}: ")
    for name in ("tokamax_pass_version", "jax_version"):
        if not isinstance(data.get(name), (str, type(None))):
            raise spec.SpecError(f"{what}: {name!r} must be a string or null, got "
                                 f"{data[name]!r:.80}")
    if not isinstance(data.get("entries", []), list):
        raise spec.SpecError(f"{what}: 'entries' must be a list, got "
                             f"{type(data['entries']).__name__}")
    if len(data.get("entries", ())) > MAX_ENTRIES:
        raise spec.SpecError(f"{what} has {len(data['entries'])} entries, above the "
                             f"{MAX_ENTRIES} a result may hold")
    entries = []
    for i, item in enumerate(data.get("entries", ())):
        try:
            entries.append(_entry_from_json(item, i, what=what))
        except spec.SpecError as e:
            if strict:
                raise
            skipped.append(item)
            warn_at_caller(f"skipping an entry that cannot be read (the others load): {e}",
                           BadEntryWarning)
    return cls(
        device_kind, entries,
        tokamax_version=data.get("tokamax_pass_version"),
        jax_version=data.get("jax_version"),
    )


def _as_entry(item: Any) -> Entry:
    """An `Entry`, or one made of a `(BoundArguments, {config: measurement})` pair (no
    provenance: `save_to_cache` stamps this process's)."""
    if isinstance(item, Entry):
        return item
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], BoundArguments)
            and isinstance(item[1], Mapping)):
        raise TypeError(f"AutotuningResult: data must hold Entry objects or (BoundArguments, "
                        f"{{config: Measurement}}) pairs, got {item!r:.80}")
    bound, measured = item
    return Entry(keys.canonical(bound), {c: _as_measurement(m) for c, m in measured.items()},
                 {})


def _as_measurement(value: Any) -> Measurement:
    """A `Measurement`, or one made of upstream Tokamax's autotuning values: a
    `BenchmarkData`, or the exception a config failed with."""
    if isinstance(value, Measurement):
        return value
    if isinstance(value, BaseException):
        return Measurement(error=f"{type(value).__name__}: {value}")
    times = getattr(value, "evaluation_times_ms", None)
    if times is None:
        raise TypeError(f"AutotuningResult: a config's measurement must be a Measurement, a "
                        f"BenchmarkData or an exception, got {type(value).__name__}")
    return Measurement(tuple(float(t) for t in times), value.lower_time_ms,
                       value.compile_time_ms, value.peak_memory_mb)


def _require_bound(where: str, ba: Any, *, argument: str = "ba") -> None:
    """`TypeError`, naming the lookup, for a key that is not an op call: `entry_key`
    read `.op` off it and raised a bare `AttributeError` ("'int' object has no attribute
    'op'")."""
    if not isinstance(ba, BoundArguments):
        raise TypeError(
            f"AutotuningResult{where}: {argument} must be a BoundArguments (an op call, "
            f"as tokamax_pass.autotuning.get_bound_args(f, *args) lists them or "
            f"Op.bind(...) makes one), got {type(ba).__name__}")


def _check_device_kind(device_kind: str | None, error: type[Exception], where: str) -> None:
    """`error` for a device kind that misspells a shipped one (`"H200"`: no device reports
    it): the result applied on no device and was saved to a cache file never read, so its
    configs were lost, silently."""
    if device_kind is None:
        return
    try:
        device.check_device_kind(device_kind)
    except ValueError as e:
        raise error(f"{where}{e}") from None


def _is_binary(file: Any) -> bool:
    """Whether an open file takes bytes: a binary stream, or a file opened with a "b" mode."""
    return not isinstance(file, io.TextIOBase) and (
        isinstance(file, (io.RawIOBase, io.BufferedIOBase))
        or "b" in str(getattr(file, "mode", "")))


def decode_text(text: str | bytes | bytearray, *, what: str) -> str:
    """`text` as a str: bytes decoded as UTF-8, with a `spec.SpecError` naming `what` for
    bytes that are not (`json.loads` raised a bare `UnicodeDecodeError`)."""
    if isinstance(text, str):
        return text
    try:
        return bytes(text).decode("utf-8")
    except UnicodeDecodeError as e:
        raise spec.SpecError(f"{what} is not JSON text (not UTF-8: {e.reason})") from None


def _entry_from_json(item: Any, index: int, *, what: str) -> Entry:
    """`Entry.from_json`, its errors a `spec.SpecError` naming the entry (index and op)."""
    op = item.get("op") if isinstance(item, Mapping) else None
    name = op.get("dataclass") if isinstance(op, Mapping) else None
    of_op = f" (an entry of op {str(name)[:200]})" if name else ""
    try:
        return Entry.from_json(item)
    except spec.SpecError as e:
        raise spec.SpecError(f"{what}: entry {index}: {e}{of_op}") from None
    except (KeyError, TypeError, AttributeError, ValueError, ArithmeticError) as e:
        raise spec.SpecError(f"{what} has a malformed entry ({index}): {e!r}{of_op}") from None


def _config_repr(config: Any) -> str:
    fields = spec.encode_config(config) or {}
    return ",".join(f"{k}={v}" for k, v in fields.items()) or "{}"


def find_in_active(ba: BoundArguments, device_kind: str | None) -> Any | None:
    """The fastest config for `ba` from the innermost active result that measured it."""
    for result in active_results():
        if device_kind is not None and result.device_kind not in (None, device_kind):
            continue
        config = result.best_config(ba)
        if config is not None:
            return config
    return None
