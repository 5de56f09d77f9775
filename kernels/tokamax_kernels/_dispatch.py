"""Callables in `implementation=`: upstream Tokamax lets a sequence mix implementation
names with plain functions, each tried in order until one does not raise
`NotImplementedError`.

A callable (any callable that is not an `Op`) is called with the op's public arguments;
runs of names and `Op`s between callables go to the family together, so its own rules
for a sequence (and for `None`) hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tokamax_pass.core import Op
from tokamax_pass.core.errors import all_failed


def given_keywords(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The keywords of `values` not left at their `defaults` (a function in
    `implementation` gets the call as it was written, so plain JAX functions fit)."""
    return {k: x for k, x in values.items() if not _is_default(x, defaults[k])}


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    scalars = (bool, int, float, str)
    return (isinstance(value, scalars) and type(value) is type(default)
            and value == default)


def is_user_callable(item: Any) -> bool:
    return callable(item) and not isinstance(item, (Op, str, type))


def _groups(items: Sequence[Any]) -> list[Any]:
    """Each callable alone; each run of names and `Op`s between them as a list."""
    groups: list[Any] = []
    for item in items:
        if is_user_callable(item):
            groups.append(item)
        elif groups and isinstance(groups[-1], list):
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def call(implementation: Any, run_family: Callable[[Any], Any],
         run_callable: Callable[[Callable[..., Any]], Any], *, op: str) -> Any:
    """`run_family(implementation)`, unless `implementation` is a callable or a sequence
    holding callables: then each group in order (`run_callable(f)` for a callable), the
    first result that is not a `NotImplementedError`; with none left, the error of a lone
    candidate as it is, else an `AllImplementationsFailedError` (an `ExceptionGroup` and a
    `NotImplementedError`) naming each."""
    if is_user_callable(implementation):
        return run_callable(implementation)
    if (not isinstance(implementation, Sequence) or isinstance(implementation, str)
            or not any(is_user_callable(item) for item in implementation)):
        return run_family(implementation)
    groups = _groups(implementation)
    failures: list[tuple[str, Exception]] = []
    for group in groups:
        try:
            return run_callable(group) if callable(group) else run_family(group)
        except NotImplementedError as e:
            if len(groups) == 1:
                raise
            failures.append((str(getattr(group, "__name__", group)), e))
    raise all_failed(f"{op}: no implementation supports these inputs:", failures)
