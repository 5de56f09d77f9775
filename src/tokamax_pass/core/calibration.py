"""Calibration data: a device's measured ceilings and each implementation's measured
efficiency (roofline time over measured time) at the calls a sweep timed.

One plain JSON file per device kind, `<device_kind_key>.json`, in the package's
`data/calibration/` folder or, where set, in the folder `TOKAMAX_PASS_CALIBRATION_DIR`
names. Loading never imports or evaluates anything: the file must be an object of the
schema below, numbers finite and positive (ceilings within `CEILING_RANGE`), names
short strings, sizes bounded. A file that is not is reported once (a warning) and
ignored: the device then has no calibration, and `implementation=None` chooses as it
does without one.

    {"schema": "tokamax_pass.calibration", "version": 1, "device_kind": "NVIDIA H200",
     "ceilings": {"bf16_tflops": ..., "f32_tflops": ..., "hbm_tbps": ...},
     "points": [{"op": "PallasTritonRaggedDot", "dtype": "bfloat16",
                 "flops": ..., "bytes": ..., "efficiency": ..., "features": [...]}, ...],
     "provenance": {"commit": "...", "jax": "...", "date": "..."}}
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from tokamax_pass.core import spec
from tokamax_pass.core.caller_warnings import warn_at_caller
from tokamax_pass.core.device import device_kind_key
from tokamax_pass.core.roofline import Ceilings, Work

SCHEMA = "tokamax_pass.calibration"
VERSION = 1
ENV_DIR = "TOKAMAX_PASS_CALIBRATION_DIR"
MAX_FILE_BYTES = 16 * 2**20
MAX_POINTS = 100_000
MAX_NAME_CHARS = 200
# An efficiency above this is a measurement error (the roofline is a bound), not data.
MAX_EFFICIENCY = 4.0
# A ceiling (TFLOP/s, TB/s) outside this range is no device's: near zero, roofline times
# overflow to infinity and every prediction ties; past the top, they all round to zero. The
# floor sits far below any device: a CPU timing tiny calls by wall clock (a calibration
# fitted there in tests) measures well under a gigabyte a second.
CEILING_RANGE = (1e-9, 1e6)
MAX_FEATURES = 8
# Shape features are log2 sizes (`roofline.FeatureRule`).
MAX_FEATURE = 64.0
_CEILING_NAMES = ("bf16_tflops", "f32_tflops", "hbm_tbps")
_POINT_NAMES = ("op", "dtype", "flops", "bytes", "efficiency")
_OPTIONAL_POINT_NAMES = ("features",)
_TOP_NAMES = {"schema", "version", "device_kind", "ceilings", "points", "provenance"}


class CalibrationError(ValueError):
    """A calibration file that does not follow the schema."""


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured call: the op (`prediction.op_name`), the call's dtype, its work and
    the efficiency the implementation reached there, and the call's shape features
    (`roofline.register_family_work`; `()` for a family that declares none)."""

    op: str
    dtype: str
    flops: float
    bytes: float
    efficiency: float
    features: tuple[float, ...] = ()


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A device kind's ceilings and measured points, grouped by `(op, dtype)`."""

    device_kind: str
    ceilings: Ceilings
    points: tuple[Point, ...]

    @functools.cached_property
    def by_op(self) -> Mapping[str, tuple[Point, ...]]:
        grouped: dict[str, list[Point]] = {}
        for point in self.points:
            grouped.setdefault(point.op, []).append(point)
        return {op: tuple(points) for op, points in grouped.items()}

    @functools.cached_property
    def fastest_seconds(self) -> float:
        """The shortest time any measured point took: a call's fixed costs (a launch, a
        pass over a few tiles), below which no prediction goes. 0 with no points."""
        times = (self.ceilings.roofline_seconds(Work(p.flops, p.bytes), p.dtype)
                 for p in self.points)
        return min((t / p.efficiency for t, p in zip(times, self.points, strict=True)
                    if t is not None), default=0.0)


def _reject_constant(name: str) -> float:
    raise CalibrationError(f"non-finite number {name}")


def _features(value: Any, where: str) -> tuple[float, ...]:
    if not isinstance(value, list) or len(value) > MAX_FEATURES:
        raise CalibrationError(f"{where} must be a list of at most {MAX_FEATURES} numbers")
    found = []
    for j, item in enumerate(value):
        number = _finite(item, f"{where}[{j}]")
        if abs(number) > MAX_FEATURE:
            raise CalibrationError(f"{where}[{j}] must be within +-{MAX_FEATURE}, got {item!r}")
        found.append(number)
    return tuple(found)


def _finite(value: Any, where: str) -> float:
    """`value` as a float: a JSON number (not a bool) that is finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalibrationError(f"{where} must be a number, got {type(value).__name__}")
    try:
        number = float(value)  # an integer too large for a float is out of range, not a crash
    except OverflowError:
        raise CalibrationError(f"{where} must be finite, got an integer too large for a "
                               f"float") from None
    if not math.isfinite(number):
        raise CalibrationError(f"{where} must be finite, got {value!r}")
    return number


def _positive(value: Any, where: str, maximum: float = math.inf,
              minimum: float = 0.0) -> float:
    number = _finite(value, where)
    if not minimum < number <= maximum:
        raise CalibrationError(f"{where} must be finite, > {minimum} and <= {maximum}, got "
                               f"{value!r}")
    return number


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
        raise CalibrationError(f"{where} must be a string of 1-{MAX_NAME_CHARS} characters")
    return value


def _object(value: Any, where: str, names: set[str] | tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CalibrationError(f"{where} must be an object, got {type(value).__name__}")
    unknown = set(value) - set(names)
    if unknown:
        raise CalibrationError(f"{where} has unknown fields {sorted(unknown)}")
    return value


def parse(text: str | bytes) -> Calibration:
    """The calibration in `text`; `CalibrationError` says what is wrong with it."""
    if len(text) > MAX_FILE_BYTES:
        raise CalibrationError(f"larger than {MAX_FILE_BYTES} bytes")
    try:
        data = json.loads(text, parse_constant=_reject_constant,
                          object_pairs_hook=spec.object_of_unique_keys)
    except spec.RepeatedKeyError as e:
        raise CalibrationError(f"gives the key {e.args[0]!r:.80} twice in one object (JSON "
                               f"keeps the last: the first value would be dropped)") from None
    except RecursionError:
        raise CalibrationError("nested too deeply") from None
    except ValueError as e:  # not JSON, or an integer past Python's digit limit
        raise CalibrationError(f"not JSON: {e}") from None
    data = _object(data, "the file", _TOP_NAMES)
    if data.get("schema") != SCHEMA or data.get("version") != VERSION:
        raise CalibrationError(f"schema must be {SCHEMA!r} version {VERSION}, got "
                               f"{data.get('schema')!r} version {data.get('version')!r}")
    ceilings = _object(data.get("ceilings"), "ceilings", _CEILING_NAMES)
    if set(ceilings) != set(_CEILING_NAMES):
        raise CalibrationError(f"ceilings must give {list(_CEILING_NAMES)}")
    points = data.get("points")
    if not isinstance(points, list) or len(points) > MAX_POINTS:
        raise CalibrationError(f"points must be a list of at most {MAX_POINTS} objects")
    parsed = []
    for i, raw_point in enumerate(points):
        point = _object(raw_point, f"points[{i}]", _POINT_NAMES + _OPTIONAL_POINT_NAMES)
        if not set(_POINT_NAMES) <= set(point):
            raise CalibrationError(f"points[{i}] must give {list(_POINT_NAMES)}")
        parsed.append(Point(
            op=_name(point["op"], f"points[{i}].op"),
            dtype=_name(point["dtype"], f"points[{i}].dtype"),
            flops=_positive(point["flops"], f"points[{i}].flops"),
            bytes=_positive(point["bytes"], f"points[{i}].bytes"),
            efficiency=_positive(point["efficiency"], f"points[{i}].efficiency",
                                 MAX_EFFICIENCY),
            features=_features(point.get("features", []), f"points[{i}].features")))
    provenance = data.get("provenance", {})
    if not isinstance(provenance, dict) or not all(
            isinstance(v, str) and len(v) <= MAX_NAME_CHARS for v in provenance.values()):
        raise CalibrationError("provenance must be an object of short strings")
    return Calibration(
        device_kind=_name(data.get("device_kind"), "device_kind"),
        ceilings=Ceilings(**{n: _positive(ceilings[n], f"ceilings.{n}", CEILING_RANGE[1],
                                          CEILING_RANGE[0]) for n in _CEILING_NAMES}),
        points=tuple(parsed))


def folder() -> pathlib.Path | importlib.resources.abc.Traversable:
    """Where calibration files are read: `$TOKAMAX_PASS_CALIBRATION_DIR`, else the package's."""
    override = os.environ.get(ENV_DIR)
    if override:
        return pathlib.Path(override)
    return importlib.resources.files("tokamax_pass") / "data" / "calibration"


@functools.lru_cache(maxsize=32)
def _load_file(path: str, stamp: tuple[int, int]) -> Calibration | None:
    """The file at `path` (its modification time and size in `stamp`: an edited file is
    read again), or `None` after a warning when it is not a valid calibration."""
    del stamp
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_FILE_BYTES + 1)
        return parse(text)
    except (OSError, CalibrationError, UnicodeDecodeError) as e:
        warn_at_caller(f"tokamax_pass: ignoring the calibration file {path}: {e}")
        return None


def for_device_kind(device_kind: str | None) -> Calibration | None:
    """The calibration of `device_kind`, or `None` where there is none (or it is bad)."""
    if not device_kind:
        return None
    path = folder() / f"{device_kind_key(device_kind)}.json"
    try:
        if not path.is_file():
            return None
        path = pathlib.Path(str(path))
        stat = path.stat()
    except OSError:
        return None
    calibration = _load_file(str(path), (stat.st_mtime_ns, stat.st_size))
    if calibration is not None and calibration.device_kind != device_kind:
        return None
    return calibration
