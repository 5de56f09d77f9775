"""Autotuning: discover op calls, measure their configs, keep and apply the results.

Importing this package registers the cache stack (active results, user cache,
library cache) as a config source of `tokamax_pass.core.selection`.
"""

from tokamax_pass.autotuning.api import NothingToTuneWarning, autotune
from tokamax_pass.autotuning.autotuner import Autotuner
from tokamax_pass.autotuning.cache import CacheError, UnsavedResultError
from tokamax_pass.autotuning.cache import save as save_to_cache
from tokamax_pass.autotuning.discovery import (
    bound_args_from_json,
    bound_args_from_json_file,
    bound_args_to_json,
    get_bound_args,
)
from tokamax_pass.autotuning.entry import Measurement
from tokamax_pass.autotuning.result import AutotuningResult, active_results
from tokamax_pass.core.selection import register_config_source

from tokamax_pass.autotuning import cache as _cache  # isort: skip
from tokamax_pass.autotuning import compat as _compat  # noqa: F401  # isort: skip  (hooks)

register_config_source(_cache.SOURCE)

__all__ = [
    "Autotuner",
    "AutotuningResult",
    "CacheError",
    "Measurement",
    "NothingToTuneWarning",
    "UnsavedResultError",
    "active_results",
    "autotune",
    "bound_args_from_json",
    "bound_args_from_json_file",
    "bound_args_to_json",
    "get_bound_args",
    "save_to_cache",
]
