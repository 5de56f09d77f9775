"""Running a device probe's phases each in a subprocess with a timeout, so that a
deadlocked kernel costs its phase, not the run (nor the machine)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping


def run_phases(argv: list[str], script: str, phases: Mapping[str, tuple[Callable[[], None], int]],
               log: Callable[[dict], None]) -> int:
    """`script --phase NAME` runs phase NAME here; otherwise each phase named in `argv` (all
    by default) runs as `script --phase NAME` in a subprocess limited to its seconds, and a
    failed or timed-out phase is logged."""
    if argv and argv[0] == "--phase":
        phases[argv[1]][0]()
        return 0
    for phase in argv or list(phases):
        timeout = phases[phase][1]
        try:
            result = subprocess.run([sys.executable, script, "--phase", phase], timeout=timeout)
            if result.returncode:
                log(dict(phase=phase, exit=result.returncode))
        except subprocess.TimeoutExpired:
            log(dict(phase=phase, timeout=timeout))
    return 0
