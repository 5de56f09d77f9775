"""The error raised when no implementation in an `implementation=` list can run.

Upstream Tokamax raises `ExceptionGroup("all implementations failed", errors)`; code
written for this library catches `NotImplementedError`. `AllImplementationsFailedError`
is both, so either `except` clause (and `except*`) catches it, and its message names
each implementation with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence


class AllImplementationsFailedError(ExceptionGroup[Exception], NotImplementedError):
    """Every candidate implementation raised `NotImplementedError`; `.exceptions` holds
    their errors, in the order they were tried."""

    def __str__(self) -> str:
        return self.message

    def derive(  # type: ignore[override]  # the group holds Exceptions only
            self, excs: Sequence[Exception]) -> AllImplementationsFailedError:
        """Keeps the class when `except*` splits the group."""
        return AllImplementationsFailedError(self.message, excs)


def all_failed(header: str, failures: Sequence[tuple[str, Exception]]
               ) -> AllImplementationsFailedError:
    """The error for `failures` (`(implementation name, its error)` pairs): `header`,
    then one line per implementation with its reason."""
    message = header + "\n  " + "\n  ".join(f"{name}: {e}" for name, e in failures)
    return AllImplementationsFailedError(message, [e for _, e in failures])
