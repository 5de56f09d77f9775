"""`triangle_multiplication`: the public function and its implementations."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tokamax_kernels import _dispatch
from tokamax_kernels import _validation as v
from tokamax_kernels.triangle_multiplication.base import (
    OP,
    check_arguments,
    xla_triangle_multiplication,
)
from tokamax_pass.core.errors import all_failed

# Upstream Tokamax's kernel names that have no kernel here: naming one raises
# `NotImplementedError`, so a sequence moves on to the next name.
_ABSENT_KERNELS = ("triton", "mosaic")


def triangle_multiplication(
        x: Any, mask: Any, projection_in_weights: Any, gate_in_weights: Any,
        projection_out_weights: Any, gate_out_weights: Any, layernorm_in_scale: Any,
        layernorm_in_offset: Any, layernorm_out_scale: Any, layernorm_out_offset: Any,
        triangle_type: Literal["incoming", "outgoing"], *, precision: Any = None,
        epsilon: float = 1e-6, implementation: Any = None) -> Any:
    """AlphaFold 2's triangle multiplicative update (Supplementary Algorithms 11, 12).

    `x` (..., N, N, C) is a pair representation and `mask` (..., N, N) (bool, or 0/1
    floats) masks its edges. With `a = layer_norm(x)`, `left, right = sigmoid(a @
    gate_in_weights) * (a @ projection_in_weights)` (weights (C, 2, H): `[:, 0]` left,
    `[:, 1]` right), both times the mask; then per channel, over the third node k,
    `"outgoing"`: `t[i, j] = sum_k left[i, k] * right[j, k]`,
    `"incoming"`: `t[i, j] = sum_k left[k, j] * right[k, i]`;
    the result is `(layer_norm(t) @ projection_out_weights) * sigmoid(a @
    gate_out_weights)`, (..., N, N, D). Both norms use `epsilon`; every product uses
    `precision`.

    `implementation`: `None` or `"xla"`, the composition of `layer_norm`,
    `gated_linear_unit` and XLA einsums (`None` lets those nested ops pick their kernels
    as usual, `"xla"` runs them in XLA too); upstream's `"triton"` and `"mosaic"` have no
    kernel here and raise `NotImplementedError`, as does any other name. A function, or a
    sequence of names and functions, is tried in order until one does not raise
    `NotImplementedError` (as upstream Tokamax does); a function is called as
    `f(x, mask, <the eight weights>, triangle_type, **keywords)` with the keywords this
    call was given.
    """
    arrays = dict(x=x, mask=mask, projection_in_weights=projection_in_weights,
                  gate_in_weights=gate_in_weights, projection_out_weights=projection_out_weights,
                  gate_out_weights=gate_out_weights, layernorm_in_scale=layernorm_in_scale,
                  layernorm_in_offset=layernorm_in_offset,
                  layernorm_out_scale=layernorm_out_scale,
                  layernorm_out_offset=layernorm_out_offset)
    keywords = dict(precision=precision, epsilon=epsilon)

    def run_family(names: Any) -> Any:
        arrays_ = v.numpy_floats_as_jax(arrays)
        check_arguments(**arrays_, triangle_type=triangle_type, precision=precision,
                        epsilon=epsilon)
        nested = _nested_implementation(names)
        return xla_triangle_multiplication(**arrays_, triangle_type=triangle_type,
                                           precision=precision, epsilon=float(epsilon),
                                           implementation=nested)

    return _dispatch.call(
        implementation, run_family,
        lambda f: f(*arrays.values(), triangle_type,
                    **_dispatch.given_keywords(keywords, _DEFAULTS)),
        op=OP)


_DEFAULTS = dict(precision=None, epsilon=1e-6)


def _nested_implementation(implementation: Any) -> str | None:
    """What the nested ops get for `implementation=` (`None` or `"xla"`), or the error
    for an implementation this op does not have."""
    if implementation is None:
        return None
    if isinstance(implementation, str):
        names: Sequence[Any] = (implementation,)
    elif isinstance(implementation, Sequence) and not isinstance(
            implementation, (bytes, bytearray)):
        names = implementation
    else:
        raise TypeError(f"{OP}: implementation must be None, a name, a function or a "
                        f"sequence of those, got {implementation!r}")
    if not names:
        raise ValueError(f"{OP}: implementation must not be an empty sequence")
    failures: list[tuple[str, Exception]] = []
    for name in names:
        if name == "xla":
            return "xla"
        _check_known(name)
        failures.append((name, NotImplementedError(
            f"{OP}: there is no {name!r} kernel in this library; use implementation='xla' "
            f"or None")))
    if len(failures) == 1:
        raise failures[0][1]
    raise all_failed(f"{OP}: no implementation supports these inputs:", failures)


def _check_known(name: Any) -> None:
    """The error for a name that is neither `"xla"` nor one of upstream's kernels, raised
    at once (as upstream Tokamax raises it), so a misspelt name in a sequence is not
    skipped."""
    if not isinstance(name, str):
        raise TypeError(f"{OP}: implementation must be None, a name, a function or a "
                        f"sequence of those; the sequence holds {name!r}")
    if name not in _ABSENT_KERNELS:
        raise NotImplementedError(
            f"{OP}: implementation {name!r} is not supported; valid names are 'xla' (also "
            f"None), and upstream's {list(_ABSENT_KERNELS)}, which have no kernel here")
