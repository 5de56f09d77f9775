"""Warnings that point at the user's own line: the first frame outside this package, the
kernel families' (`tokamax_kernels`) and JAX's, however deep inside them the warning is
raised (a cache read while JAX lowers a jitted call is reported at the call)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Sequence, Sized

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package_dir(name: str) -> str | None:
    """Package `name`'s folder, found without importing it (`tokamax_kernels` imports
    this package)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.abspath(next(iter(spec.submodule_search_locations)))


# Folders, each ending in a separator: `.../jax/` is no prefix of `.../jax_triton/`.
_SKIPPED_DIRS = tuple(os.path.join(d, "") for d in (PACKAGE_DIR, *map(_package_dir, (
    "tokamax_kernels", "jax", "jaxlib"))) if d is not None)


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """`warnings.warn(message, category)`, attributed to the first frame outside
    `tokamax_pass`, `tokamax_kernels` and JAX."""
    warnings.warn(message, category, skip_file_prefixes=_SKIPPED_DIRS)


def skip_unreadable(found: Sized, unreadable: Sequence[Exception], what: str) -> None:
    """Raise the first of `unreadable` where nothing was `found`, else warn once for each
    (`skipping <what> whose metadata cannot be read: <error>`): one damaged record of
    many is skipped so the rest are still read, and a source with no readable record
    fails with the reason."""
    if unreadable and not found:
        raise unreadable[0]
    for error in unreadable:
        warn_at_caller(f"skipping {what} whose metadata cannot be read: {error}")
