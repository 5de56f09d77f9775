"""Device sweep: `xla_chunked` linear softmax cross entropy over tile sizes, against plain JAX.

    PYTHONPATH=src:kernels:. python3 benchmarks/probes/lce_chunk_sweep.py --out sweep.jsonl

One JSON line per (shape, implementation/config): forward+backward device time (CUPTI,
median of 10 after warm-up), the compiled temporaries (MB) and the ratio to plain JAX's
time and temporaries in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks import workloads
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLinearSoftmaxCrossEntropyLossVjp,
    XlaChunkedLossConfig,
)
from tokamax_pass import benchmarking

SHAPES = ((16384, 4096, 128256), (16384, 2048, 32000))
SMALL = ((64, 32, 300),)
TILES = ((16384, 2048), (16384, 4096), (8192, 4096), (4096, 8192), (1024, 4096))


def lm_head_inputs(tokens: int, h: int, v: int) -> tuple[jax.Array, ...]:
    """bf16 `(x, labels, w)`: normal tokens, weights scaled by 1/sqrt(h), one label in
    eight ignored (-1)."""
    labels = jax.random.randint(jax.random.key(2), (tokens,), 0, v)
    ignored = jax.random.bernoulli(jax.random.key(3), 0.125, (tokens,))
    x = jax.random.normal(jax.random.key(0), (tokens, h), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (h, v)) / math.sqrt(h)).astype(jnp.bfloat16)
    return x, jnp.where(ignored, -1, labels), w


def _ours(tile: tuple[int, int]):
    config = XlaChunkedLossConfig(*tile)
    op = XlaChunkedLinearSoftmaxCrossEntropyLoss(
        config=config, vjp=XlaChunkedLinearSoftmaxCrossEntropyLossVjp(config=config))
    return lambda x, labels, w: tokamax.linear_softmax_cross_entropy_loss(
        x, labels, w, reduction="mean", implementation=op)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes (any machine)")
    args = parser.parse_args()
    shapes, tiles = ((((64, 32, 300),), ((64, 128), (16, 64))) if args.tiny
                     else (SHAPES, TILES))
    with open(args.out, "w") as out:
        for tokens, h, v in shapes:
            x, labels, w = lm_head_inputs(tokens, h, v)
            candidates = plain_and_xla()
            for tile in tiles:
                candidates[f"xla_chunked {tile[0]}x{tile[1]}"] = _ours(tile)
            plain: dict[str, Any] | None = None
            for name, fn in candidates.items():
                row = {"shape": [tokens, h, v], "candidate": name}
                plain = time_against_plain(row, fn, x, labels, w, plain)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)


def plain_and_xla() -> dict[str, Callable[..., jax.Array]]:
    """The two candidates every LM-head probe starts from: plain JAX (optax-style) and our
    `xla` path, each `(x, labels, w) -> mean loss`."""
    return {"plain": workloads._plain_lce,
            "xla": lambda x, labels, w: tokamax.linear_softmax_cross_entropy_loss(
                x, labels, w, reduction="mean", implementation="xla")}


def time_against_plain(row: dict[str, Any], fn: Callable[..., jax.Array], x: jax.Array,
                       labels: jax.Array, w: jax.Array,
                       plain: dict[str, Any] | None) -> dict[str, Any] | None:
    """Adds `fn(x, labels, w)`'s forward+backward time and temporaries to `row`, with
    their ratios to `plain`'s row (`row` itself where `plain` is `None`), or the error
    it failed with; returns the plain row for the next candidate."""
    try:
        data = benchmarking.benchmark(
            lambda x, w: fn(x, labels, w), x, w, mode="forward_and_vjp", iterations=10)
    except Exception as e:  # noqa: BLE001 - a failing candidate is a result
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        return plain
    row["ms"] = data.median_evaluation_time_ms
    row["temp_mb"] = data.temp_memory_mb
    plain = plain or row
    row["time_vs_plain"] = plain["ms"] / row["ms"]
    row["temp_vs_plain"] = row["temp_mb"] / plain["temp_mb"]
    return plain


if __name__ == "__main__":
    main()
