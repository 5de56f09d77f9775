"""JAX functions swapped for the pass's own while any `optimize` trace needs them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class CountedSwap:
    """Calls `put(True)` when the first block of `held()` starts and `put(False)` when the
    last one ends: counted under a lock, so nested blocks and blocks in concurrent threads
    restore JAX's own functions only once none is active."""

    def __init__(self, put: Callable[[bool], None]) -> None:
        self._put = put
        self._lock = threading.Lock()
        self._holders = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._change(+1)
        try:
            yield
        finally:
            self._change(-1)

    def _change(self, by: int) -> None:
        with self._lock:
            self._holders += by
            self._put(bool(self._holders))
