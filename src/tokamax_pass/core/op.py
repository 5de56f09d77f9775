"""`Op`: the unit everything else tunes, caches and rewrites.

An op family (say `LayerNorm`) is a frozen dataclass whose `bind` validates and
canonicalizes the user's arguments and whose `_fwd` is the XLA reference. Each
implementation (a Pallas kernel, a cuDNN call) subclasses the family, names its
`config_cls`, and overrides `_fwd`, `check_supported`, `_get_heuristics_config`
and `_get_autotuning_configs`. A user-defined op does the same and works like a
built-in one. `op.bind(...)` returns a `BoundArguments` (`core.bound_arguments`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, cast

from tokamax_pass.core import checks, config_limits, spec
from tokamax_pass.core import roofline as roofline_lib
from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig, fwd_signature
from tokamax_pass.core.device import Target
from tokamax_pass.core.hooks import HOOKS
from tokamax_pass.core.roofline import Work


class CannotLowerHere(NotImplementedError):
    """The target device runs this implementation, but this machine cannot lower it for
    that target (the lowering queries a library this machine lacks: cuDNN when a CPU
    machine exports for cuda). The call goes to another implementation, while the
    implementation's measurements on the target still inform the choice among the rest
    (`selection.choose`)."""


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


def snake_case_name(op_or_cls: Op | type[Op] = checks.NOT_GIVEN, *,
                    op: Op | type[Op] = checks.NOT_GIVEN) -> str:
    """`PallasTritonFlashAttention` -> `pallas_triton_flash_attention` (cache file names);
    `op=`: upstream Tokamax's name for `op_or_cls`."""
    op_or_cls = checks.one_of("snake_case_name", "op_or_cls", op_or_cls, "op", op)
    cls = op_or_cls if isinstance(op_or_cls, type) else type(op_or_cls)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", cls.__name__).lower()


def _subscripted_config_cls(cls: type) -> type | None:
    """The config class `cls` names in its `Op[Config]` (or upstream Tokamax's
    `Op[P, T, R, Config, K]`) base, or through a generic family's (`Family[Config]` where
    `class Family[C](Op[..., C, ...])`, as upstream's families are written); `None` where
    it names none (`Op[Any]`, a type variable): upstream's ops name their config there,
    not in `config_cls`."""
    # `__dict__`: a subclass of such a class inherits its `__orig_bases__` attribute, and
    # with it would take its parent's generic base over its parent's `config_cls`.
    for base in cls.__dict__.get("__orig_bases__", ()):
        config_cls = _config_argument(base)
        if isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls):
            return config_cls
    return None


def _config_argument(base: Any) -> Any:
    """What the subscripted base `base` puts in `Op`'s config slot: `Op[X]`'s `X`; for a
    generic subclass `Family[..., X, ...]`, the argument of the type parameter that
    `Family`'s own bases put there; `None` where that is no parameter of `Family`."""
    origin = typing.get_origin(base)
    if origin is Op:
        (config,) = typing.get_args(base)
        return config
    if not (isinstance(origin, type) and issubclass(origin, Op)):
        return None
    parameters = getattr(origin, "__parameters__", ())
    for inner in origin.__dict__.get("__orig_bases__", ()):
        slot = _config_argument(inner)
        if isinstance(slot, typing.TypeVar) and slot in parameters:
            return typing.get_args(base)[parameters.index(slot)]
    return None


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
        if "config_cls" not in cls.__dict__:
            subscripted = _subscripted_config_cls(cls)
            if subscripted is not None:
                cls.config_cls = subscripted
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
        signature = fwd_signature(type(self))
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
        that op alone, its config pinned (`calls.bind_with_vjp`)."""
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
        if not self.supports_symbolic_shapes and spec.has_symbolic_dims((args, kwargs)):
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
            return fwd_signature(type(self))
        signature = inspect.signature(function.function)
        return signature.replace(parameters=list(signature.parameters.values())[1:])

    def replace(self, **changes: Any) -> Op:
        return dataclasses.replace(self, **changes)

    def get_autotuning_cache(self, device_kind: str | None = None) -> Mapping[str, Mapping]:
        """This op's measurements in the user and library caches for `device_kind` (default:
        the default device's), as upstream Tokamax's `Op.get_autotuning_cache`: `{cache key
        (the call's canonical JSON, `BoundArguments.cache_key`): {config: Measurement}}`,
        the user cache's entry winning over the library's. A read-only snapshot: a write
        raises `TypeError` (it would change no config an op runs)."""
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
            f"tokamax_pass.export(fun, *args, platforms=['{platform}'], device_kind='{kind}') "
            f"(tokamax-pass export --platforms {platform} --device-kind '{kind}'), or trace "
            f"under tokamax_pass.core.targeting('{kind}')")


def family_class(cls: type[Op]) -> type[Op]:
    """The op family of an implementation: the class right under `Op` (or `VjpOp`)."""
    VjpOp = HOOKS.vjp_base
    for klass in cls.__mro__:
        if klass is not VjpOp and (Op in klass.__bases__ or VjpOp in klass.__bases__):
            return klass
    raise TypeError(f"{cls.__name__} is not an Op subclass")


HOOKS.op_base = Op
