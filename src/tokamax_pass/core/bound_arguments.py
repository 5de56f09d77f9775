"""`BoundArguments`: an op with its canonical arguments, and how it is read from a spec.

What autotuning measures, caches key on and `plan()` lists is a `BoundArguments`. Its
spec (JSON) names the op by its registered import path and holds the arguments as
array specs and plain values; reading one back checks every field and runs the op's
own `bind` on it, so a bad file fails when it is read.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax

from tokamax_pass.core import argument_types, spec
from tokamax_pass.core.hooks import HOOKS

if TYPE_CHECKING:
    from tokamax_pass.core.op import Op


@dataclasses.dataclass(frozen=True)
class NullConfig:
    """The config of an op with nothing to tune."""


@dataclasses.dataclass(frozen=True)
class VmapLevel:
    """One `jax.vmap` around an op call: which array leaves carry the mapped axis (at 0)."""

    axes: tuple[int | None, ...]
    size: int


# The largest vmap size a spec may hold: XLA's largest dimension.
_MAX_VMAP_SIZE = 2**63 - 1


def _vmap_levels(raw: Any) -> tuple[VmapLevel, ...]:
    """A spec's `__vmap__` (`[[axes, size], ...]`, each axis 0 or null, each size an int
    >= 1) as `VmapLevel`s: `SpecError` otherwise (a size of 2.7 was read as 2, and an
    infinite one raised a bare `OverflowError` that crashed every op call reading a
    user cache holding it)."""
    def bad(why: str) -> spec.SpecError:
        return spec.SpecError(f"a bound-arguments spec's '__vmap__' must be [[axes, size], "
                              f"...] (each axis 0 or null, each size an int >= 1): {why}, "
                              f"got {raw!r:.120}")

    if not isinstance(raw, (list, tuple)):
        raise bad("not a list")
    levels = []
    for level in raw:
        if not isinstance(level, (list, tuple)) or len(level) != 2:
            raise bad(f"{level!r:.40} is not a pair [axes, size]")
        axes, size = level
        if not isinstance(axes, (list, tuple)) or not all(
                a is None or (type(a) is int and a == 0) for a in axes):
            raise bad(f"axes {axes!r:.40} are not a list of 0 or null")
        if type(size) is not int or not 1 <= size <= _MAX_VMAP_SIZE:
            raise bad(f"size {size!r:.40} is not an int from 1 to {_MAX_VMAP_SIZE}")
        levels.append(VmapLevel(tuple(axes), size))
    return tuple(levels)


def fwd_signature(cls: type[Op]) -> inspect.Signature:
    """The arguments an implementation's `_fwd` takes from a call: its own, without `self`,
    `config` and `return_residuals` (what `BoundArguments.arguments` holds)."""
    signature = inspect.signature(cls._fwd)
    params = [
        p for name, p in signature.parameters.items()
        if name not in ("self", "config", "return_residuals")
    ]
    return signature.replace(parameters=params)


def _check_binds(ba: BoundArguments) -> None:
    """`spec.SpecError` unless the op's `bind` accepts the call read from a spec: its own
    checks of shapes and values (a key of another head dimension than the query's) then
    reject a bad file when it is read, not when a kernel is built from it (a NaN
    `scale` among them)."""
    try:
        ba.op.bind(*ba.args, **ba.kwargs)
    except (TypeError, ValueError, ArithmeticError, NotImplementedError) as e:
        raise spec.SpecError(f"{type(ba.op).__name__}.bind rejects these arguments: "
                             f"{e}") from None


@dataclasses.dataclass(frozen=True)
class BoundArguments:
    """An op with its canonical arguments: what autotuning tunes and caches key on.

    Array arguments may be concrete arrays, tracers or `jax.ShapeDtypeStruct`s;
    `vmap` records the `jax.vmap`s around the call (shapes are per call, unbatched).
    """

    op: Op
    arguments: Mapping[str, Any]
    vmap: tuple[VmapLevel, ...] = ()

    @property
    def abstract_arguments(self) -> dict[str, Any]:
        return jax.tree.map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype) if spec.is_array(v) else v,
            dict(self.arguments),
            is_leaf=lambda v: v is None,
        )

    def arguments_spec(self) -> dict[str, Any]:
        data: dict[str, Any] = {k: spec.encode(v) for k, v in self.arguments.items()}
        if self.vmap:
            data["__vmap__"] = [[list(level.axes), level.size] for level in self.vmap]
        return data

    @property
    def cache_key(self) -> str:
        """Canonical JSON of the argument spec: equal for calls that share a config."""
        return spec.dumps(self.arguments_spec())

    def to_spec(self) -> dict[str, Any]:
        return {"op": spec.encode(self.op), "arguments": self.arguments_spec()}

    def to_json(self) -> str:
        return spec.dumps(self.to_spec())

    @classmethod
    def from_spec(cls, data: Mapping[str, Any]) -> BoundArguments:
        if not isinstance(data, Mapping) or "op" not in data or "arguments" not in data:
            raise spec.SpecError(f"a bound-arguments spec needs 'op' and 'arguments', got {data!r}")
        op = spec.decode(data["op"])
        if HOOKS.op_base is None:
            raise RuntimeError("tokamax_pass.core: a hook was called before the module that "
                               "sets it was imported (import tokamax_pass first)")
        if not isinstance(op, HOOKS.op_base):
            raise spec.SpecError(f"{data['op']!r} does not name an Op")
        argument_types.check_op_fields(op, HOOKS.op_base)
        if not isinstance(data["arguments"], Mapping):
            raise spec.SpecError(f"a bound-arguments spec's 'arguments' must be an object, got "
                                 f"{data['arguments']!r}")
        arguments = dict(data["arguments"])
        vmap = _vmap_levels(arguments.pop("__vmap__", []))
        decoded = {k: spec.decode(v) for k, v in arguments.items()}
        argument_types.check_arguments(type(op), decoded)
        ba = cls(op, decoded, vmap)
        _check_binds(ba)
        return ba

    @classmethod
    def from_json(cls, text: str) -> BoundArguments:
        return cls.from_spec(spec.loads(text, what="bound arguments"))

    @property
    def _inspect_bound(self) -> inspect.BoundArguments:
        signature = fwd_signature(type(self.op))
        arguments = {k: self.arguments[k] for k in signature.parameters if k in self.arguments}
        return inspect.BoundArguments(signature, arguments)

    @property
    def args(self) -> tuple[Any, ...]:
        """The positional arguments of the op's call (as upstream Tokamax's
        `BoundArguments.args`): `op(*ba.args, **ba.kwargs)` repeats the call."""
        return self._inspect_bound.args

    @property
    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the op's call (see `args`): its keyword-only ones and
        the statics an implementation's `_fwd` takes as `**statics` (attention's `scale`,
        `is_causal`, window)."""
        bound = self._inspect_bound
        statics = {k: v for k, v in self.arguments.items()
                   if k not in bound.signature.parameters}
        return {**bound.kwargs, **statics}

    def autotune(self, configs: Any = None, autotuner: Any = None, cache_results: bool = True,
                 timeout: float | None = None) -> Any:
        """Measures `configs` (default: the op's candidates) of this call on the default
        device: `{config: Measurement}` (an `AutotuningData`, with `fastest_config`), as
        upstream Tokamax's `BoundArguments.autotune`.

        `autotuner`: a `tokamax_pass.autotuning.Autotuner` (default: a new one, with
        `timeout` seconds for compiling). `cache_results=True` merges the measurements
        into the user cache, so later calls of this shape run the fastest config.
        """
        return HOOKS.tune_bound(self, configs, autotuner=autotuner,
                                cache_results=cache_results, timeout=timeout)

    @property
    def heuristics_config(self) -> Any:
        return self.op._get_heuristics_config(self)

    # --- upstream Tokamax's members -------------------------------------------------

    @property
    def signature(self) -> inspect.Signature:
        """The op's `_fwd` arguments (what `arguments` holds)."""
        return fwd_signature(type(self.op))

    @property
    def vmap_axis_sizes(self) -> tuple[int, ...]:
        """The sizes of the `jax.vmap`s around the call, in the order of `vmap`."""
        return tuple(level.size for level in self.vmap)

    @property
    def autotuning_cache_key(self) -> str:
        """The key of this call in `Op.get_autotuning_cache()` (`cache_key`)."""
        return self.cache_key

    @property
    def default_config(self) -> Any:
        """The config a call of the op runs with: the op's own, else the one
        `implementation`'s resolution finds (active results, user cache, library cache,
        then `tokamax_pass.config.autotuning_cache_miss_fallback`: heuristics by default)."""
        return HOOKS.resolve_config(self.op, self)[0]

    @property
    def cached_autotuning_data(self) -> Any:
        """`{config: Measurement}` (an `AutotuningData`, with `fastest_config`) of this
        call from the active results, the user cache or the library cache for the current
        device kind, the first that measured it; `None` where none did or under
        `tokamax_pass.config.ignore_autotuning_cache`."""
        return HOOKS.cached_data(self)

    def get_config(self, check_autotuning_cache: bool = True, autotune_configs: Any = None,
                   cache_autotuning_results: bool = True, allow_heuristics: bool = True) -> Any:
        """A config, as upstream Tokamax's `get_config`: the op's own; else the fastest in
        `cached_autotuning_data` (if `check_autotuning_cache`); else the fastest of
        `autotune_configs` measured now (if given; kept in the user cache if
        `cache_autotuning_results`); else `heuristics_config` (if `allow_heuristics`);
        else a `ValueError`."""
        if self.op.config is not None:
            return self.op.config
        if self.op.config_cls is NullConfig:
            return NullConfig()
        if check_autotuning_cache:
            data = self.cached_autotuning_data
            if data:
                return data.fastest_config
        if autotune_configs is not None:
            return self.autotune(autotune_configs,
                                 cache_results=cache_autotuning_results).fastest_config
        if allow_heuristics:
            return self.heuristics_config
        raise ValueError(f"no config found for {self!r}: nothing cached, no configs to "
                         f"autotune and allow_heuristics=False")

    def benchmark(self, mode: str = "forward") -> Any:
        """Times the op on this call's arguments (abstract ones filled with random values):
        a `tokamax_pass.benchmarking.BenchmarkData`. `mode`: as `standardize_function`'s."""
        return HOOKS.benchmark_bound(self, mode)

    @property
    def vjp_arg_spec(self) -> dict[str, Any]:
        """The arguments of this call's VJP op: these arguments with `residuals`, `out` and
        `dout` as `jax.ShapeDtypeStruct`s (`op.vjp_op().bind(**ba.vjp_arg_spec)`)."""
        return HOOKS.vjp_arg_spec(self)

    @property
    def autotuning_configs(self) -> set[Any]:
        return {self.heuristics_config} | set(self.op._get_autotuning_configs(self))

    def replace(self, **changes: Any) -> BoundArguments:
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={spec.encode(v)!r}" for k, v in self.arguments.items())
        return f"{type(self.op).__name__}.bind({args})"

