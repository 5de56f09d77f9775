"""When each phase of an `autotune` ran: the autotuner's methods wrapped to record spans
(shared by the autotune timeline probes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import tokamax_pass as tokamax
from tokamax_pass.autotuning import autotuner, timing_inputs


def bound_of(args: tuple[Any, ...]) -> Any:
    """The `BoundArguments` among a wrapped call's arguments (the op it works on)."""
    return next(a for a in args if isinstance(a, tokamax.BoundArguments))


class Timeline:
    """Spans `{kind, op, start, end}` in seconds from this timeline's creation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.events: list[dict[str, Any]] = []

    def now(self) -> float:
        return round(time.perf_counter() - self.start, 3)

    def wrap(self, kind: str, fn: Callable[..., Any],
             call_of: Callable[[tuple[Any, ...]], Any] = bound_of) -> Callable[..., Any]:
        """`fn` with each call's span recorded under the op of `call_of(args)`."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ba, begin = call_of(args), self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.events.append(dict(kind=kind, op=type(ba.op).__name__, start=begin,
                                        end=self.now()))

        return wrapper

    def record_autotuner(self, timings: bool = False) -> None:
        """Wraps the autotuner's candidate compiles, reference outputs and input
        preparation (and with `timings`, each call's timing) for the rest of the process."""
        cls = autotuner.Autotuner
        cls._compile_one = staticmethod(self.wrap("candidate", cls._compile_one))
        cls._reference_output = self.wrap("reference", cls._reference_output)
        timing_inputs.timing_arguments = self.wrap("inputs", timing_inputs.timing_arguments)
        if timings:
            cls._time = self.wrap("time", cls._time, lambda args: args[1].ba)

    def sorted_events(self) -> list[dict[str, Any]]:
        return sorted(self.events, key=lambda e: e["start"])
