"""Snapshot the StableHLO of the Mosaic GPU attention (forward and gradient, exported for
`cuda` on CPU) at the benchmark-like shapes, to compare two versions of the kernels:

    PYTHONPATH=src:kernels:. python benchmarks/probes/mosaic_attention_stablehlo_snapshot.py OUT_DIR
    diff -r BEFORE_DIR AFTER_DIR

Source locations are left out of the lowering (`jax_traceback_in_locations_limit=0`) and
checkout and script paths normalized, so only a change in the programs (or in the heuristics and
autotuning configs, `configs.json`) shows. Identical files let the lead re-stamp the
library cache entries of a kernel whose source changed without measuring again.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    dot_product_attention,
)
from tokamax_pass import core

H200 = "NVIDIA H200"


def _sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def _export(out: pathlib.Path, name: str, fn, *args) -> None:
    with core.targeting(H200):
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=tokamax.DISABLE_JAX_EXPORT_CHECKS)(*args)
    text = re.sub(r"/[^\s\"]*?/(src|kernels)/tokamax_", r"/ROOT/\1/tokamax_",
                  exported.mlir_module()).replace(__file__, "/SNAPSHOT.py")
    (out / f"{name}.mlir").write_text(text)


def _case(out, name, q, kv, self_attention=False, **kwargs):
    def forward(q, k, v):
        return dot_product_attention(q, k, v, implementation="mosaic", **kwargs)

    def loss(q, k, v):
        o = forward(q, k, v).astype(jnp.float32)
        return (o * jnp.cos(o)).sum()

    if self_attention:
        _export(out, f"{name}_fwd", lambda x: forward(x, x, x), q)
        _export(out, f"{name}_grad", jax.grad(lambda x: loss(x, x, x)), q)
    else:
        _export(out, f"{name}_fwd", forward, q, kv, kv)
        _export(out, f"{name}_grad", jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)


def _configs() -> dict[str, list]:
    """Heuristics and autotuning configs of the forward and the VJP."""
    found = {}
    for name, (q, k, kwargs) in {
            "d64": ((2, 256, 4, 64), (2, 256, 4, 64), {}),
            "d128c": ((4, 8192, 16, 128), (4, 8192, 16, 128), dict(is_causal=True)),
            "d256": ((2, 256, 4, 256), (2, 256, 4, 256), {})}.items():
        ba = PallasMosaicGpuFlashAttention().bind(_sds(q), _sds(k), _sds(k), **kwargs)
        found[name] = [repr(ba.heuristics_config), sorted(map(repr, ba.autotuning_configs))]
        # Every head dim (d256 splits it in halves); six lines, as when d256 was skipped.
        lse = _sds((q[0], q[2], q[1]), jnp.float32)
        vba = PallasMosaicGpuFlashAttentionVjp().bind((lse,), _sds(q), _sds(q),
                                                      **ba.arguments)
        found[name + "_vjp"] = [repr(vba.heuristics_config),
                                sorted(map(repr, vba.autotuning_configs))]
    return found


def _library_entries(out: pathlib.Path) -> None:
    """Every config of every shipped H200 cache entry of the two ops, exported explicitly:
    the programs whose timings a re-stamp would keep (the cache itself is not consulted,
    so a stale entry cannot change what is compared)."""
    from tokamax_pass.autotuning.cache import library_result

    result = library_result(H200)
    ops = (PallasMosaicGpuFlashAttention, PallasMosaicGpuFlashAttentionVjp)
    entries = [e for e in (result.entries if result else ()) if isinstance(e.bound.op, ops)]
    for i, entry in enumerate(entries):
        args = entry.bound.arguments
        q, k = args["query"], args["key"]
        kwargs = dict(scale=args["scale"], is_causal=args["is_causal"])
        shared = bool(args.get("shared_inputs"))
        for j, config in enumerate(sorted(entry.data, key=repr)):
            name = f"library_{i}_{type(entry.bound.op).__name__}_{j}"
            try:
                if isinstance(entry.bound.op, PallasMosaicGpuFlashAttentionVjp):
                    op = functools.partial(PallasMosaicGpuFlashAttention(
                        vjp=PallasMosaicGpuFlashAttentionVjp(config=config)), **kwargs)

                    def loss(q, k, v, op=op):
                        return (op(q, k, v).astype(jnp.float32) ** 2).sum()

                    if shared:
                        _export(out, name, jax.grad(lambda x, f=loss: f(x, x, x)), q)
                    else:
                        _export(out, name, jax.grad(loss, argnums=(0, 1, 2)), q, k, k)
                else:
                    op = functools.partial(PallasMosaicGpuFlashAttention(config=config),
                                           **kwargs)
                    _export(out, name, op, q, k, k)
            except Exception as e:  # noqa: BLE001 - a config that does not lower is recorded
                (out / f"{name}.error").write_text(f"{config!r}: {type(e).__name__}: {e}")


def main(out: pathlib.Path) -> None:
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    jax.config.update("jax_traceback_in_locations_limit", 0)
    out.mkdir(parents=True, exist_ok=True)
    _case(out, "d64", _sds((2, 256, 4, 64)), _sds((2, 256, 4, 64)))
    _case(out, "d128_causal", _sds((2, 256, 4, 128)), _sds((2, 512, 4, 128)), is_causal=True)
    _case(out, "d128", _sds((2, 512, 4, 128)), _sds((2, 256, 4, 128)))
    _case(out, "gqa_d64_causal", _sds((2, 256, 4, 64)), _sds((2, 256, 2, 64)), is_causal=True)
    _case(out, "mqa_d128", _sds((2, 256, 4, 128)), _sds((2, 256, 1, 128)))
    _case(out, "self_d64", _sds((2, 256, 4, 64)), None, self_attention=True)
    _case(out, "self_d128_causal", _sds((2, 256, 2, 128)), None, self_attention=True,
          is_causal=True)
    _case(out, "seed_d64", _sds((32, 2048, 16, 64)), _sds((32, 2048, 16, 64)))
    _case(out, "long_d128_causal", _sds((4, 8192, 16, 128)), _sds((4, 8192, 16, 128)),
          is_causal=True)
    _export(out, "d256_fwd", lambda q: dot_product_attention(q, q, q, implementation="mosaic"),
            _sds((2, 256, 4, 256)))

    def with_lengths(q, k, v, n):
        o = dot_product_attention(q, k, v, implementation="mosaic", is_causal=True,
                                  query_seq_lengths=n, key_value_seq_lengths=n)
        return (o.astype(jnp.float32) ** 2).sum()

    _export(out, "lengths_grad", jax.grad(with_lengths, argnums=(0, 1, 2)),
            _sds((2, 256, 4, 64)), _sds((2, 256, 2, 64)), _sds((2, 256, 2, 64)),
            _sds((2,), jnp.int32))
    (out / "configs.json").write_text(json.dumps(_configs(), indent=1))
    _library_entries(out)
    # Added after the rest, so that the older programs keep their source lines.
    _case(out, "d256_gqa_causal", _sds((2, 256, 4, 256)), _sds((2, 256, 2, 256)),
          is_causal=True)
    _case(out, "gemma2_d256", _sds((2, 512, 8, 256)), _sds((2, 512, 4, 256)), is_causal=True,
          local_window_size=(256, 0), logits_soft_cap=50.0)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
