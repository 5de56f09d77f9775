"""Device probe: what limits the Mosaic GPU attention against cuDNN.

The phases, each in a subprocess with a timeout, CUPTI medians after warm-up, bf16:

* `split`: per workload, cuDNN's forward and forward+backward, our forward, our dq
  kernel and dk/dv kernel timed alone (the reproducible two-kernel backward), our
  forward+backward with that config, and the one pass ("ordered", reproducible; "atomic",
  not) with dq split by columns; a dense bf16 matmul as the ceiling. From these: the rate
  our 3.5 forward-units of backward matmul work would need to tie cuDNN's backward (2.5
  units), against the ceiling.
* `features`: the Mosaic kernels with a logit soft cap, a local window, both and neither,
  at the d128 causal workload and Gemma-2's d256 layer, and our `xla` implementation with
  both; TFLOP/s count only the query/key pairs the window and the mask leave.
* `persistent`: our forward grid-launched and persistent (one block per SM walking its
  tiles) with the config `None` runs, against cuDNN; the persistent output bitwise
  against the grid-launched one.
* `persistent_shapes`: the same at d128 and d64 shapes no benchmark has, MHA and GQA,
  causal and not.
* `group`: at GQA workloads (Llama, causal and not, Gemma-2's soft-capped d256 layers)
  our forward with a block per query head and with the group's heads in one block
  (`group_in_block`), grid-launched and persistent, at a few tiles, against cuDNN; the
  grouped output bitwise against the per-head one.
* `balanced`: at causal and windowed shapes, MHA and GQA, cuDNN's forward and ours
  grid-launched, persistent with the blocks taking the tile order round robin, and
  persistent with `_mosaic_gpu_tile_order.balanced_schedule`; both persistent outputs
  bitwise against the grid-launched one.
* `prefetch`: at persistent shapes with and without masks, cuDNN's forward and ours
  grid-launched, persistent, and persistent with the next tile's Q prefetched
  (`MosaicAttentionConfig.prefetch_query`); both persistent outputs bitwise against the
  grid-launched one.
* `tile_overhead`: at causal shapes of 1024-4096 rows, cuDNN's forward and ours
  grid-launched and persistent with the balanced schedule counting a tile's fixed cost
  (`_mosaic_gpu_tile_order.TILE_OVERHEAD_STEPS`) as 0, 0.5, 1 and 2 K/V steps.
* `registers`: our dq and dk/dv kernels timed alone under splits of the registers
  between the compute warpgroups and the memory warpgroup, with ptxas's spills and SASS.
* `row_term`: forward+backward of cuDNN and ours with the backward's row term from its
  own pass and summed by the dq kernel, at the Llama layer, causal d128 and d64.
* `ncu_fwd`: one forward each of cuDNN and ours at the non-causal d128 workload, for
  `ncu` with sections (where ours trails cuDNN inside a tile).
* `ncu`: one forward+backward each of cuDNN and Mosaic at the Llama layer and the d128
  workload, run as `ncu ... python3 benchmarks/probes/attention_limits_probe.py --phase ncu` to
  read the kernels' hardware counters (launch shape, registers, durations; with
  sections, tensor pipe, issue slots and stalls). Set `XLA_PYTHON_CLIENT_PREALLOCATE=false`
  for the sections: `ncu` saves and restores all allocated GPU memory on every replay
  pass, and XLA preallocates 75% of it.

Run on the H200 from the repository root (the two CUPTI phases take about 10 minutes
together; give each its own device call):
  PYTHONPATH=src:kernels:. python3 benchmarks/probes/attention_limits_probe.py [split] [features]
Appends JSON lines to `$OUT/attention_limits.jsonl`.
"""

from __future__ import annotations

import json
import os
import sys

from benchmarks.probes._probe import run_phases, timed

OUT = os.environ.get("OUT", "/tmp")

# name, (batch, seq, query heads, key/value heads, head dim), causal
WORKLOADS = [
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True),
    ("b4 s8192 h16 d128", (4, 8192, 16, 16, 128), False),
    ("b4 s8192 h16 d128 causal", (4, 8192, 16, 16, 128), True),
    ("gqa b4 s4096 hq32 hkv8 d128 causal", (4, 4096, 32, 8, 128), True),
    ("b32 s2048 h16 d64", (32, 2048, 16, 16, 64), False),
    ("b16 s4096 h8 d256", (16, 4096, 8, 8, 256), False),
]
# name, shape, (window, soft cap) variants
FEATURE_WORKLOADS = [
    ("b4 s8192 h16 d128 causal", (4, 8192, 16, 16, 128)),
    ("gemma 2 b2 s8192 hq8 hkv4 d256 causal", (2, 8192, 8, 4, 256)),
]
FEATURES = {"neither": (None, None), "soft cap 50": (None, 50.0),
            "window 4096": ((4096, 0), None), "both": ((4096, 0), 50.0)}


def _log(record: dict) -> None:
    print(json.dumps(record), flush=True)
    with open(os.path.join(OUT, "attention_limits.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _inputs(b, s, h, hk, d):
    import jax.numpy as jnp

    from benchmarks.probes._probe import random_normal
    return (random_normal(0, (b, s, h, d), jnp.bfloat16),
            random_normal(1, (b, s, hk, d), jnp.bfloat16),
            random_normal(2, (b, s, hk, d), jnp.bfloat16),
            random_normal(3, (b, s, h, d), jnp.bfloat16))


def _pairs(s: int, causal: bool, window) -> int:
    """Query/key pairs a (s x s) attention computes: all, causal, or within a window."""
    import numpy as np

    i = np.arange(s)
    lo = np.zeros(s, np.int64) if window is None else np.maximum(i - window[0], 0)
    hi = i if causal else np.full(s, s - 1)
    return int(np.sum(hi - lo + 1))


def _fwd(implementation, **statics):
    import jax

    from tokamax_kernels.attention import dot_product_attention
    return jax.jit(lambda q, k, v: dot_product_attention(
        q, k, v, implementation=implementation, **statics))


def _fwd_bwd(implementation, **statics):
    import jax

    from tokamax_kernels.attention import dot_product_attention

    def f(q, k, v, do):
        out, pullback = jax.vjp(lambda q, k, v: dot_product_attention(
            q, k, v, implementation=implementation, **statics), q, k, v)
        return (out, *pullback(do))
    return jax.jit(f)


def _vjp_config(q, k, causal, window=None, soft_cap=None):
    """The backward config `implementation="mosaic_gpu"` runs here, and where it came from."""
    import jax
    import jax.numpy as jnp

    from tokamax_kernels.attention import PallasMosaicGpuFlashAttentionVjp
    from tokamax_pass.core.device import current_target
    from tokamax_pass.core.selection import resolve_config

    sds = jax.ShapeDtypeStruct
    b, s, h, d = q.shape
    qs, ks = sds(q.shape, q.dtype), sds(k.shape, k.dtype)
    op = PallasMosaicGpuFlashAttentionVjp()
    ba = op.bind([sds((b, h, s), jnp.float32)], qs, qs, query=qs, key=ks, value=ks,
                 bias=None, mask=None, scale=d ** -0.5, is_causal=causal,
                 query_seq_lengths=None, key_value_seq_lengths=None,
                 local_window_size=window, logits_soft_cap=soft_cap, precision=None)
    return resolve_config(op, ba, current_target())


def _mosaic(vjp_config):
    from tokamax_kernels.attention import (
        PallasMosaicGpuFlashAttention,
        PallasMosaicGpuFlashAttentionVjp,
    )
    return PallasMosaicGpuFlashAttention(vjp=PallasMosaicGpuFlashAttentionVjp(config=vjp_config))


def _ceiling() -> None:
    import jax
    import jax.numpy as jnp

    from benchmarks.probes._probe import random_normal
    n = 8192
    a, b = random_normal(4, (n, n), jnp.bfloat16), random_normal(5, (n, n), jnp.bfloat16)
    record = dict(phase="split", workload=f"dense matmul {n}^3 bf16", variant="xla dot")
    timed(record, jax.jit(jnp.dot), (a, b), 2 * n ** 3)
    _log(record)


def _jitted(kernel, **statics):
    """`kernel` with its static keyword arguments bound, under `jax.jit`."""
    import jax
    return jax.jit(lambda *args: kernel(*args, **statics))


def _split_workload(name: str, shape: tuple[int, ...], causal: bool) -> None:
    import dataclasses

    import jax
    import jax.numpy as jnp

    from tokamax_kernels.attention._delta import attention_delta
    from tokamax_kernels.attention._mosaic_gpu_bwd_kernels import (
        mosaic_attention_dkv,
        mosaic_attention_dq,
    )
    from tokamax_kernels.attention._mosaic_gpu_common import MosaicAttentionConfig
    from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward

    b, s, h, hk, d = shape
    q, k, v, do = _inputs(b, s, h, hk, d)
    unit = 4 * b * h * d * _pairs(s, causal, None)  # one forward's matmul FLOPs
    config, source = _vjp_config(q, k, causal)
    statics = dict(scale=d ** -0.5, causal=causal)

    def log(variant, fn, args, units, **extra):
        record = dict(phase="split", workload=name, variant=variant, units=units, **extra)
        timed(record, fn, args, units * unit)
        _log(record)
        jax.clear_caches()

    log("cudnn fwd", _fwd("cudnn", is_causal=causal), (q, k, v), 1.0)
    log("cudnn fwd+bwd", _fwd_bwd("cudnn", is_causal=causal), (q, k, v, do), 3.5)
    log("mosaic fwd", _fwd("mosaic_gpu", is_causal=causal), (q, k, v), 1.0)
    log("mosaic fwd+bwd", _fwd_bwd(_mosaic(config), is_causal=causal), (q, k, v, do), 3.5,
        config=str(config), config_source=source)
    out, lse = _jitted(mosaic_attention_forward, **statics,
                       config=MosaicAttentionConfig(block_q=64, block_kv=64))(q, k, v)
    residuals = (q, k, v, do, lse.astype(jnp.float32), jax.jit(attention_delta)(out, do))
    log("mosaic dq kernel", _jitted(mosaic_attention_dq, **statics, config=config),
        residuals, 1.5)
    log("mosaic dk/dv kernel", _jitted(mosaic_attention_dkv, **statics, config=config),
        residuals, 2.0)
    if d <= 128 and d // config.compute_wgs >= 64:
        for mode in ("ordered", "atomic"):
            one_pass = dataclasses.replace(config, dq_accumulation=mode,
                                           group_in_block=False, longest_first=False)
            log(f"mosaic one pass {mode}", _fwd_bwd(_mosaic(one_pass), is_causal=causal),
                (q, k, v, do), 3.5)


def split() -> None:
    _ceiling()
    for name, shape, causal in WORKLOADS:
        _split_workload(name, shape, causal)


def features() -> None:
    import jax

    for name, (b, s, h, hk, d) in FEATURE_WORKLOADS:
        q, k, v, do = _inputs(b, s, h, hk, d)
        for feature, (window, cap) in FEATURES.items():
            unit = 4 * b * h * d * _pairs(s, True, window)
            statics = dict(is_causal=True, local_window_size=window, logits_soft_cap=cap)
            implementations = ["mosaic_gpu"] + (["xla"] if feature == "both" else [])
            for impl in implementations:
                for mode, fn, args, units in (
                        ("fwd", _fwd(impl, **statics), (q, k, v), 1.0),
                        ("fwd+bwd", _fwd_bwd(impl, **statics), (q, k, v, do), 3.5)):
                    record = dict(phase="features", workload=name, variant=feature,
                                  implementation=impl, mode=mode, pairs=_pairs(s, True, window))
                    timed(record, fn, args, units * unit)
                    _log(record)
                    jax.clear_caches()


def _fwd_config(q, k, causal, window=None, soft_cap=None):
    """The forward config `implementation="mosaic_gpu"` runs here, and where it came from."""
    import jax

    from tokamax_kernels.attention import PallasMosaicGpuFlashAttention
    from tokamax_pass.core.device import current_target
    from tokamax_pass.core.selection import resolve_config

    sds = jax.ShapeDtypeStruct
    qs, ks = sds(q.shape, q.dtype), sds(k.shape, k.dtype)
    op = PallasMosaicGpuFlashAttention()
    ba = op.bind(qs, ks, ks, is_causal=causal, local_window_size=window,
                 logits_soft_cap=soft_cap)
    return resolve_config(op, ba, current_target())


def _forward_workload(phase: str, name: str, shape, causal: bool, window, cap):
    """A forward workload's inputs `(q, k, v)`, its matmul FLOPs, the family's static
    arguments, and the config `implementation="mosaic_gpu"` runs there with its source;
    cuDNN's forward timed and logged first where it runs (no soft cap)."""
    b, s, h, hk, d = shape
    q, k, v, _ = _inputs(b, s, h, hk, d)
    unit = 4 * b * h * d * _pairs(s, causal, window)
    statics = dict(is_causal=causal, local_window_size=window, logits_soft_cap=cap)
    if cap is None:
        record = dict(phase=phase, workload=name, variant="cudnn fwd")
        timed(record, _fwd("cudnn", **statics), (q, k, v), unit)
        _log(record)
    default, source = _fwd_config(q, k, causal, window, cap)
    return (q, k, v), unit, statics, default, source


def persistent() -> None:
    """Per workload: cuDNN's forward, then our forward with the config `None` runs,
    grid-launched and persistent (`MosaicAttentionConfig.persistent`, the same tiles),
    the persistent output checked bitwise against the grid-launched one. The backward
    does not change, so forward+backward moves by the forward's difference."""
    cases = [(name, shape, causal, None, None) for name, shape, causal in WORKLOADS]
    cases.append(("soft cap 50 window 4096 " + FEATURE_WORKLOADS[0][0],
                  FEATURE_WORKLOADS[0][1], True, (4096, 0), 50.0))
    _persistent_cases(cases, "persistent")


def _persistent_cases(cases, phase: str) -> None:
    import dataclasses

    import jax
    import numpy as np

    from tokamax_kernels.attention import PallasMosaicGpuFlashAttention

    for name, shape, causal, window, cap in cases:
        qkv, unit, statics, default, source = _forward_workload(phase, name, shape, causal,
                                                                window, cap)
        outs = []
        for on in (False, True):
            config = dataclasses.replace(default, persistent=on)
            record = dict(phase=phase, workload=name, variant="mosaic fwd",
                          config=str(config), config_source=source)
            impl = PallasMosaicGpuFlashAttention(config=config)
            outs.append(timed(record, _fwd(impl, **statics), qkv, unit))
            _log(record)
            jax.clear_caches()
        if all(out is not None for out in outs):
            _log(dict(phase=phase, workload=name, bitwise_equal=bool(
                np.array_equal(np.asarray(outs[0]), np.asarray(outs[1])))))


# name, shape, causal, window, soft cap: GQA forwards for the `group` phase
GROUP_WORKLOADS = [
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True, None, None),
    ("gqa b4 s4096 hq32 hkv8 d128 causal", (4, 4096, 32, 8, 128), True, None, None),
    ("gqa b8 s2048 hq32 hkv8 d128 causal", (8, 2048, 32, 8, 128), True, None, None),
    ("gqa b4 s4096 hq32 hkv8 d128", (4, 4096, 32, 8, 128), False, None, None),
    ("gemma 2 local b2 s8192 hq8 hkv4 d256 causal", (2, 8192, 8, 4, 256), True, (4096, 0),
     50.0),
    ("gemma 2 global b2 s8192 hq8 hkv4 d256 causal", (2, 8192, 8, 4, 256), True, None, 50.0),
]


def group() -> None:
    """Per GQA workload: cuDNN's forward (no soft cap only), then our forward at the
    config `None` runs and at the tiles 64 x 128 and 128 x 128 (64 x 64 at d256) where
    they fit, each
    grid-launched and persistent where a block fills an SM, each with a block per query
    head and with the group's heads in one block (`group_in_block`); the grouped output
    checked bitwise against the per-head one."""
    import dataclasses

    import jax
    import numpy as np

    from tokamax_kernels.attention import PallasMosaicGpuFlashAttention
    from tokamax_kernels.attention.pallas_mosaic_gpu import fits, one_block_per_sm

    for name, shape, causal, window, cap in GROUP_WORKLOADS:
        qkv, unit, statics, default, source = _forward_workload("group", name, shape,
                                                                causal, window, cap)
        s, d = shape[1], shape[4]
        tiles = [(64, 64)] if d == 256 else [(64, 128), (128, 128)]
        bases = [default] + [dataclasses.replace(default, block_q=bq, block_kv=bkv,
                                                 num_stages=2, persistent=False,
                                                 group_in_block=False)
                             for bq, bkv in tiles]
        bases += [dataclasses.replace(c, persistent=True) for c in bases[1:]
                  if one_block_per_sm(c, d)]
        for base in dict.fromkeys(bases):
            if not fits(base, s, s, d):
                continue
            outs = []
            for on in (False, True):
                config = dataclasses.replace(base, group_in_block=on)
                record = dict(phase="group", workload=name, variant="mosaic fwd",
                              config=str(config),
                              config_source=source if base == default else "probe")
                impl = PallasMosaicGpuFlashAttention(config=config)
                outs.append(timed(record, _fwd(impl, **statics), qkv, unit))
                _log(record)
                jax.clear_caches()
            if all(out is not None for out in outs):
                _log(dict(phase="group", workload=name, config=str(base), bitwise_equal=bool(
                    np.array_equal(np.asarray(outs[0]), np.asarray(outs[1])))))


# name, shape, causal: d128 (and d64) shapes beside the benchmark's for `persistent_shapes`
PERSISTENT_SHAPES = [
    ("mha b8 s2048 h16 d128 causal", (8, 2048, 16, 16, 128), True),
    ("mha b4 s4096 h16 d128 causal", (4, 4096, 16, 16, 128), True),
    ("mha b4 s4096 h16 d128", (4, 4096, 16, 16, 128), False),
    ("mha b16 s1024 h16 d128 causal", (16, 1024, 16, 16, 128), True),
    ("gqa b2 s8192 hq32 hkv8 d128 causal", (2, 8192, 32, 8, 128), True),
    ("gqa b16 s1024 hq32 hkv8 d128 causal", (16, 1024, 32, 8, 128), True),
    ("gqa b8 s2048 hq32 hkv8 d128", (8, 2048, 32, 8, 128), False),
    ("gqa b8 s2048 hq16 hkv4 d64 causal", (8, 2048, 16, 4, 64), True),
]


def persistent_shapes() -> None:
    """`persistent`'s comparison (cuDNN, our forward grid-launched and persistent at the
    config `None` runs) at shapes no benchmark has: to tell whether the persistent launch
    wins by the sequence length, the mask or the K/V sharing of GQA."""
    _persistent_cases([(name, shape, causal, None, None)
                       for name, shape, causal in PERSISTENT_SHAPES], "persistent_shapes")


# name, shape, causal, window, soft cap: tiles of differing lengths for `balanced`
BALANCED_SHAPES = [
    ("mha b4 s4096 h16 d128 causal", (4, 4096, 16, 16, 128), True, None, None),
    ("mha b8 s2048 h16 d128 causal", (8, 2048, 16, 16, 128), True, None, None),
    ("mha b16 s1024 h16 d128 causal", (16, 1024, 16, 16, 128), True, None, None),
    ("b4 s8192 h16 d128 causal", (4, 8192, 16, 16, 128), True, None, None),
    ("mha b2 s8192 h32 d128 causal", (2, 8192, 32, 32, 128), True, None, None),
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True, None, None),
    ("gqa b4 s4096 hq32 hkv8 d128 causal", (4, 4096, 32, 8, 128), True, None, None),
    ("gqa b8 s2048 hq32 hkv8 d128 causal", (8, 2048, 32, 8, 128), True, None, None),
    ("gqa b16 s1024 hq32 hkv8 d128 causal", (16, 1024, 32, 8, 128), True, None, None),
    ("gqa b8 s2048 hq16 hkv4 d64 causal", (8, 2048, 16, 4, 64), True, None, None),
    # d64 with 64 x 128 tiles: two grid blocks fit an SM, one persistent block does not
    # (the `prefetch` phase measures the first).
    ("mha b8 s2048 h16 d64 causal", (8, 2048, 16, 16, 64), True, None, None),
    ("mha b32 s2048 h16 d64 causal", (32, 2048, 16, 16, 64), True, None, None),
    ("soft cap 50 window 4096 b4 s8192 h16 d128", (4, 8192, 16, 16, 128), True, (4096, 0),
     50.0),
    ("gemma 2 local b2 s8192 hq8 hkv4 d256 causal", (2, 8192, 8, 4, 256), True, (4096, 0),
     50.0),
]


def _against_the_grid(phase: str, name: str, qkv, unit: float, statics: dict, source: str,
                      variants) -> None:
    """Our forward at each `(variant, config, schedule settings)` of `variants` in turn
    (settings: `_mosaic_gpu_tile_order` constants set for that variant, such as
    `MAX_SCHEDULED_TILES`; the rest as shipped), the first the grid launch; each later
    output logged bitwise against the first's."""
    import jax
    import numpy as np

    from tokamax_kernels.attention import PallasMosaicGpuFlashAttention
    from tokamax_kernels.attention import _mosaic_gpu_tile_order as tile_order_module

    outs = {}
    for variant, config, settings in variants:
        shipped = {key: getattr(tile_order_module, key) for key in settings}
        for key, value in settings.items():
            setattr(tile_order_module, key, value)
        record = dict(phase=phase, workload=name, variant=variant, config=str(config),
                      config_source=source, schedule_settings=settings)
        impl = PallasMosaicGpuFlashAttention(config=config)
        try:
            outs[variant] = timed(record, _fwd(impl, **statics), qkv, unit)
        finally:
            for key, value in shipped.items():
                setattr(tile_order_module, key, value)
        _log(record)
        jax.clear_caches()
    if all(out is not None for out in outs.values()):
        grid, *rest = outs.items()
        _log(dict(phase=phase, workload=name, bitwise_equal={
            variant: bool(np.array_equal(np.asarray(grid[1]), np.asarray(out)))
            for variant, out in rest}))


def balanced() -> None:
    """Per shape: cuDNN's forward (no soft cap only), then our forward at the config
    `None` runs, grid-launched, persistent round robin (`MAX_SCHEDULED_TILES` set to 0)
    and persistent balanced; each persistent output bitwise against the grid's."""
    import dataclasses

    for name, shape, causal, window, cap in BALANCED_SHAPES:
        qkv, unit, statics, default, source = _forward_workload("balanced", name, shape,
                                                                causal, window, cap)
        grid = dataclasses.replace(default, persistent=False, prefetch_query=False)
        persistent = default if default.persistent else dataclasses.replace(
            default, persistent=True)
        _against_the_grid("balanced", name, qkv, unit, statics, source, [
            ("grid", grid, {}),
            ("persistent round robin", persistent, {"MAX_SCHEDULED_TILES": 0}),
            ("persistent balanced", persistent, {})])


# name, shape, causal, window, soft cap: persistent shapes for `prefetch`, with and
# without masks (d64 at 64 x 128 tiles: the persistent launch is no heuristics' choice).
PREFETCH_SHAPES = [
    ("b4 s8192 h16 d128", (4, 8192, 16, 16, 128), False, None, None),
    ("mha b4 s4096 h16 d128", (4, 4096, 16, 16, 128), False, None, None),
    ("gqa b4 s4096 hq32 hkv8 d128", (4, 4096, 32, 8, 128), False, None, None),
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True, None, None),
    ("b4 s8192 h16 d128 causal", (4, 8192, 16, 16, 128), True, None, None),
    ("mha b4 s4096 h16 d128 causal", (4, 4096, 16, 16, 128), True, None, None),
    ("gqa b4 s4096 hq32 hkv8 d128 causal", (4, 4096, 32, 8, 128), True, None, None),
    ("gqa b16 s1024 hq32 hkv8 d128 causal", (16, 1024, 32, 8, 128), True, None, None),
    ("mha b16 s1024 h16 d128 causal", (16, 1024, 16, 16, 128), True, None, None),
    ("gqa b8 s2048 hq16 hkv4 d64 causal", (8, 2048, 16, 4, 64), True, None, None),
    ("mha b8 s2048 h16 d64 causal", (8, 2048, 16, 16, 64), True, None, None),
    ("soft cap 50 window 4096 b4 s8192 h16 d128", (4, 8192, 16, 16, 128), True, (4096, 0),
     50.0),
]


def prefetch() -> None:
    """Per shape: cuDNN's forward (no soft cap only), then our forward at the config
    `None` runs (64 x 128 tiles, two stages), grid-launched, persistent, and persistent
    with the next tile's Q prefetched (`MosaicAttentionConfig.prefetch_query`); each
    persistent output bitwise against the grid's."""
    import dataclasses

    for name, shape, causal, window, cap in PREFETCH_SHAPES:
        qkv, unit, statics, default, source = _forward_workload("prefetch", name, shape,
                                                                causal, window, cap)
        grid = dataclasses.replace(default, block_q=64, block_kv=128, num_stages=2,
                                   persistent=False, prefetch_query=False)
        _against_the_grid("prefetch", name, qkv, unit, statics, source, [
            ("grid", grid, {}),
            ("persistent", dataclasses.replace(grid, persistent=True), {}),
            ("persistent prefetch",
             dataclasses.replace(grid, persistent=True, prefetch_query=True), {})])


# name, shape, causal, window, soft cap: causal shapes for `tile_overhead`, where a tile
# is 1-64 K/V steps long (1024-8192 rows).
TILE_OVERHEAD_SHAPES = [
    ("gqa b16 s1024 hq32 hkv8 d128 causal", (16, 1024, 32, 8, 128), True, None, None),
    ("mha b16 s1024 h16 d128 causal", (16, 1024, 16, 16, 128), True, None, None),
    ("mha b8 s2048 h16 d128 causal", (8, 2048, 16, 16, 128), True, None, None),
    ("llama b4 s4096 hq16 hkv4 d128 causal", (4, 4096, 16, 4, 128), True, None, None),
    ("gqa b8 s2048 hq16 hkv4 d64 causal", (8, 2048, 16, 4, 64), True, None, None),
]


def tile_overhead() -> None:
    """Per causal shape: cuDNN's forward, then our forward at the config `None` runs
    (persistent, balanced, prefetching), grid-launched and with the balanced schedule
    costing each tile its K/V steps plus 0, 0.5, 1 (shipped) and 2
    (`_mosaic_gpu_tile_order.TILE_OVERHEAD_STEPS`): does the prefetch leave a tile's
    fixed cost at a step?"""
    import dataclasses

    for name, shape, causal, window, cap in TILE_OVERHEAD_SHAPES:
        qkv, unit, statics, default, source = _forward_workload("tile_overhead", name, shape,
                                                                causal, window, cap)
        grid = dataclasses.replace(default, persistent=False, prefetch_query=False)
        _against_the_grid("tile_overhead", name, qkv, unit, statics, source, [
            ("grid", grid, {}),
            *((f"persistent overhead {steps}", default, {"TILE_OVERHEAD_STEPS": steps})
              for steps in (0, 0.5, 1, 2))])


# (compute warpgroups' registers, the memory warpgroup's) for `registers`, each summing
# to the 504 a lane that the launch's 168 x 3 leaves: the shipped split,
# FlashAttention-3's for two consumer warpgroups, and more for the memory warpgroup.
REGISTER_SPLITS = [(232, 40), (240, 24), (224, 56)]


def registers() -> None:
    """Per d128 workload: our dq and dk/dv kernels (the config `None` runs) timed alone
    under each register split of `REGISTER_SPLITS` (`set_max_registers`), with ptxas's
    report and the SASS per split (`MOSAIC_GPU_DUMP_*` into `$OUT/dump/...`); each
    output bitwise against the shipped split's."""
    import jax
    import numpy as np

    from tokamax_kernels.attention import _mosaic_gpu_bwd_kernels as bwd_module
    from tokamax_kernels.attention._delta import attention_delta
    from tokamax_kernels.attention._mosaic_gpu_fwd_kernel import mosaic_attention_forward

    for name, (b, s, h, hk, d), causal in WORKLOADS[:4]:
        q, k, v, do = _inputs(b, s, h, hk, d)
        unit = 4 * b * h * d * _pairs(s, causal, None)
        bwd_config, source = _vjp_config(q, k, causal)
        statics = dict(scale=d ** -0.5, causal=causal)
        out, lse = _jitted(mosaic_attention_forward, **statics,
                           config=_fwd_config(q, k, causal)[0])(q, k, v)
        residuals = (q, k, v, do, lse, jax.jit(attention_delta)(out, do))
        outs = {}
        for compute, memory in REGISTER_SPLITS:
            bwd_module.COMPUTE_REGISTERS, bwd_module.MEMORY_REGISTERS = compute, memory
            split = f"{compute}/{memory}"
            for kernel, fn, units in (("dq", bwd_module.mosaic_attention_dq, 1.5),
                                      ("dk/dv", bwd_module.mosaic_attention_dkv, 2.0)):
                os.environ["MOSAIC_GPU_DUMP_TO"] = os.path.join(
                    OUT, "dump", f"{name.split()[0]}_{int(causal)}_{kernel[:2]}_{compute}")
                record = dict(phase="registers", workload=name, kernel=kernel,
                              registers=split, config=str(bwd_config), config_source=source)
                outs[split, kernel] = timed(
                    record, _jitted(fn, **statics, config=bwd_config), residuals,
                    units * unit)
                _log(record)
                jax.clear_caches()
        shipped = "/".join(map(str, REGISTER_SPLITS[0]))
        _log(dict(phase="registers", workload=name, bitwise_equal={
            f"{split} {kernel}": bool(np.array_equal(np.asarray(outs[shipped, kernel]),
                                                     np.asarray(out)))
            for (split, kernel), out in outs.items()
            if split != shipped and out is not None and outs[shipped, kernel] is not None}))
    bwd_module.COMPUTE_REGISTERS, bwd_module.MEMORY_REGISTERS = REGISTER_SPLITS[0]


def row_term() -> None:
    """At the Llama layer, causal d128 and d64: forward+backward of cuDNN and of our Mosaic kernels
    (the VJP config `None` runs) with the backward's row term from its own pass
    (`attention_delta`) and summed by the dq kernel
    (`mosaic_attention_dq_and_delta`); the two forms' gradients compared."""
    import jax
    import numpy as np

    from tokamax_kernels.attention import pallas_mosaic_gpu_vjp as vjp_module

    shipped = vjp_module.computes_delta
    for name, (b, s, h, hk, d), causal in (WORKLOADS[0], WORKLOADS[2], WORKLOADS[4]):
        q, k, v, do = _inputs(b, s, h, hk, d)
        unit = 4 * b * h * d * _pairs(s, causal, None)
        config, source = _vjp_config(q, k, causal)
        grads = {}
        for variant, impl, computes in (("cudnn", "cudnn", None),
                                        ("mosaic row-term pass", _mosaic(config), False),
                                        ("mosaic delta in dq", _mosaic(config), True)):
            if computes is not None:
                vjp_module.computes_delta = shipped if computes else (lambda head_dim: False)
            record = dict(phase="row_term", workload=name, variant=variant,
                          config=str(config), config_source=source)
            try:
                grads[variant] = timed(record, _fwd_bwd(impl, is_causal=causal),
                                       (q, k, v, do), 3.5 * unit)
            finally:
                vjp_module.computes_delta = shipped
            _log(record)
            jax.clear_caches()
        a, b_ = grads.get("mosaic row-term pass"), grads.get("mosaic delta in dq")
        if a is not None and b_ is not None:
            _log(dict(phase="row_term", workload=name, max_abs_difference={
                g: float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
                for g, x, y in zip(("out", "dq", "dk", "dv"), a, b_, strict=True)},
                bitwise_equal=[bool(np.array_equal(np.asarray(x), np.asarray(y)))
                               for x, y in zip(a, b_, strict=True)]))


def ncu() -> None:
    """One forward+backward each, for `ncu` to profile (no timing loop of its own)."""
    import jax

    for name, (b, s, h, hk, d), causal in WORKLOADS[:2]:
        q, k, v, do = _inputs(b, s, h, hk, d)
        config, _ = _vjp_config(q, k, causal)
        for impl in ("cudnn", _mosaic(config)):
            jax.block_until_ready(_fwd_bwd(impl, is_causal=causal)(q, k, v, do))
        print(name, "done", flush=True)


def ncu_fwd() -> None:
    """One forward each of cuDNN and our Mosaic kernel (the config `None` runs) at the
    non-causal d128 workload, where ours trails cuDNN by 5% with or without the
    persistent launch (`benchmarks/probes/attention_limits_probe.py prefetch`): for `ncu --section
    ...` to read where the time goes inside a tile (tensor pipe, issue slots, stalls)."""
    import jax

    name, (b, s, h, hk, d), causal = WORKLOADS[1]
    q, k, v, _ = _inputs(b, s, h, hk, d)
    for impl in ("cudnn", "mosaic_gpu"):
        jax.block_until_ready(_fwd(impl, is_causal=causal)(q, k, v))
    print(name, "done", flush=True)


def main(argv: list[str]) -> int:
    phases = {"split": (split, 400), "features": (features, 240), "ncu": (ncu, 300),
              "ncu_fwd": (ncu_fwd, 300),
              "persistent": (persistent, 300), "group": (group, 480),
              "persistent_shapes": (persistent_shapes, 300), "balanced": (balanced, 420),
              "prefetch": (prefetch, 420), "tile_overhead": (tile_overhead, 360),
              "registers": (registers, 480), "row_term": (row_term, 300)}
    return run_phases(argv or ["split", "features"], __file__, phases, _log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
