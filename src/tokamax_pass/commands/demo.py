"""`tokamax-pass demo`: the seed example end to end on this machine, with a table of op calls.

The seed's `loss` (two layer norms, two attentions, implementations `triton`,
`xla_chunked`, `None`, `mosaic`) under `jax.jit(jax.grad(loss))`. Where an
implementation cannot run here (no GPU), the demo says why and uses `None`.
It then runs the gradient through `tokamax.optimize` and `tokamax.autotune`, and
lists every op call of the gradient program (forward and VJP ops): the
implementation chosen, its config, and its device time. It exits with status 1 when
any op call fails to run.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from tokamax_pass import benchmarking
from tokamax_pass.autotuning import discovery, timing_inputs
from tokamax_pass.commands import _argtypes
from tokamax_pass.core import BoundArguments, current_target, registry, spec
from tokamax_pass.tables import render_table

SEED_IMPLEMENTATIONS = (
    ("layer_norm", "triton"),
    ("dot_product_attention", "xla_chunked"),
    ("layer_norm", None),
    ("dot_product_attention", "mosaic"),
)
# (batch, seq, heads, head_dim): the seed's shape on a GPU, scaled down elsewhere.
SEED_SHAPE = (32, 2048, 16, 64)
CPU_SHAPE = (2, 256, 4, 64)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("demo", help="run the seed example and show its op calls")
    parser.add_argument("--shape", type=_argtypes.positive_int, nargs=4,
                        metavar=("B", "S", "H", "D"),
                        help=f"(default: {SEED_SHAPE} on a GPU, {CPU_SHAPE} elsewhere)")
    parser.add_argument("--iterations", type=_argtypes.positive_int, default=10)
    parser.add_argument("--no-autotune", dest="autotune", action="store_false",
                        help="skip autotuning the gradient program")


def runnable_implementations() -> tuple[list[Any], list[str]]:
    """The seed's implementations, with `None` for those that cannot run here (and why)."""
    target = current_target()
    for family_name in {name for name, _ in SEED_IMPLEMENTATIONS}:
        getattr(tokamax, family_name)  # imports the op family, which registers it
    chosen, notes = [], []
    for family_name, requested in SEED_IMPLEMENTATIONS:
        implementation = requested
        if implementation is not None:
            # A name may stand for several implementations ("mosaic": one per platform).
            ops, _ = registry.families()[family_name].resolve(implementation)
            reasons = []
            for op in ops:
                try:
                    op.check_supported_target(target)
                except NotImplementedError as e:
                    reasons.append(str(e))
            if len(reasons) == len(ops):
                notes.append(f"{family_name} implementation={implementation!r} -> None: "
                             + "; ".join(reasons))
                implementation = None
        chosen.append(implementation)
    return chosen, notes


def seed_loss(implementations: list[Any]):
    ln_first, attn_first, ln_second, attn_second = implementations

    def loss(x, scale):
        x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=ln_first)
        x = tokamax.dot_product_attention(x, x, x, implementation=attn_first)
        x = tokamax.layer_norm(x, scale=scale, offset=None, implementation=ln_second)
        x = tokamax.dot_product_attention(x, x, x, implementation=attn_second)
        return jnp.sum(x)

    return loss


def op_calls(f: Any, *args: Any) -> list[BoundArguments]:
    """Every distinct op call in `f`'s lowered program, with the config it lowered with."""
    text = jax.jit(f).lower(*args).as_text()
    return list({ba.to_json(): ba for ba in map(
        BoundArguments.from_json, discovery.specs_from_text(text))}.values())


def op_time_ms(ba: BoundArguments, iterations: int) -> float:
    arguments = timing_inputs.timing_arguments(ba, seed=0)
    data = benchmarking.benchmark(lambda a: ba.op(**a), arguments, iterations=iterations)
    return data.median_evaluation_time_ms


def _config_text(config: Any) -> str:
    fields = spec.encode_config(config) or {}
    return ", ".join(f"{k}={v}" for k, v in fields.items()) or "-"


def _arrays_text(ba: BoundArguments) -> str:
    return " ".join(spec.array_spec(v) for v in jax.tree.leaves(dict(ba.arguments))
                    if spec.is_array(v))[:60]


def run(args: argparse.Namespace) -> int:
    on_gpu = current_target().is_gpu
    b, s, h, d = args.shape or (SEED_SHAPE if on_gpu else CPU_SHAPE)
    implementations, notes = runnable_implementations()
    scale = jax.random.normal(jax.random.key(0), (d,), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (b, s, h, d), jnp.bfloat16)
    f_grad = jax.jit(jax.grad(seed_loss(implementations)))

    print(f"tokamax_pass demo on {current_target().device_kind} (x: bf16[{b},{s},{h},{d}])")
    for note in notes:
        print(f"  note: {note}")
    out = jax.block_until_ready(f_grad(x, scale))
    print(f"  grad: {spec.array_spec(out)}, finite: {bool(jnp.isfinite(out).all())}")
    total = benchmarking.benchmark(f_grad, x, scale, iterations=args.iterations)
    print(f"  jax.jit(jax.grad(loss)): {total.median_evaluation_time_ms:.3f} ms "
          f"({total.method}, median of {args.iterations})")

    optimized = tokamax.optimize(jax.grad(seed_loss(implementations)))
    same = bool(jnp.array_equal(optimized(x, scale), out))
    time_ms = benchmarking.benchmark(optimized, x, scale, iterations=args.iterations)
    print(f"  tokamax.optimize(jax.grad(loss)): {time_ms.median_evaluation_time_ms:.3f} ms "
          f"(same result as jax.jit: {same})")
    if args.autotune:
        start = time.perf_counter()
        result = tokamax.autotune(f_grad, x, scale, progress=False)
        seconds = time.perf_counter() - start
        with result:
            tuned = benchmarking.benchmark(f_grad, x, scale, iterations=args.iterations)
        print(f"  tokamax.autotune: {len(list(result))} op calls tuned in {seconds:.1f} s; "
              f"tuned: {tuned.median_evaluation_time_ms:.3f} ms")
    print()

    rows: list[tuple[str, ...]] = []
    failed = []
    for ba in op_calls(jax.grad(seed_loss(implementations)), x, scale):
        call_ms = functools.partial(op_time_ms, ba, args.iterations)
        try:
            ms = f"{call_ms():.3f}"
        except Exception as e:  # noqa: BLE001 - show the failure in the table
            ms = f"failed: {type(e).__name__}"
            failed.append(f"{type(ba.op).__name__}: {type(e).__name__}: {e}")
        rows.append((type(ba.op).__name__, ba.op.implementation, _config_text(ba.op.config),
                     _arrays_text(ba), ms))
    print(render_table(("op call", "implementation", "config", "arguments", "ms"), rows,
                       indent=2))
    if failed:
        print(f"\n  {len(failed)} op call{'s' * (len(failed) > 1)} failed:")
        for line in failed:
            print(f"    {line[:300]}")
        return 1
    return 0
