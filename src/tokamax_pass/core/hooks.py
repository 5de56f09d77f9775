"""The late-bound functions the op framework calls in the modules built on it.

`core.op` and `core.bound_arguments` sit at the bottom of the core: the primitive, the
VJP ops, config resolution and the autotuning package import them, never the other way
round. What `Op` and `BoundArguments` need from those modules is filled in here when
each is imported (`tokamax_pass.core` imports them all), so the core has no import
circle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokamax_pass.core.op import Op
    from tokamax_pass.core.vjp import AutodiffVjp, VjpOp


def _hook_not_set(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("tokamax_pass.core: a hook was called before the module that sets "
                       "it was imported (import tokamax_pass first)")


@dataclasses.dataclass
class _Hooks:
    """What `Op` and `BoundArguments` use from the modules built on them. `op_base` is `Op`
    itself (set by `core.op`: `BoundArguments.from_spec` checks that a spec names an op).
    `call_ops` makes an op call (`core.calls`); `autodiff_vjp` and `vjp_base` are
    `core.vjp`'s `AutodiffVjp` and `VjpOp`. `tune_bound` and `cached_measurements` are
    `tokamax_pass.autotuning.compat`'s (`BoundArguments.autotune`,
    `Op.get_autotuning_cache`), set when the autotuning package is imported, as are
    `cached_data`, `benchmark_bound` and `vjp_arg_spec` (`BoundArguments`'s members of
    those names); `resolve_config` is `core.selection`'s."""

    op_base: type[Op] | None = None
    call_ops: Callable[..., Any] = _hook_not_set
    autodiff_vjp: Callable[..., AutodiffVjp] = _hook_not_set
    vjp_base: type[VjpOp] | None = None
    tune_bound: Callable[..., Any] = _hook_not_set
    cached_measurements: Callable[..., Any] = _hook_not_set
    cached_data: Callable[..., Any] = _hook_not_set
    benchmark_bound: Callable[..., Any] = _hook_not_set
    vjp_arg_spec: Callable[..., Any] = _hook_not_set
    resolve_config: Callable[..., tuple[Any, str]] = _hook_not_set


HOOKS = _Hooks()
