"""An export worker's loop (`python -m tokamax_pass.autotuning.export_worker`).

`lowering.ExportWorkers` starts these: each reads pickled `export_candidate` requests on
stdin and answers `(ok, blob or error)` on stdout until stdin closes.
"""

from __future__ import annotations

import os
import pickle
import sys

from tokamax_pass.autotuning.lowering import export_candidate


def serve() -> None:
    """Read a pickled request, answer `(ok, blob or error)`, until stdin closes.

    The answers go out on their own copy of the stdout pipe, and stdout itself becomes
    stderr, for Python and native code alike: a compiler's line written to stdout was
    read by the tuning process as part of a pickle (where a line starting with "c" reads
    as an import)."""
    requests = sys.stdin.buffer
    sys.stdout.flush()
    with os.fdopen(os.dup(1), "wb") as answers:
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        while True:
            try:
                request = pickle.load(requests)
            except EOFError:
                return
            answer: tuple[bool, bytearray | str]
            try:
                answer = (True, export_candidate(*request))
            except Exception as e:  # noqa: BLE001 - the tuning process lowers it itself
                answer = (False, f"{type(e).__name__}: {e}"[:500])
            pickle.dump(answer, answers)
            answers.flush()


if __name__ == "__main__":
    serve()
