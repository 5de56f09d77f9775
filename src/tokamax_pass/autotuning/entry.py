"""What autotuning measures per op call: a config's `Measurement`, an `Entry` (one op
call's measurements per config, with the provenance of the code that made them) and
`AutotuningData` (upstream Tokamax's read-only view of one call's measurements).

Entries are what result and cache files hold (`autotuning.result`); reading one checks
every field and fails with a `spec.SpecError` naming it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterator, Mapping
from typing import Any, cast

from tokamax_pass.autotuning import keys
from tokamax_pass.core import spec
from tokamax_pass.core.bound_arguments import BoundArguments


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One config's outcome: its timings, or why it could not be timed."""

    evaluation_times_ms: tuple[float, ...] = ()
    lower_time_ms: float | None = None
    compile_time_ms: float | None = None
    peak_memory_mb: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.evaluation_times_ms)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.evaluation_times_ms) if self.ok else math.inf

    def to_json(self) -> dict[str, Any]:
        return {
            "evaluation_times_ms": list(self.evaluation_times_ms),
            "lower_time_ms": self.lower_time_ms,
            "compile_time_ms": self.compile_time_ms,
            "peak_memory_mb": self.peak_memory_mb,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Measurement:
        times = data.get("evaluation_times_ms", [])
        # A string was read digit by digit ("12": times 1 and 2), and a NaN or negative
        # time was taken for the fastest config, silently.
        amounts = [_amount(t) for t in times] if isinstance(times, list) else [None]
        if any(a is None for a in amounts):
            raise spec.SpecError(f"'evaluation_times_ms' must be a list of numbers, got "
                                 f"{times!r:.80} (times in ms, each >= 0 and finite)")
        error = data.get("error")
        if error is not None and not isinstance(error, str):
            raise spec.SpecError(f"'error' must be a string or null, got {error!r:.80}")
        return cls(
            evaluation_times_ms=tuple(cast(list[float], amounts)),
            lower_time_ms=_optional_amount(data, "lower_time_ms"),
            compile_time_ms=_optional_amount(data, "compile_time_ms"),
            peak_memory_mb=_optional_amount(data, "peak_memory_mb"),
            error=error,
        )


def _optional_amount(data: Mapping[str, Any], name: str) -> float | None:
    """`data[name]`: a finite number >= 0 or null (a string or a list there was kept and
    failed where it was summed or formatted)."""
    value = data.get(name)
    if value is None:
        return None
    amount = _amount(value)
    if amount is None:
        raise spec.SpecError(f"{name!r} must be a number >= 0 or null, got {value!r:.80} "
                             f"(a finite one)")
    return amount


def _amount(value: Any) -> float | None:
    """`value` as a float where it is a finite number >= 0, else `None` (an integer too
    large for a float raised a bare `OverflowError` that nothing caught, and an infinite
    time sorted its config last or first, silently)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        amount = float(value)
    except OverflowError:
        return None
    return amount if math.isfinite(amount) and amount >= 0 else None


class AutotuningData(Mapping[Any, Measurement]):
    """One op call's `{config: Measurement}`, read-only, as upstream Tokamax's
    `AutotuningData`: `fastest_config`, `prune_errors()`. Equal to a dict of the same
    items."""

    def __init__(self, measurements: Mapping[Any, Measurement]):
        self._measurements = dict(measurements)

    def __getitem__(self, config: Any) -> Measurement:
        return self._measurements[config]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._measurements)

    def __len__(self) -> int:
        return len(self._measurements)

    def __repr__(self) -> str:
        return f"AutotuningData({self._measurements!r})"

    @property
    def fastest_config(self) -> Any:
        """The config with the lowest median time; `ValueError` when none ran (naming why
        each failed) or there is none."""
        ok = [(c, m) for c, m in self._measurements.items() if m.ok]
        if ok:
            return min(ok, key=lambda cm: cm[1].median_ms)[0]
        if not self._measurements:
            raise ValueError("autotuning data is empty: no config was measured")
        errors = "; ".join(f"{c}: {m.error}" for c, m in self._measurements.items())
        raise ValueError(f"every config failed: {errors[:2000]}")

    def prune_errors(self) -> dict[Any, Measurement]:
        """The configs that ran."""
        return {c: m for c, m in self._measurements.items() if m.ok}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One op call (config stripped) with a measurement per config and its provenance."""

    bound: BoundArguments
    data: Mapping[Any, Measurement]
    provenance: Mapping[str, Any]

    @property
    def key(self) -> tuple[str, str]:
        return keys.entry_key(self.bound)

    @property
    def fastest(self) -> tuple[Any, Measurement] | None:
        """`(config, measurement)` with the lowest median, or `None` when all failed."""
        ok = [(c, m) for c, m in self.data.items() if m.ok]
        return min(ok, key=lambda cm: cm[1].median_ms) if ok else None

    @property
    def best_time_ms(self) -> float:
        fastest = self.fastest
        return math.inf if fastest is None else fastest[1].median_ms

    def merged(self, other: Entry) -> Entry:
        """`other`'s measurements over this one's, config by config; wholly `other`'s
        when both record a provenance and they differ: measurements of other code (or
        another jax) are not stamped with `other`'s provenance (a retuned entry would keep
        configs its search does not hold, timed on other code, as fresh)."""
        if self.provenance and other.provenance and self.provenance != other.provenance:
            return other
        return Entry(other.bound, {**self.data, **other.data}, other.provenance)

    def without_errors(self) -> Entry:
        return Entry(self.bound, {c: m for c, m in self.data.items() if m.ok}, self.provenance)

    def with_provenance(self) -> Entry:
        """This entry, stamped with this process's provenance if it records none."""
        return self if self.provenance else Entry(self.bound, self.data,
                                                  keys.provenance(self.bound.op))

    # An entry is also the pair `(bound, data)`, as upstream Tokamax's
    # `AutotuningResult.data` holds them: `for ba, data in result.data` unpacks it.
    def __iter__(self) -> Iterator[Any]:
        return iter((self.bound, AutotuningData(self.data)))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> Any:
        return tuple(self)[index]

    def to_json(self) -> dict[str, Any]:
        return {
            **self.bound.to_spec(),
            "provenance": dict(self.provenance),
            "configs": [
                {"config": spec.encode_config(c), **m.to_json()} for c, m in self.data.items()
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Entry:
        bound = keys.canonical(BoundArguments.from_spec(data))
        config_cls = bound.op.config_cls
        measured = {
            _decode_config(config_cls, item["config"]): Measurement.from_json(item)
            for item in _config_items(data)
        }
        return cls(bound, measured, _provenance(data))


def _config_items(data: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """An entry's `configs`, each an object with a `config`: `SpecError` otherwise (a
    string or an object there failed as "string indices must be integers")."""
    items = data.get("configs", [])
    if not isinstance(items, list) or not all(
            isinstance(item, Mapping) and "config" in item for item in items):
        raise spec.SpecError(f"'configs' must be a list of objects, each with a 'config', "
                             f"got {items!r:.80}")
    return items


def _provenance(data: Mapping[str, Any]) -> dict[str, Any]:
    """An entry's `provenance` (an object, or null for none): `SpecError` otherwise (a
    string raised a bare `ValueError` from `dict`, and a user cache holding one crashed
    every op call instead of being reported and skipped)."""
    provenance = data.get("provenance") or {}
    if not isinstance(provenance, Mapping):
        raise spec.SpecError(f"'provenance' must be a JSON object or null, got "
                             f"{provenance!r:.80}")
    return dict(provenance)


def _decode_config(config_cls: type, data: Any) -> Any:
    """`spec.decode_config`, with a `spec.SpecError` for a config that is not a JSON object
    (a `null` one reached the kernel) or that its class rejects (a hand-edited
    `"chunk_q": 0` raised the config's own `ValueError`, and a user cache holding it
    crashed every op call instead of being reported and skipped)."""
    if not isinstance(data, Mapping):
        raise spec.SpecError(f"{config_cls.__name__} must be a JSON object of its fields, "
                             f"got {data!r}")
    try:
        return spec.decode_config(config_cls, data)
    except spec.SpecError:
        raise
    except (TypeError, ValueError) as e:
        raise spec.SpecError(f"config {dict(data)!r} was rejected: {e}") from None
