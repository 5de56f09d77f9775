"""Checks of the framework's public arguments: a bad value is an error naming the function,
the argument and what it expects, raised at the API's entry.

Without them a bad option went on to fail deep inside JAX, `json` or `os` with a message
about something else (`'int' object has no attribute 'write'`), or was silently used
(`max_configs=-1` sliced the search space from the end). The ops validate their own
arguments in `tokamax_kernels/_validation.py`; this module is the framework's (it imports
nothing of ours, so any module may use it).
"""

from __future__ import annotations

import numbers
import os
import pathlib
from collections.abc import Collection
from typing import Any, cast


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_int(who: str, name: str, value: Any, *, minimum: int,
                allow_none: bool = False) -> None:
    """`value` is an int (not a bool) >= `minimum`, or `None` where `allow_none`."""
    if value is None and allow_none:
        return
    if not _is_int(value) or value < minimum:
        none = " or None" if allow_none else ""
        raise (ValueError if _is_int(value) else TypeError)(
            f"{who}: {name} must be an int >= {minimum}{none}, got {value!r}")


def require_positive_number(who: str, name: str, value: Any) -> None:
    """`value` is a real number (not a bool) > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be a number of seconds > 0, got {value!r}")
    # typeshed's `numbers.Real` declares no `>`; a real number compares as a float does.
    if not cast(float, value) > 0:  # not `<= 0`: NaN is no number of seconds either
        raise ValueError(f"{who}: {name} must be > 0, got {value!r}")


def require_bool(who: str, name: str, value: Any) -> None:
    """`value` is `True` or `False`: a string like `"sometimes"` would read as true."""
    if not isinstance(value, bool) and type(value).__name__ != "bool_":
        raise TypeError(f"{who}: {name} must be True or False, got {value!r}")


def require_choice(who: str, name: str, value: Any, choices: Collection[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{who}: {name} must be one of {tuple(choices)}, got {value!r}")


def require_callable(who: str, name: str, value: Any) -> None:
    if not callable(value):
        raise TypeError(f"{who}: {name} must be callable, got {type(value).__name__}")


def require_ints(who: str, name: str, value: Any) -> None:
    """An int or a sequence of ints (`static_argnums`, `donate_argnums`)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if not all(_is_int(v) for v in items):
        raise TypeError(f"{who}: {name} must be an int or a sequence of ints, got {value!r}")


def require_strs(who: str, name: str, value: Any) -> None:
    """A str or a sequence of strs (`static_argnames`, `platforms`, `device_kind`)."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise TypeError(f"{who}: {name} must be a str or a sequence of strs, got {value!r}")


def as_path(who: str, name: str, value: Any) -> pathlib.Path:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{who}: {name} must be a path (str or os.PathLike), got "
                        f"{type(value).__name__}")
    return pathlib.Path(value)


def file_to_read(who: str, name: str, value: Any) -> pathlib.Path:
    """`value` as a path to an existing regular file: `FileNotFoundError` when there is
    nothing there, `IsADirectoryError` for a directory, `OSError` for anything else (a
    pipe, a device, `/dev/stdin`: reported as missing, and read without a bound)."""
    path = as_path(who, name, value)
    if path.is_dir():
        raise IsADirectoryError(f"{who}: {name} {os.fspath(path)!r} is a directory; give "
                                f"the path of a file")
    if not path.is_file():
        if path.exists():
            raise OSError(f"{who}: {name} {os.fspath(path)!r} is not a regular file (a "
                          f"pipe or a device); give the path of a file, or pass its text")
        raise FileNotFoundError(f"{who}: {name} {os.fspath(path)!r} does not exist")
    return path


def file_to_write(who: str, name: str, value: Any) -> pathlib.Path:
    """`value` as a path a file can be written to: not a directory, in an existing
    directory (`FileNotFoundError` names a missing one)."""
    path = as_path(who, name, value)
    if path.is_dir():
        raise IsADirectoryError(f"{who}: {name} {os.fspath(path)!r} is a directory; give "
                                f"the path of a file")
    parent = path.parent
    if not parent.is_dir():
        error, what = ((NotADirectoryError, "is a file, not a directory") if parent.exists()
                       else (FileNotFoundError, "does not exist"))
        raise error(f"{who}: cannot write {name} {os.fspath(path)!r}: its directory "
                    f"{os.fspath(parent)!r} {what}")
    return path


def directory_to_write(who: str, name: str, value: Any) -> pathlib.Path:
    """`value` as a directory that is there or can be made: `NotADirectoryError` when it,
    or a folder above it, is a file."""
    path = as_path(who, name, value)
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise NotADirectoryError(
                    f"{who}: {name} {os.fspath(path)!r} needs a directory, but "
                    f"{os.fspath(folder)!r} is a file")
            break
    return path


# Stands for an argument not given, where `None` is a value a caller may pass.
NOT_GIVEN: Any = object()


def one_of(who: str, name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """The argument given as `name` or as its other name `alias` (upstream Tokamax's
    keyword): `TypeError` when both or neither is given (`NOT_GIVEN`)."""
    if value is not NOT_GIVEN and alias_value is not NOT_GIVEN:
        raise TypeError(f"{who}: got {name} and its other name {alias}; give one")
    if value is NOT_GIVEN and alias_value is NOT_GIVEN:
        raise TypeError(f"{who}: missing the argument {name} (or {alias})")
    return value if value is not NOT_GIVEN else alias_value
