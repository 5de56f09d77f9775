# ruff: noqa: B023  (lambdas are called at once, inside their loop iteration)
"""Device sweep for the Triton layer norm, ragged dot and GLU kernels (run on the H200).

`PYTHONPATH=src:kernels:. python3 benchmarks/probes/triton_small_ops_sweep.py OUT_DIR [sections]`
checks each kernel against a float32 reference at the benchmark shapes and times it
and the XLA peer with CUPTI (median of 20 calls after a warm-up). One JSON line per
measurement goes to OUT_DIR/sweep.jsonl as it is taken, so a timeout keeps the rest.
"""

from __future__ import annotations

import pathlib
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from benchmarks.probes._probe import JsonLines, relative_error, with_vjp
from tokamax_kernels.gated_linear_unit import pallas_triton as glu_triton
from tokamax_kernels.gated_linear_unit.base import GatedLinearUnit
from tokamax_kernels.gated_linear_unit.pallas_triton_vjp import PallasTritonGatedLinearUnitVjp
from tokamax_kernels.layer_norm import pallas_triton as ln_triton
from tokamax_kernels.layer_norm import pallas_triton_vjp as ln_vjp
from tokamax_kernels.layer_norm.base import LayerNorm
from tokamax_kernels.ragged_dot import pallas_triton as rd_triton
from tokamax_kernels.ragged_dot.base import RaggedDot

OUT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".")
SECTIONS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ln", "rd", "glu"]
log = JsonLines(OUT / "sweep.jsonl")


def timed(fn, *args, iterations=20):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    _, times = profiler.measure(compiled, iterations=iterations)(*args)
    return float(np.median(times))


def layer_norm_section():
    rows, n = 65536, 4096
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (rows, n), jnp.bfloat16)
    s = (1 + 0.1 * jax.random.normal(k[1], (n,))).astype(jnp.bfloat16)
    o = (0.1 * jax.random.normal(k[2], (n,))).astype(jnp.bfloat16)
    dy = jax.random.normal(k[3], (rows, n), jnp.bfloat16)
    nbytes = 2 * rows * n * 2
    for subtract_mean in (True, False):
        name = "layer_norm" if subtract_mean else "rms_norm"
        with jax.default_matmul_precision("highest"):
            ref = lambda x, s, o: LayerNorm()(x, s, o, subtract_mean=subtract_mean)
            f32 = [a.astype(jnp.float32) for a in (x, s, o, dy)]
            want_y, want_g = jax.jit(with_vjp(ref))(*f32)
        xla_fwd = timed(lambda x, s, o: ref(x, s, o), x, s, o)
        xla_all = timed(with_vjp(ref), x, s, o, dy)
        log(section=name, impl="xla", fwd_ms=xla_fwd, fwd_tbs=nbytes / xla_fwd / 1e9,
            fwd_bwd_ms=xla_all)
        heur = ln_triton.PallasTritonLayerNorm().bind(x, s, o).heuristics_config
        fwd_configs = {heur} | {
            ln_triton.Config(block_rows=r, block_n=4096, rows_per_program=rpp, num_warps=w,
                             num_stages=st)
            for r, rpp, w, st in ((1, 4, 8, 2), (1, 8, 8, 2), (1, 8, 8, 3), (1, 16, 8, 3),
                                  (1, 8, 4, 3), (2, 16, 16, 3), (1, 32, 8, 3), (1, 8, 16, 2))}
        for cfg in sorted(fwd_configs, key=str):
            op = ln_triton.PallasTritonLayerNorm(config=cfg)
            try:
                f = lambda x, s, o, op=op: op(x, s, o, subtract_mean=subtract_mean)
                err = relative_error(jax.jit(f)(x, s, o), want_y)
                ms = timed(f, x, s, o)
                log(section=name, impl="triton_fwd", config=str(cfg), heuristic=cfg == heur,
                    fwd_ms=ms, fwd_tbs=nbytes / ms / 1e9, err=err)
            except Exception as e:  # noqa: BLE001
                log(section=name, impl="triton_fwd", config=str(cfg), error=repr(e)[:300])
        vjp_op = ln_vjp.PallasTritonLayerNormVjp()
        bheur = vjp_op._get_heuristics_config(ln_triton.PallasTritonLayerNorm().bind(x, s, o))
        bwd_configs = {bheur} | {
            ln_vjp.Config(block_rows=r, block_n=4096, rows_per_program=rpp, num_warps=w,
                          num_stages=st)
            for r, rpp, w, st in ((1, 256, 16, 3), (1, 128, 16, 3))}
        for cfg in sorted(bwd_configs, key=str):
            op = ln_triton.PallasTritonLayerNorm(vjp=ln_vjp.PallasTritonLayerNormVjp(config=cfg))
            try:
                f = with_vjp(lambda x, s, o, op=op: op(x, s, o, subtract_mean=subtract_mean))
                y, grads = jax.jit(f)(x, s, o, dy)
                errs = [relative_error(a, b) for a, b in zip(grads, want_g, strict=True)]
                _, grads2 = jax.jit(f)(x, s, o, dy)
                bitwise = all(bool((a == b).all()) for a, b in zip(grads, grads2, strict=True))
                ms = timed(f, x, s, o, dy)
                log(section=name, impl="triton_fwd_bwd", config=str(cfg),
                    heuristic=cfg == bheur, fwd_bwd_ms=ms, errs=errs, bitwise=bitwise)
            except Exception as e:  # noqa: BLE001
                log(section=name, impl="triton_fwd_bwd", config=str(cfg), error=repr(e)[:300])


def ragged_section():
    m, k, n = 16384, 4096, 4096
    sizes = {"even": np.array([2070, 2092, 2015, 2002, 2059, 2064, 2064, 2018], np.int32),
             "uneven": np.array([4000, 0, 3000, 100, 5000, 2000, 2000, 0], np.int32)}
    keys = jax.random.split(jax.random.key(1), 3)
    lhs = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (8, k, n)) / 64).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    flops = 2 * m * k * n
    operands = {"forward": (lhs, rhs), "dlhs": (dy, rhs), "drhs": (lhs, dy)}
    for label, gs in sizes.items():
        gs = jnp.asarray(gs)
        for variant, (a, b) in operands.items():
            with jax.default_matmul_precision("highest"):
                want = jax.jit(lambda a, b, v=variant: RaggedDot()(
                    a.astype(jnp.float32), b.astype(jnp.float32), gs, variant=v))(a, b)
            heur = rd_triton.PallasTritonRaggedDot().bind(a, b, gs, variant=variant)
            heur = heur.heuristics_config
            configs = {heur}
            if label == "even":
                configs |= {rd_triton.Config(block_m=bm, block_n=bn, block_k=bk, num_warps=w,
                                             num_stages=s)
                            for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                                     (64, 128, 64, 4, 4), (128, 128, 64, 4, 4),
                                                     (256, 128, 64, 8, 3))}
            if variant == "forward":
                peer = lambda a, b: jax.lax.ragged_dot(a, b, gs)
                ms = timed(peer, a, b)
                log(section="ragged", groups=label, variant=variant, impl="jax.lax.ragged_dot",
                    ms=ms, tflops=flops / ms / 1e9, err=relative_error(jax.jit(peer)(a, b), want))
            for cfg in sorted(configs, key=str):
                op = rd_triton.PallasTritonRaggedDot(config=cfg)
                f = lambda a, b, op=op, v=variant: op(a, b, gs, variant=v)
                try:
                    got = jax.jit(f)(a, b)
                    bitwise = bool((got == jax.jit(f)(a, b)).all())
                    ms = timed(f, a, b)
                    log(section="ragged", groups=label, variant=variant, impl="triton",
                        config=str(cfg), heuristic=cfg == heur, ms=ms, tflops=flops / ms / 1e9,
                        err=relative_error(got, want), bitwise=bitwise)
                except Exception as e:  # noqa: BLE001
                    log(section="ragged", groups=label, variant=variant, config=str(cfg),
                        error=repr(e)[:300])
        op = rd_triton.PallasTritonRaggedDot()
        ours = with_vjp(lambda a, b: op(a, b, gs))
        peer = with_vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs))
        for impl, f in (("triton", ours), ("jax.lax.ragged_dot", peer)):
            ms = timed(f, lhs, rhs, dy)
            log(section="ragged", groups=label, variant="fwd+bwd", impl=impl, ms=ms,
                tflops=3 * flops / ms / 1e9)


def glu_section():
    m, k, n = 8192, 4096, 4096
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (k, 2, n)) / 64).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    flops = 4 * m * k * n
    with jax.default_matmul_precision("highest"):
        want_y, want_g = jax.jit(with_vjp(GatedLinearUnit()))(
            x.astype(jnp.float32), w.astype(jnp.float32), dy.astype(jnp.float32))
    ref = GatedLinearUnit()
    log(section="glu", impl="xla", fwd_ms=timed(lambda x, w: ref(x, w), x, w),
        fwd_bwd_ms=timed(with_vjp(ref), x, w, dy))
    heur = glu_triton.PallasTritonGatedLinearUnit().bind(x, w).heuristics_config
    configs = {heur} | {glu_triton.Config(block_m=bm, block_n=bn, block_k=bk, num_warps=wp,
                                          num_stages=s)
                        for bm, bn, bk, wp, s in ((128, 128, 64, 8, 3), (128, 64, 64, 4, 4),
                                                  (64, 128, 64, 4, 4), (128, 128, 32, 8, 4))}
    for cfg in sorted(configs, key=str):
        op = glu_triton.PallasTritonGatedLinearUnit(
            config=cfg, vjp=PallasTritonGatedLinearUnitVjp(config=cfg))
        try:
            f = lambda x, w, op=op: op(x, w)
            err = relative_error(jax.jit(f)(x, w), want_y)
            fwd = timed(f, x, w)
            y, grads = jax.jit(with_vjp(f))(x, w, dy)
            errs = [relative_error(a, b) for a, b in zip(grads, want_g, strict=True)]
            both = timed(with_vjp(f), x, w, dy)
            log(section="glu", impl="triton", config=str(cfg), heuristic=cfg == heur,
                fwd_ms=fwd, fwd_tflops=flops / fwd / 1e9, fwd_bwd_ms=both, err=err, errs=errs)
        except Exception as e:  # noqa: BLE001
            log(section="glu", impl="triton", config=str(cfg), error=repr(e)[:300])


if __name__ == "__main__":
    log(device=jax.devices()[0].device_kind)
    for section in SECTIONS:
        try:
            {"ln": layer_norm_section, "rd": ragged_section, "glu": glu_section}[section]()
        except Exception:  # noqa: BLE001
            log(section=section, error=traceback.format_exc()[-2000:])
