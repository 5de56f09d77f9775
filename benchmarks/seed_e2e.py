"""The seed model end to end on the device: plain JAX vs tokamax_pass, untuned and tuned.

    python -m benchmarks.seed_e2e [--artifact DIR] [--output FILE]

Times `grad(loss)` of the seed model (layer norm -> attention -> layer norm ->
attention; x bf16[32,2048,16,64]) as
  - plain JAX: XLA layer norm (f32 math) + `jax.nn.dot_product_attention(cudnn)`,
  - `jax.jit(jax.grad(loss))` with every tokamax implementation `None`,
  - `tokamax.optimize(jax.grad(loss))` (the shipped cache, then heuristics),
  - the same after `tokamax.autotune` (its wall time reported),
the forward+backward of one attention and one layer norm (plain against ours), and,
with `--artifact`, checks that an artifact exported on a CPU machine for cuda gives
the in-process result here (in process with the kernels the artifact names).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import tokamax_pass as tokamax
from benchmarks.sweep import source_commit
from examples import seed_model
from tokamax_pass import benchmarking
from tokamax_pass.core.atomic_io import write_atomic

SHAPE = (32, 2048, 16, 64)


def plain_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf - xf.mean(-1, keepdims=True)
    return (xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def plain_attention(x: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(x, x, x, implementation="cudnn")


def plain_jax_loss(x: jax.Array, scale: jax.Array) -> jax.Array:
    x = plain_attention(plain_norm(x, scale))
    x = plain_attention(plain_norm(x, scale))
    return jnp.sum(x.astype(jnp.float32))


def device_ms(f, *args, iterations: int = 20) -> float:
    return benchmarking.benchmark(f, *args, iterations=iterations).median_evaluation_time_ms


def components(x: jax.Array, scale: jax.Array) -> dict[str, float]:
    """Device ms of one layer's forward+backward, plain JAX against ours (`None`)."""
    def grad_ms(f, *args):
        return device_ms(jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)))), *args)

    return {
        "attention_plain_cudnn_ms": grad_ms(plain_attention, x),
        "attention_ours_ms": grad_ms(lambda x: tokamax.dot_product_attention(x, x, x), x),
        "layer_norm_plain_xla_ms": grad_ms(plain_norm, x, scale),
        "layer_norm_ours_ms": grad_ms(
            lambda x, s: tokamax.layer_norm(x, scale=s, offset=None), x, scale),
    }


def artifact_kernels(directory: str) -> dict[str, str]:
    """{op name: implementation} of the artifact's cuda forward ops, from its manifest."""
    ops = json.loads((pathlib.Path(directory) / "manifest.json").read_text())["ops"]
    return {op["path"].rsplit("/", 1)[-1]: op["implementation"] for op in ops
            if op["platform"] == "cuda" and not op["path"].endswith("_vjp")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.seed_e2e", description=__doc__)
    parser.add_argument("--artifact", help="an artifact directory exported for cuda")
    parser.add_argument("--output", default="seed_e2e.json")
    args = parser.parse_args(argv)
    x = jax.random.normal(jax.random.key(1), SHAPE, jnp.bfloat16)
    scale = jax.random.normal(jax.random.key(0), (SHAPE[-1],), jnp.float32)
    results: dict[str, object] = {
        "provenance": {"commit": source_commit(), "jax": jax.__version__,
                       "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")},
        "device_kind": jax.devices()[0].device_kind}
    output = pathlib.Path(args.output)

    def record(key: str, value: object) -> None:  # written at once: a cut-short run keeps it
        results[key] = value
        print(f"{key}: {value}", flush=True)
        write_atomic(output, json.dumps(results, indent=1))

    plain = jax.jit(jax.grad(plain_jax_loss))
    ours_jit = jax.jit(seed_model.loss_grad)
    ours_optimized = tokamax.optimize(seed_model.loss_grad)
    record("plain_jax_cudnn_ms", device_ms(plain, x, scale))
    record("tokamax_jit_none_ms", device_ms(ours_jit, x, scale))
    record("tokamax_optimize_ms", device_ms(ours_optimized, x, scale))
    record("plan", str(ours_optimized.plan(x, scale)))
    reference = np.asarray(plain(x, scale), np.float32)
    ours = np.asarray(ours_optimized(x, scale), np.float32)
    record("relative_difference_vs_plain",
           float(np.linalg.norm(ours - reference) / np.linalg.norm(reference)))

    record("components", components(x, scale))

    if args.artifact:
        # In process with the kernels the artifact chose (a CPU machine cannot lower
        # cuDNN, so its `None` picked other kernels than this GPU's `None` does).
        kernels = artifact_kernels(args.artifact)
        record("artifact_kernels", kernels)
        pinned = jax.jit(jax.grad(seed_model.make_loss(
            attention=kernels["dot_product_attention"], norm=kernels["layer_norm"])))
        loaded = tokamax.load_artifact(args.artifact)
        exported = np.asarray(loaded(x, scale), np.float32)
        in_process = np.asarray(pinned(x, scale), np.float32)
        record("artifact_max_abs_difference", float(np.max(np.abs(exported - in_process))))
        record("artifact_relative_difference",
               float(np.linalg.norm(exported - in_process) / np.linalg.norm(in_process)))
        record("artifact_bitwise_equal", bool(np.array_equal(exported, in_process)))
        record("artifact_ms", device_ms(loaded, x, scale))

    start = time.perf_counter()
    tuned = tokamax.autotune(seed_model.loss_grad, x, scale, progress=False)
    record("autotune_s", time.perf_counter() - start)
    record("autotune_result", repr(tuned))
    with tuned:
        record("tokamax_tuned_ms", device_ms(jax.jit(seed_model.loss_grad), x, scale))

    return 0


if __name__ == "__main__":
    sys.exit(main())
