"""`Op` and `BoundArguments`: the unit everything else tunes, caches and rewrites.

An op family (say `LayerNorm`) is a frozen dataclass whose `bind` validates and
canonicalizes the user's arguments and whose `_fwd` is the XLA reference. Each
implementation (a Pallas kernel, a cuDNN call) subclasses the family, names its
`config_cls`, and overrides `_fwd`, `check_supported`, `_get_heuristics_config`
and `_get_autotuning_configs`. A user-defined op does the same and works like a
built-in one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import jax

from tokamax_pass.core import argument_types, checks, config_limits, spec
from tokamax_pass.core import roofline as roofline_lib
from tokamax_pass.core.device import Target
from tokamax_pass.core.roofline import Work

if TYPE_CHECKING:
    from tokamax_pass.core.vjp import AutodiffVjp, VjpOp


class CannotLowerHere(NotImplementedError):
    """The target device runs this implementation, but this machine cannot lower it for
    that target (the lowering queries a library this machine lacks: cuDNN when a CPU
    machine exports for cuda). The call goes to another implementation, while the
    implementation's measurements on the target still inform the choice among the rest
    (`selection.choose`)."""


@dataclasses.dataclass(frozen=True)
class NullConfig:
    """The config of an op with nothing to tune."""


@dataclasses.dataclass(frozen=True)
class SizeLike:
    """A number in `Op.similarity_arguments` that neighbouring calls may differ in, as
    they differ in array sizes (an attention window's length, a GQA group), where any
    other value must match exactly. Positive: sizes compare by ratio."""

    value: int

    def __post_init__(self) -> None:
        if self.value < 1:
            raise ValueError(f"SizeLike: value must be >= 1 (sizes compare by ratio), "
                             f"got {self.value}")


def _hook_not_set(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("tokamax_pass.core.op: a hook was called before the module that sets "
                       "it was imported (import tokamax_pass first)")


@dataclasses.dataclass
class _Hooks:
    """What `Op` uses from the modules built on it, which fill it in when they are imported
    (`tokamax_pass.core` imports them all): `Op` never imports them back, so the core has no
    import circle. `call_ops` binds the primitive (`core.primitive`); `autodiff_vjp` and
    `vjp_base` are `core.vjp`'s `AutodiffVjp` and `VjpOp`. `tune_bound` and
    `cached_measurements` are `tokamax_pass.autotuning.compat`'s (`BoundArguments.autotune`,
    `Op.get_autotuning_cache`), set when the autotuning package is imported, as are
    `cached_data`, `benchmark_bound` and `vjp_arg_spec` (`BoundArguments`'s members of
    those names); `resolve_config` is `core.selection`'s."""

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


def snake_case_name(op_or_cls: Op | type[Op] = checks.NOT_GIVEN, *,
                    op: Op | type[Op] = checks.NOT_GIVEN) -> str:
    """`PallasTritonFlashAttention` -> `pallas_triton_flash_attention` (cache file names);
    `op=`: upstream Tokamax's name for `op_or_cls`."""
    op_or_cls = checks.one_of("snake_case_name", "op_or_cls", op_or_cls, "op", op)
    cls = op_or_cls if isinstance(op_or_cls, type) else type(op_or_cls)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls.__name__).lower()


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


class _OpOrClassMethod:
    """A method that also works on the class, as on a default-constructed instance.

    `PallasTritonRaggedDot.bind(lhs, rhs, group_sizes)` is how the Tokamax documents
    bind an implementation; on an instance it is the ordinary bound method.
    """

    def __init__(self, function: Any) -> None:
        self.function = function
        # The descriptor takes the function's name and docstring; typeshed types
        # `update_wrapper`'s wrapper as a callable, which a descriptor is not.
        functools.update_wrapper(cast(Any, self), function)

    def __get__(self, op: Op | None, cls: type[Op]) -> Any:
        bound = functools.partial(self.function, cls() if op is None else op)
        aliases = cls.argument_aliases

        @functools.wraps(self.function)
        def bind(*args: Any, return_residuals: bool = False, **kwargs: Any) -> BoundArguments:
            # Upstream Tokamax's `bind` takes `return_residuals`; what is tuned and cached
            # is the same call either way, so it is checked and left out.
            if not isinstance(return_residuals, bool):
                raise TypeError(f"{cls.__name__}.bind: return_residuals must be a bool, got "
                                f"{return_residuals!r}")
            for alias, name in aliases.items():
                if alias in kwargs:
                    if name in kwargs:
                        raise TypeError(f"{cls.__name__}.bind: got both {name!r} and its "
                                        f"alias {alias!r}")
                    kwargs[name] = kwargs.pop(alias)
            return bound(*args, **kwargs)

        return bind


@dataclasses.dataclass(frozen=True, kw_only=True)
class Op[C]:
    """A tunable operation. Frozen, hashable, serializable by import path.

    Attributes:
      config: a pinned config; `None` resolves one (results, caches, heuristics).
      vjp: the op that computes this op's gradient; `None` means the default
        (`_default_vjp`), so the backward pass is found and tuned on its own.
    """

    config: C | None = None
    vjp: Op | None = None
    # Upstream Tokamax's switch: call this implementation without checking that it runs on
    # the device (`check_supported_target` passes). How to call, not what is tuned: not part of
    # the op's identity (equality, cache keys) or of its spec.
    bypass_device_check: bool = dataclasses.field(
        default=False, compare=False, metadata={spec.NOT_IN_SPEC: True})

    config_cls: ClassVar[type] = NullConfig
    # Upstream Tokamax's class attributes. `supports_symbolic_shapes=False` makes a call
    # with `jax.export.symbolic_shape` dimensions a `NotImplementedError` (the next
    # implementation runs it); every op here captures its `jax.vmap`s
    # (`BoundArguments.vmap`), so `supports_batched_args_capture` is true for all.
    supports_symbolic_shapes: ClassVar[bool] = True
    supports_batched_args_capture: ClassVar[bool] = True
    # Keyword names `bind` also accepts, each for the argument it names (upstream Tokamax
    # spells some arguments differently: attention's `q`, `k`, `v`).
    argument_aliases: ClassVar[Mapping[str, str]] = {}
    # Registry name of this implementation (`"xla"`, `"triton"`, ...).
    implementation: ClassVar[str] = "xla"

    def __class_getitem__(cls, params: Any) -> Any:
        """`Op[Config]`, or upstream Tokamax's `Op[P, T, R, Config, K]` (the config type
        fourth), so that a class written against upstream's generic `Op` subclasses this
        one; `config_cls` names the config in both."""
        if isinstance(params, tuple) and len(params) == 5:
            params = params[3]
        return super().__class_getitem__(params)  # type: ignore[misc]

    # Platforms the implementation lowers for; `None` means every platform.
    platforms: ClassVar[frozenset[str] | None] = None
    # Whether tracing and lowering one call holds the Python interpreter for long (Pallas
    # Mosaic GPU kernels: 0.3-0.6 s each); the autotuner lowers such candidates in
    # worker processes instead of one thread at a time.
    slow_lowering: ClassVar[bool] = False
    # Whether `implementation=None` may pick this implementation without a measurement:
    # true for the XLA reference and for plain JAX's own fused paths (`jax.nn`'s cuDNN
    # attention), which is what a user runs without us. Kernels stay false: they displace
    # these only where a measurement at the shape (or a measured neighbour) says they win,
    # or, with nothing measured, a prediction does (`core.prediction`).
    plain_jax_path: ClassVar[bool] = False
    # How much faster than the plain-JAX paths this kernel must be measured (or predicted),
    # on its own, for `None` to pick it. Memory-bound ops that XLA fuses with their neighbours in a
    # program (a norm with the residual add before it) need more: alone, the plain path
    # pays passes over memory that it does not pay inside a program.
    kernel_margin: ClassVar[float] = 0.05
    # Whether autodiff of this forward (`AutodiffVjp`) recomputes products that make up
    # much of its gradient's work, which XLA merges with the forward's own inside one
    # program (`Op.reruns_forward`): attention's scores, a GEMM's output. A norm's
    # gradient recomputes only its row statistics, a small part of its work.
    autodiff_reruns_products: ClassVar[bool] = True

    def __post_init__(self) -> None:
        """A pinned config within `config_limits` (its field and limit named)."""
        config_limits.check(self.config)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "bind" in cls.__dict__ and not isinstance(cls.__dict__["bind"], _OpOrClassMethod):
            # A descriptor in place of the method: mypy allows no assignment to a method.
            cls.bind = _OpOrClassMethod(cls.__dict__["bind"])  # type: ignore[method-assign]

    # --- what a family or implementation overrides -----------------------------------

    @_OpOrClassMethod
    def bind(self, *args: Any, **kwargs: Any) -> BoundArguments:
        """Validates and canonicalizes arguments (`ValueError` names a bad one).

        The default binds to the signature of `_fwd`; families override it to
        check shapes and dtypes and then return `BoundArguments(self, {...})`.
        """
        signature = _fwd_signature(type(self))
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{type(self).__name__}: {e}") from None
        bound.apply_defaults()
        return BoundArguments(self, dict(bound.arguments))

    def _fwd(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Computes `(out, residuals)` from the bound arguments and the keywords `config`
        and `return_residuals`; residuals may be `None` when not asked for.

        Each implementation declares its own arguments; `(*args, **kwargs)` here lets a
        type checker accept them."""
        raise NotImplementedError(f"{type(self).__name__} does not define _fwd")

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        """Raises `NotImplementedError(reason)` when this implementation cannot run `ba`.

        `target=None` checks the inputs only; a target also checks the device.
        """
        if target is not None:
            self.check_supported_target(target)

    def _get_heuristics_config(self, ba: BoundArguments) -> C:
        if self.config_cls is NullConfig:
            return NullConfig()  # type: ignore[return-value]
        raise NotImplementedError(f"{type(self).__name__} has no heuristics config")

    def _get_autotuning_configs(self, ba: BoundArguments) -> set[C]:
        return set()

    def similarity_arguments(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The arguments as far as this op's speed depends on them, for matching a call
        with measurements at neighbouring shapes (`autotuning.keys.similarity`).

        Families override it to drop what does not matter to a kernel (a scale's dtype,
        an absent offset), to merge axes whose split does not matter (leading axes) and to
        mark numbers that scale like sizes (`SizeLike`).
        """
        return dict(arguments)

    def kernel_margin_for(self, ba: BoundArguments) -> float:
        """`kernel_margin` for the call `ba`: an op whose plain-JAX path fuses with its
        neighbours only for some calls (a norm not given its residual add) overrides it."""
        return self.kernel_margin

    def roofline(self, ba: BoundArguments) -> Work | None:
        """The least work the call `ba` needs (FLOPs, device-memory bytes), whatever runs
        it: what `implementation=None` predicts times from (`core.prediction`). The
        family's registered rule (`roofline.register_family_work`); `None`: no prediction."""
        rules = roofline_lib.FAMILY_WORK.get(family_class(type(self)))
        return None if rules is None else rules.forward(ba)

    def vjp_roofline(self, ba: BoundArguments) -> Work | None:
        """The least work of the gradient of the forward call `ba` (every input's
        cotangent): the work of the family's VJP ops that make no nested op calls."""
        rules = roofline_lib.FAMILY_WORK.get(family_class(type(self)))
        return None if rules is None or rules.vjp is None else rules.vjp(ba)

    def performed_work(self, ba: BoundArguments) -> Work | None:
        """The work this implementation does for `ba`: the family's `roofline`, unless the
        implementation registered work of another kind (`roofline.register_performed_work`:
        `jax.lax.ragged_dot`'s dense product per group)."""
        rule = roofline_lib.PERFORMED_WORK.get(type(self))
        return self.roofline(ba) if rule is None else rule(ba)

    def saves_memory_over_plain(self, ba: BoundArguments) -> bool:
        """Whether this plain-JAX path keeps less device memory for the call `ba` than the
        plain expression it stands for, at that expression's speed (the loss gradient
        from a saved log-sum-exp, where autodiff of the expression keeps the float32
        log-softmax): `optimize` then keeps the rewrite of such an expression though no
        kernel runs (`passes.rewrite.rewrite_wins`; docs/optimize.md has the numbers)."""
        del ba
        return False

    def keeps_own_residuals(self) -> bool:
        """Whether this op, with its config, returns residuals in a form of its own that only
        its own VJP op (`vjp_op()`, which says the same) reads, in place of the family's
        (gradients computed in the forward pass). A call's residuals must have one form
        when it is traced, so a differentiated call that picks such an op is traced with
        that op alone, its config pinned (`primitive.bind_with_vjp`)."""
        return False

    def reruns_forward(self, ba: BoundArguments) -> bool:
        """True for an XLA gradient that recomputes its forward's products (autodiff of the
        forward, or logits recomputed from a saved log-sum-exp). Inside one program with
        the XLA forward, XLA merges those products with the forward's, so the time it was
        measured at alone overstates what it costs there (`selection.rank_with_evidence`)."""
        return False

    def evidence_calls(self, ba: BoundArguments) -> list[BoundArguments] | None:
        """The op calls whose measured times add up to this call's time, for an op that
        only makes nested op calls (`None`: the call is measured as itself)."""
        return None

    def _default_vjp(self) -> Op:
        return HOOKS.autodiff_vjp(forward=self.replace(vjp=None))

    # --- shared behaviour -------------------------------------------------------------

    def __call__(self, *args: Any, return_residuals: bool = False, **kwargs: Any) -> Any:
        """Runs the op: its output, or `(output, residuals)` with `return_residuals=True`."""
        if not isinstance(return_residuals, bool):
            raise TypeError(f"{type(self).__name__}: return_residuals must be a bool, got "
                            f"{return_residuals!r}")
        if not self.supports_symbolic_shapes and _has_symbolic_dims((args, kwargs)):
            raise NotImplementedError(f"{type(self).__name__} does not support symbolic "
                                      f"shapes")
        return HOOKS.call_ops((self,), args, kwargs, explicit=True,
                              return_residuals=return_residuals)

    @property
    def signature(self) -> inspect.Signature:
        """The call's signature: the family's `bind` where it defines one, else `_fwd`'s
        arguments (as upstream Tokamax's `Op.signature`)."""
        function = type(self).__dict__.get("bind") or next(
            klass.__dict__["bind"] for klass in type(self).__mro__ if "bind" in klass.__dict__)
        if function is Op.__dict__["bind"]:
            return _fwd_signature(type(self))
        signature = inspect.signature(function.function)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def replace(self, **changes: Any) -> Op:
        return dataclasses.replace(self, **changes)

    def get_autotuning_cache(self, device_kind: str | None = None) -> dict[str, Mapping]:
        """This op's measurements in the user and library caches for `device_kind` (default:
        the default device's), as upstream Tokamax's `Op.get_autotuning_cache`: `{cache key
        (the call's canonical JSON, `BoundArguments.cache_key`): {config: Measurement}}`,
        the user cache's entry winning over the library's."""
        return HOOKS.cached_measurements(self, device_kind)

    def vjp_op(self) -> Op:
        return self.vjp if self.vjp is not None else self._default_vjp()

    @property
    def runs_without_evidence(self) -> bool:
        """True for the implementations `None` picks when nothing was measured or
        predicted."""
        return self.implementation == "xla" or self.plain_jax_path

    def unmeasured_plain_path_loses(self, ba: BoundArguments) -> bool:
        """Whether, with nothing measured at `ba`, this plain-JAX path should yield to the
        XLA reference: a fused path's fixed costs can lose to XLA's own fusion on a tiny
        call (a rule fitted to a device sweep). False for everything but such paths."""
        del ba
        return False

    def yields_unmeasured_to(self, ba: BoundArguments, other: BoundArguments) -> bool:
        """Whether this plain-JAX path, not measured at `ba`, is known to run slower there
        than the plain-JAX path `other` (a rule fitted to a device sweep), so a
        measurement of `other` stands for the fastest plain path and a kernel measured
        faster than `other` may run. False for everything but such paths."""
        del ba, other
        return False

    def reference_op(self) -> Op:
        """The family's XLA reference: the class right under `Op` in the hierarchy."""
        family = family_class(type(self))
        return self if type(self) is family else family()

    @classmethod
    def family_name(cls) -> str:
        return snake_case_name(family_class(cls))

    def supported_on(self, device: Any) -> bool:
        """True if this implementation can run on `device` (a `jax.Device` or platform)."""
        platform = device if isinstance(device, str) else device.platform
        kind = None if isinstance(device, str) else device.device_kind
        try:
            self.check_supported_target(Target({"gpu": "cuda"}.get(platform, platform), kind))
        except NotImplementedError:
            return False
        return True

    def check_supported_target(self, target: Target) -> None:
        """The device part of `check_supported`, for callers with no arguments yet (none
        with `bypass_device_check`)."""
        if self.bypass_device_check:
            return
        if self.platforms is not None and target.platform not in self.platforms:
            hint = _export_hint(self.platforms) if target.platform == "cpu" else ""
            raise NotImplementedError(
                f"{type(self).__name__} runs on {sorted(self.platforms)}, not on "
                f"{target.platform}; use implementation='xla' or None{hint}"
            )


# A kernel is traced for the platform an op call is traced for, which `jax.export`'s
# `platforms=` does not change: from a CPU machine, the target is named by its device kind.
_EXAMPLE_KINDS = {"cuda": "NVIDIA H200", "tpu": "TPU v6 lite"}


def _export_hint(platforms: frozenset[str]) -> str:
    platform = next((p for p in _EXAMPLE_KINDS if p in platforms), None)
    if platform is None:
        return ""
    kind = _EXAMPLE_KINDS[platform]
    return (f"; to export it for {platform} from this machine, name the device: "
            f"tokamax_pass.export(fun, *args, platforms=['{platform}'], device_kind='{kind}'), "
            f"or trace under tokamax_pass.core.targeting('{kind}')")


def _has_symbolic_dims(tree: Any) -> bool:
    return any(not isinstance(d, int) for leaf in jax.tree.leaves(tree)
               if spec.is_array(leaf) for d in leaf.shape)


def family_class(cls: type[Op]) -> type[Op]:
    """The op family of an implementation: the class right under `Op` (or `VjpOp`)."""
    VjpOp = HOOKS.vjp_base
    for klass in cls.__mro__:
        if klass is not VjpOp and (Op in klass.__bases__ or VjpOp in klass.__bases__):
            return klass
    raise TypeError(f"{cls.__name__} is not an Op subclass")


def _fwd_signature(cls: type[Op]) -> inspect.Signature:
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
        if not isinstance(op, Op):
            raise spec.SpecError(f"{data['op']!r} does not name an Op")
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
        signature = _fwd_signature(type(self.op))
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
        return _fwd_signature(type(self.op))

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

