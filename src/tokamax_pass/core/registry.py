"""Op families and their implementations; the `implementation=` rule.

`implementation=None` takes the family's automatic list (GPU kernels first, `xla`
last, so it always works), from which `core.selection` runs a kernel only where a
measurement shows it beating the plain-JAX paths; a name tries that implementation alone and raises
its `NotImplementedError` when it cannot run; a sequence tries each in order. An
alias names several implementations, tried in order (`"mosaic"`: the Mosaic GPU and
the Mosaic TPU kernel, so each platform gets its own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tokamax_pass.core import calls, spec
from tokamax_pass.core.op import Op, family_class

Implementation = str | Op | Sequence[str | Op] | None


@dataclasses.dataclass(frozen=True)
class Family:
    """An op family: implementation classes by name, the order `None` tries them, and
    aliases (a name for several implementations, e.g. one per platform)."""

    name: str
    implementations: Mapping[str, type[Op]]
    automatic: tuple[str, ...]
    aliases: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.automatic or self.automatic[-1] != "xla":
            raise ValueError(f"family {self.name!r}: the automatic list must end with 'xla'")
        unknown = set(self.automatic) - set(self.implementations)
        if unknown:
            raise ValueError(f"family {self.name!r}: unknown automatic names {sorted(unknown)}")
        for alias, names in self.aliases.items():
            if alias in self.implementations or not set(names) <= set(self.implementations):
                raise ValueError(f"family {self.name!r}: alias {alias!r} must be a new name for "
                                 f"implementations, got {names!r}")

    def resolve(self, implementation: Implementation) -> tuple[tuple[Op, ...], bool]:
        """`(candidate ops, explicit)` for an `implementation=` argument."""
        if implementation is None:
            return tuple(self.implementations[n]() for n in self.automatic), False
        if isinstance(implementation, (str, Op)):
            items = [implementation]
        elif isinstance(implementation, Sequence) and not isinstance(
                implementation, (bytes, bytearray)):  # bytes iterate as ints
            items = list(implementation)
        else:
            raise TypeError(
                f"{self.name}: implementation must be None, a name, an Op instance of the "
                f"family or a sequence of those, got {implementation!r}")
        if not items:
            raise ValueError(f"{self.name}: implementation must not be an empty sequence")
        ops = []
        for item in items:
            if isinstance(item, Op):
                self._check_own_op(item)
                ops.append(item)
            elif not isinstance(item, str):  # a nested list is unhashable: `in` raised
                raise TypeError(
                    f"{self.name}: implementation must be None, a name, an Op instance of "
                    f"the family or a flat sequence of those; the sequence holds {item!r}")
            elif item in self.implementations:
                ops.append(self.implementations[item]())
            elif item in self.aliases:
                ops.extend(self.implementations[name]() for name in self.aliases[item])
            else:
                raise ValueError(
                    f"{self.name}: unknown implementation {item!r}; valid names are "
                    f"{sorted([*self.implementations, *self.aliases])} or None"
                )
        return tuple(ops), True

    def _check_own_op(self, op: Op) -> None:
        """`TypeError` for an op instance of another family (or a VJP op): its `bind` would
        fail on this family's arguments with a message that does not say why."""
        if family_class(type(op)) is not family_class(self.implementations["xla"]):
            raise TypeError(
                f"{self.name}: implementation={type(op).__name__}() is an op of another "
                f"family ({op.family_name()}); pass one of {self.name}'s implementations, "
                f"e.g. {self.implementations['xla'].__name__}(), or a name from "
                f"{sorted(self.implementations)}")

    def __call__(self, implementation: Implementation, *args: Any,
                 return_residuals: bool = False, **kwargs: Any) -> Any:
        """Calls the family; `return_residuals=True` returns `(out, residuals)` with the
        residuals in the family's own form, differentiable (`calls.bind_with_vjp`)."""
        ops, explicit = self.resolve(implementation)
        return calls.call_ops(ops, args, kwargs, explicit=explicit,
                                  return_residuals=return_residuals)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Adds `family`, and allows specs to name its implementations, their VJP ops and
    their configs (`spec.register_serializable`)."""
    _FAMILIES[family.name] = family
    for cls in family.implementations.values():
        vjp = _vjp_op_or_none(cls)
        for member in (cls, *(() if vjp is None else (type(vjp),))):
            for base in member.__mro__:
                if issubclass(base, Op) and base is not Op and not spec.is_registered(base):
                    spec.register_serializable(base)
    return family


def families() -> Mapping[str, Family]:
    return dict(_FAMILIES)


def implementations_of(op: Op) -> list[Op]:
    """Every registered implementation of `op`'s family (for `all_implementations`).

    A VJP op's alternatives are the VJP ops of its forward family's implementations:
    the candidates `implementation=None` ranks for the backward pass.
    """
    family = _FAMILIES.get(op.family_name())
    if family is not None:
        return [cls() for cls in family.implementations.values()]
    for family in _FAMILIES.values():
        vjps = list(dict.fromkeys(_vjp_op_or_none(cls) for cls in family.implementations.values()))
        if any(_same_kind(v, op) for v in vjps if v is not None):
            return [v for v in vjps if v is not None]
    return [op]


def _vjp_op_or_none(cls: type[Op]) -> Op | None:
    try:
        return cls().vjp_op()
    except Exception:  # noqa: BLE001 - an implementation that cannot say has no VJP op here
        return None


def _same_kind(a: Op, b: Op) -> bool:
    """Same op class (and, for an autodiff VJP, the same forward class), configs aside."""
    forward_a, forward_b = getattr(a, "forward", None), getattr(b, "forward", None)
    return type(a) is type(b) and type(forward_a) is type(forward_b)
