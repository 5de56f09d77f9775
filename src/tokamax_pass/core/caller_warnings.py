"""Warnings that point at the user's own line: the first frame outside this package,
however deep inside it the warning is raised."""

from __future__ import annotations

import os
import warnings

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """`warnings.warn(message, category)`, attributed to the first frame outside
    `tokamax_pass`."""
    warnings.warn(message, category, skip_file_prefixes=(PACKAGE_DIR,))
