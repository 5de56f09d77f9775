"""Op calls as plain parameters: the grids the sweep measures and the random draws the
generalization benchmark times, each rebuilt into the op's arguments by `build`.

A call is `(family, params)`, `params` a flat dict of numbers, names and booleans, so
results files can record it and the calibration fit can rebuild it. Array arguments come
back as `jax.ShapeDtypeStruct`s (the timing fills them with random values); the ones
whose values matter (group sizes, labels) come back concrete.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

FAMILIES = ("ragged_dot", "dot_product_attention", "layer_norm", "gated_linear_unit",
            "linear_softmax_cross_entropy_loss")
DTYPES = ("bfloat16", "float32")
# The largest call a grid holds: the bytes of its inputs and outputs (the backward holds a
# few times that), so the device's memory fits every call's VJP.
MAX_CALL_BYTES = 12 * 2**30
# (K, N) of the expert GEMMs of MoE models people run: fine-grained experts
# (DeepSeek-MoE, Qwen-MoE) and Mixtral-style large ones, both projections.
MOE_K_N = ((2048, 1408), (1408, 2048), (7168, 2048), (2048, 7168), (4096, 14336),
           (14336, 4096), (4096, 4096), (5120, 1536), (1536, 5120))

Params = dict[str, Any]
Arguments = tuple[tuple[Any, ...], dict[str, Any]]


def _sds(shape: tuple[int, ...], dtype: str) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def group_sizes(groups: int, rows_per_group: int, skewed: bool, seed: int) -> np.ndarray:
    """`groups` sizes summing to `groups * rows_per_group`: equal, or skewed as a router
    skews them (a few experts take most tokens: sizes drawn from a Zipf-like law)."""
    total = groups * rows_per_group
    if not skewed:
        return np.full(groups, rows_per_group, np.int32)
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, groups + 1) ** 1.1
    weights = rng.permutation(weights)
    sizes = np.floor(weights / weights.sum() * total).astype(np.int64)
    sizes[np.argmax(sizes)] += total - sizes.sum()
    return sizes.astype(np.int32)


def build(family: str, params: Params, seed: int = 0) -> Arguments:
    """The `(args, kwargs)` of the `family` call `params` describes."""
    try:
        builder = _BUILDERS[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}") from None
    return builder(params, seed)


def _ragged_dot(p: Params, seed: int) -> Arguments:
    g, rows, k, n = p["groups"], p["rows_per_group"], p["k"], p["n"]
    sizes = group_sizes(g, rows, p["skewed"], seed)
    return (_sds((g * rows, k), p["dtype"]), _sds((g, k, n), p["dtype"]),
            jnp.asarray(sizes)), {}


def _attention(p: Params, seed: int) -> Arguments:
    del seed
    b, s, h, d = p["batch"], p["seq"], p["heads"], p["head_dim"]
    kv = h // p["gqa"]
    q = _sds((b, s, h, d), p["dtype"])
    k = _sds((b, s, kv, d), p["dtype"])
    return (q, k, _sds((b, s, kv, d), p["dtype"])), {"is_causal": p["causal"]}


def _layer_norm(p: Params, seed: int) -> Arguments:
    del seed
    rows, width = p["rows"], p["width"]
    offset = _sds((width,), p["dtype"]) if p["offset"] else None
    return ((_sds((rows, width), p["dtype"]), _sds((width,), p["dtype"]), offset),
            {"subtract_mean": p["subtract_mean"]})


def _glu(p: Params, seed: int) -> Arguments:
    del seed
    return (_sds((p["rows"], p["k"]), p["dtype"]), _sds((p["k"], 2, p["n"]), p["dtype"])), {}


def _lce(p: Params, seed: int) -> Arguments:
    tokens, hidden, vocab = p["tokens"], p["hidden"], p["vocab"]
    labels = np.random.default_rng(seed).integers(0, vocab, tokens, dtype=np.int32)
    return (_sds((tokens, hidden), p["dtype"]), jnp.asarray(labels),
            _sds((hidden, vocab), p["dtype"])), {}


_BUILDERS: dict[str, Callable[[Params, int], Arguments]] = {
    "ragged_dot": _ragged_dot, "dot_product_attention": _attention, "layer_norm": _layer_norm,
    "gated_linear_unit": _glu, "linear_softmax_cross_entropy_loss": _lce,
}


def call_bytes(family: str, p: Params) -> int:
    """Bytes of the call's inputs and output (the bound every grid point stays under)."""
    size = jnp.dtype(p["dtype"]).itemsize
    if family == "ragged_dot":
        m = p["groups"] * p["rows_per_group"]
        return size * (m * p["k"] + p["groups"] * p["k"] * p["n"] + m * p["n"])
    if family == "dot_product_attention":
        tokens = p["batch"] * p["seq"]
        # The XLA reference holds the float32 logits.
        return size * tokens * p["head_dim"] * p["heads"] * 3 + 4 * p["batch"] * p["heads"] * \
            p["seq"] ** 2
    if family == "layer_norm":
        return size * 2 * p["rows"] * p["width"]
    if family == "gated_linear_unit":
        return size * (p["rows"] * p["k"] + 2 * p["k"] * p["n"] + 3 * p["rows"] * p["n"])
    if family == "linear_softmax_cross_entropy_loss":
        # The XLA reference holds the float32 logits.
        return size * (p["tokens"] * p["hidden"] + p["hidden"] * p["vocab"]) + \
            4 * p["tokens"] * p["vocab"]
    raise ValueError(f"unknown family {family!r}")


def _product(**axes: tuple[Any, ...]) -> Iterator[Params]:
    names = list(axes)
    for values in itertools.product(*axes.values()):
        yield dict(zip(names, values, strict=True))


def _full_grid(family: str) -> Iterator[Params]:
    if family == "ragged_dot":
        for p in _product(groups=(8, 16, 32, 64, 128, 256),
                          rows_per_group=(8, 32, 128, 512, 2048, 8192), k_n=MOE_K_N,
                          skewed=(False, True), dtype=DTYPES):
            k, n = p.pop("k_n")
            yield {**p, "k": k, "n": n}
    elif family == "dot_product_attention":
        for p in _product(seq=(256, 512, 1024, 2048, 4096, 8192, 16384), head_dim=(64, 128, 256),
                          heads=(8, 16, 32), gqa=(1, 4, 8), causal=(False, True), dtype=DTYPES):
            yield {**p, "batch": max(1, 16384 // p["seq"])}
    elif family == "layer_norm":
        yield from _product(rows=(1024, 4096, 16384, 65536, 262144),
                            width=(256, 768, 1024, 2048, 4096, 5120, 8192, 16384),
                            offset=(False, True), subtract_mean=(False, True), dtype=DTYPES)
    elif family == "gated_linear_unit":
        yield from _product(rows=(256, 1024, 4096, 16384), k=(1024, 2048, 4096, 8192),
                            n=(1408, 2816, 5632, 11008, 14336), dtype=DTYPES)
    elif family == "linear_softmax_cross_entropy_loss":
        yield from _product(tokens=(1024, 4096, 16384, 65536), hidden=(1024, 2048, 4096, 8192),
                            vocab=(32000, 128256, 256000), dtype=DTYPES)
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def _tiny_grid(family: str) -> Iterator[Params]:
    """A few small calls per family, for a CPU run of the tools."""
    if family == "ragged_dot":
        yield from _product(groups=(2, 4), rows_per_group=(8,), k=(16,), n=(32,),
                            skewed=(False, True), dtype=("float32",))
    elif family == "dot_product_attention":
        yield from _product(seq=(16, 32), head_dim=(16,), heads=(2,), gqa=(1, 2),
                            causal=(False,), dtype=("float32",), batch=(2,))
    elif family == "layer_norm":
        yield from _product(rows=(16, 64), width=(32,), offset=(True,), subtract_mean=(True,),
                            dtype=("float32",))
    elif family == "gated_linear_unit":
        yield from _product(rows=(16, 32), k=(16,), n=(32,), dtype=("float32",))
    elif family == "linear_softmax_cross_entropy_loss":
        yield from _product(tokens=(16, 32), hidden=(16,), vocab=(64,), dtype=("float32",))
    else:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")


def grid(family: str, tiny: bool = False) -> list[Params]:
    """The sweep's calls of `family` that fit under `MAX_CALL_BYTES`."""
    calls = _tiny_grid(family) if tiny else _full_grid(family)
    return [p for p in calls if call_bytes(family, p) <= MAX_CALL_BYTES]


def draw(family: str, rng: random.Random, tiny: bool = False) -> Params:
    """One call drawn at random inside the family's documented range (off the grid: sizes
    are drawn in log space, then rounded to what models use)."""
    def log_int(low: int, high: int, multiple: int = 1) -> int:
        value = round(2 ** rng.uniform(np.log2(low), np.log2(high)))
        return max(multiple, value // multiple * multiple)

    scale = 64 if tiny else 1
    for _ in range(1000):
        dtype = rng.choice(DTYPES if not tiny else ("float32",))
        if family == "ragged_dot":
            k, n = (log_int(16, 32), log_int(16, 32)) if tiny else rng.choice(MOE_K_N)
            p = {"groups": log_int(2, 4) if tiny else log_int(8, 256),
                 "rows_per_group": log_int(4, 16) if tiny else log_int(8, 8192),
                 "k": k, "n": n, "skewed": rng.random() < 0.5, "dtype": dtype}
        elif family == "dot_product_attention":
            seq = log_int(16, 32, 8) if tiny else log_int(256, 16384, 128)
            p = {"seq": seq, "head_dim": 16 if tiny else rng.choice((64, 128, 256)),
                 "heads": 2 if tiny else rng.choice((8, 16, 32)),
                 "gqa": rng.choice((1, 2) if tiny else (1, 2, 4, 8)),
                 "causal": rng.random() < 0.5, "dtype": dtype,
                 "batch": 2 if tiny else max(1, 16384 // seq)}
        elif family == "layer_norm":
            p = {"rows": log_int(1024 // scale, 262144 // scale),
                 "width": log_int(max(8, 256 // scale), 16384 // scale, 8 if tiny else 128),
                 "offset": rng.random() < 0.5, "subtract_mean": rng.random() < 0.5,
                 "dtype": dtype}
        elif family == "gated_linear_unit":
            p = {"rows": log_int(256 // scale * 4, 16384 // scale),
                 "k": log_int(16, 32, 8) if tiny else log_int(1024, 8192, 128),
                 "n": log_int(16, 32, 8) if tiny else log_int(1024, 14336, 128),
                 "dtype": dtype}
        elif family == "linear_softmax_cross_entropy_loss":
            p = {"tokens": log_int(1024 // scale, 65536 // scale),
                 "hidden": log_int(16, 32, 8) if tiny else log_int(1024, 8192, 128),
                 "vocab": log_int(32, 128) if tiny else log_int(32000, 256000, 128),
                 "dtype": dtype}
        else:
            raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
        if call_bytes(family, p) <= MAX_CALL_BYTES:
            return p
    raise RuntimeError(f"no {family} call under {MAX_CALL_BYTES} bytes drawn")
