"""Runtime options under upstream Tokamax's names: `with tokamax.config.ignore_autotuning_cache(
True):` sets one for a block, `.value` reads it, `--tokamax_<name>=...` on the command line
(or, with absl installed, the absl flag `tokamax_<name>`) sets it for the program. A
function jitted under one value is traced again under another (see
`tokamax_pass.core.options`)."""

from tokamax_pass.core.options import (
    ConfigOption,
    autotuning_cache_miss_fallback,
    cross_compile,
    ignore_autotuning_cache,
)

__all__ = ["ConfigOption", "autotuning_cache_miss_fallback", "cross_compile",
           "ignore_autotuning_cache"]
