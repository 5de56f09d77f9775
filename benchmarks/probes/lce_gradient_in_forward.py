"""Device probe: the LM-head loss with its gradients computed during the forward pass.

    PYTHONPATH=src:kernels:. python3 -m benchmarks.probes.lce_gradient_in_forward --out FILE.jsonl
        [--tiny] [--hand-written]

A scalar loss ends the graph, so its cotangent is one number: the forward can compute
`dx` and `dweights` one token chunk at a time (the chunk's logits, their softmax, then
both gradient products) and the backward only scales them, as Liger-Kernel's fused
linear cross entropy does. Three GEMMs in all (plain JAX's count) with a (chunk, V)
tile of logits in place of the (tokens, V) ones, at the price of a (H, V) accumulator
for `dweights` that every chunk reads and writes. The question: does that beat plain
JAX's time with half its temporaries, where the log-sum-exp recomputation of our `xla`
and `xla_chunked` paths cannot?

The candidates go through the public op: `xla`, `xla_chunked` with its recomputing
backward (`gradients="backward"`, the heuristic tiles), `xla_chunked` with its
gradients in the forward pass at each chunk size (a pinned config), and
`implementation=None`. `--hand-written` adds the custom-VJP sketch below
(float32 and bf16 dweights accumulators), which the library mode was built from.

One JSON line per (shape, candidate): forward+backward device time (CUPTI, median of 10
after warm-up), compiled temporaries (MB), both against plain JAX in the same run, and
the gradients' relative error against plain JAX's (bf16 inputs; the same order as our
`xla` path's error, printed beside it, is what "matches" means here).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks import sweep, workloads
from benchmarks.probes._probe import relative_error
from benchmarks.probes.lce_chunk_sweep import lm_head_inputs, plain_and_xla, time_against_plain
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    XlaChunkedLinearSoftmaxCrossEntropyLoss,
    XlaChunkedLossConfig,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.xla_chunked import heuristic_config

SHAPES = ((16384, 4096, 128256), (8192, 2304, 256000))
TINY = ((64, 32, 300),)
CHUNKS = (1024, 2048, 4096)
TINY_CHUNKS = (16, 32)


def _loss_and_gradients(x: jax.Array, labels: jax.Array, w: jax.Array, chunk: int,
                        accumulator: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The mean loss over labels >= 0 and its gradients for a cotangent of 1, one chunk
    of `chunk` tokens at a time; `dweights` summed in `accumulator`'s dtype."""
    tokens, hidden = x.shape
    vocab = w.shape[1]
    counted = labels >= 0
    count = jnp.maximum(jnp.sum(counted), 1).astype(jnp.float32)

    def body(dw: jax.Array, chunk_in: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, Any]:
        xc, lc = chunk_in
        logits = jnp.matmul(xc, w).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, jnp.maximum(lc, 0)[:, None], axis=-1)[:, 0]
        valid = lc >= 0
        loss = jnp.sum(jnp.where(valid, lse - picked, 0.0))
        weight = jnp.where(valid, 1.0, 0.0) / count
        onehot = lc[:, None] == jnp.arange(vocab)
        dlogits = ((jnp.exp(logits - lse[:, None]) - onehot) * weight[:, None]).astype(x.dtype)
        dxc = jnp.matmul(dlogits, w.T)
        dw = dw + jnp.matmul(xc.T, dlogits, preferred_element_type=dw.dtype)
        return dw, (loss, dxc)

    n = tokens // chunk
    dw, (losses, dx) = jax.lax.scan(
        body, jnp.zeros((hidden, vocab), accumulator),
        (x.reshape(n, chunk, hidden), labels.reshape(n, chunk)))
    return jnp.sum(losses) / count, dx.reshape(tokens, hidden), dw.astype(w.dtype)


def gradient_in_forward(chunk: int, accumulator: Any) -> Callable[..., jax.Array]:
    """`(x, labels, w) -> mean loss` whose forward, when differentiated, computes both
    gradients and whose backward scales them by the loss's cotangent."""

    def loss(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
        @jax.custom_vjp
        def f(x: jax.Array, w: jax.Array) -> jax.Array:
            return workloads._plain_lce(x, labels, w)

        def f_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, Any]:
            value, dx, dw = _loss_and_gradients(x, labels, w, chunk, accumulator)
            return value, (dx, dw)

        def f_bwd(residuals: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
            dx, dw = residuals
            return (dx * g).astype(dx.dtype), (dw * g).astype(dw.dtype)

        f.defvjp(f_fwd, f_bwd)
        return f(x, w)

    return loss


def _public(implementation: Any) -> Callable[..., jax.Array]:
    """`(x, labels, w) -> mean loss` through the public op with `implementation`."""

    def loss(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
        return tokamax.linear_softmax_cross_entropy_loss(
            x, labels, w, reduction="mean", implementation=implementation)

    return loss


def _chunked(config: XlaChunkedLossConfig) -> Callable[..., jax.Array]:
    return _public(XlaChunkedLinearSoftmaxCrossEntropyLoss(config=config))


def library_candidates(tokens: int, v: int,
                       chunks: tuple[int, ...]) -> dict[str, Callable[..., jax.Array]]:
    """Plain JAX, then our implementations through the public op (see the docstring)."""
    tiles = heuristic_config(tokens, v)
    candidates = plain_and_xla()
    candidates["xla_chunked, recomputing backward"] = _chunked(tiles)
    for chunk in chunks:
        config = dataclasses.replace(tiles, gradients="forward", chunk_tokens=chunk)
        candidates[f"xla_chunked, gradients in forward, {chunk} tokens"] = _chunked(config)
    candidates["implementation=None"] = _public(None)
    return candidates


def hand_written(chunks: tuple[int, ...]) -> dict[str, Callable[..., jax.Array]]:
    """The custom-VJP sketch at each chunk, float32 and bf16 dweights accumulators."""
    candidates = {}
    for chunk in chunks:
        for accumulator in (jnp.float32, jnp.bfloat16):
            name = f"gradient in forward {chunk} tokens, {jnp.dtype(accumulator).name} dw"
            candidates[name] = gradient_in_forward(chunk, accumulator)
    return candidates


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.lce_gradient_in_forward")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes (any machine)")
    parser.add_argument("--hand-written", action="store_true",
                        help="also the custom-VJP sketch (see hand_written)")
    args = parser.parse_args()
    shapes, chunks = (TINY, TINY_CHUNKS) if args.tiny else (SHAPES, CHUNKS)
    with open(args.out, "w") as out:
        out.write(json.dumps({"provenance": {
            "commit": sweep.source_commit(), "jax": jax.__version__,
            "device_kind": jax.devices()[0].device_kind}}) + "\n")
        for tokens, h, v in shapes:
            x, labels, w = lm_head_inputs(tokens, h, v)
            candidates = library_candidates(tokens, v, chunks)
            if args.hand_written:
                candidates |= hand_written(chunks)
            plain: dict[str, Any] | None = None
            plain_grads = None
            for name, fn in candidates.items():
                row: dict[str, Any] = {"shape": [tokens, h, v], "candidate": name}
                try:
                    grads = jax.jit(jax.grad(
                        lambda x, w, fn=fn, labels=labels: fn(x, labels, w),
                        argnums=(0, 1)))(x, w)
                except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                else:
                    plain_grads = plain_grads or grads
                    row["dx_error"] = relative_error(grads[0], plain_grads[0])
                    row["dw_error"] = relative_error(grads[1], plain_grads[1])
                    del grads
                    plain = time_against_plain(row, fn, x, labels, w, plain)
                out.write(json.dumps(row) + "\n")
                out.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
