"""Randomized differential checks of the Pallas kernels: each seed draws a small case (shapes
that no block divides, GQA groups of 1 to 4, head dims that are no powers of 2, broadcast
biases and masks, windows, soft caps, lengths of 0, norms without scale or offset, ragged
groups that are empty or hold every row, int8 and float8 operands) and block configs of
the kernel's own space, and compares the kernel's forward and gradients (random
cotangents) in Pallas interpret mode with the family's `xla` implementation. Lowering
cases export the Triton kernels for an H200 at realistic sizes with the heuristic config or
one of the autotuning space: a lowering may raise `NotImplementedError` (a clear
refusal), nothing else.

A few seeds run in CI; `pytest -m slow tests/ops/test_kernel_fuzz.py` runs many more. A
failing seed's case is in the assertion message, to be kept as a regression test of the
kernel's own file."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

import tokamax_pass
from conftest import H200, TOLERANCE, random_normal, reference_precision
from tokamax_kernels.attention import (
    PallasMosaicGpuFlashAttention,
    PallasMosaicGpuFlashAttentionVjp,
    PallasTritonFlashAttention,
    PallasTritonFlashAttentionConfig,
    PallasTritonFlashAttentionVjp,
    PallasTritonFlashAttentionVjpConfig,
)
from tokamax_kernels.attention.api import dot_product_attention
from tokamax_kernels.attention.pallas_mosaic_tpu import Config as TpuAttentionConfig
from tokamax_kernels.attention.pallas_mosaic_tpu import PallasMosaicTpuFlashAttention
from tokamax_kernels.attention.pallas_mosaic_tpu_vjp import PallasMosaicTpuFlashAttentionVjp
from tokamax_kernels.gated_linear_unit import pallas_triton as glu_triton
from tokamax_kernels.gated_linear_unit.api import gated_linear_unit
from tokamax_kernels.gated_linear_unit.pallas_triton_vjp import PallasTritonGatedLinearUnitVjp
from tokamax_kernels.layer_norm import pallas_triton as ln_triton
from tokamax_kernels.layer_norm import pallas_triton_vjp as ln_triton_vjp
from tokamax_kernels.layer_norm.api import layer_norm
from tokamax_kernels.linear_softmax_cross_entropy_loss import (
    MosaicTpuLossConfig,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLoss,
    PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp,
)
from tokamax_kernels.linear_softmax_cross_entropy_loss.api import (
    linear_softmax_cross_entropy_loss,
)
from tokamax_kernels.ragged_dot import PallasTritonRaggedDot, QuantizedArray
from tokamax_kernels.ragged_dot.api import ragged_dot
from tokamax_kernels.ragged_dot.pallas_triton import Config as RaggedDotConfig
from tokamax_pass import core

# A gradient that is zero in the reference (a query row that sees one key has no query
# gradient; a bias the same for every key has none) is matched within the rounding of the
# O(1) terms it sums, not within 1e-6.
SCALE_FLOOR = 0.1
# float32 relative tolerance: the interpreted kernels sum in blocks, in another order than
# XLA (`test_triton_attention.py` uses the same).
FLOAT32_RTOL = 1e-4
SMALL_BLOCKS = (16, 32, 64)

type Case = dict[str, Any]


def assert_matches(actual: Any, expected: Any, dtype: Any, case: Case,
                   peer: Any = None) -> None:
    """Every leaf of `actual` within the dtype's tolerance of `expected`'s (the scale
    floored at `SCALE_FLOOR`), or no further from it than twice `peer`'s leaf (`xla` at
    the kernel's 16-bit dtype, whose roundings of the gradients' intermediates cost it
    more than 2% where sums cancel); the case in the message."""
    dtype = jnp.dtype(dtype)
    rtol = FLOAT32_RTOL if dtype == jnp.float32 else TOLERANCE[dtype]
    leaves = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    peers = jax.tree.leaves(peer) if peer is not None else [None] * len(jax.tree.leaves(actual))
    for index, ((got, want), other) in enumerate(zip(leaves, peers, strict=True)):
        got, want = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (got, want))
        assert got.shape == want.shape, (index, got.shape, want.shape, case)
        scale = max(float(np.max(np.abs(want), initial=0.0)), SCALE_FLOOR)
        allowed = rtol * scale
        if other is not None:
            other = np.asarray(jnp.asarray(other, jnp.float32))
            allowed = max(allowed, 2 * float(np.max(np.abs(other - want), initial=0.0)))
        err = float(np.max(np.abs(got - want), initial=0.0))
        assert err <= allowed, (
            f"leaf {index}: max abs error {err:.3g} > {allowed:.3g} (scale {scale:.3g}); {case}")


def value_and_grads(impl: Any, fn: Callable[..., Any], args: tuple, argnums: tuple[int, ...],
                    cotangents: list[jax.Array]) -> tuple[Any, Any]:
    """`fn(impl, *args)` and the gradients at `argnums` (of `args`) of its outputs' sum with
    `cotangents` (a nonlinear `sin` first, so the gradient depends on the values)."""
    def loss(*args):
        out = fn(impl, *args)
        leaves = jax.tree.leaves(out)
        total = sum(jnp.sum(jnp.sin(x.astype(jnp.float32)) * c)
                    for x, c in zip(leaves, cotangents, strict=True))
        return total, out
    (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(*args)
    return out, grads


def as_float32(tree: Any) -> Any:
    """`tree` with its 16-bit float arrays cast to float32 (int8 and float8 values of
    quantized operands stay as they are)."""
    def cast(x):
        narrow = getattr(x, "dtype", None) in (jnp.bfloat16, jnp.float16)
        return x.astype(jnp.float32) if narrow else x
    return jax.tree.map(cast, tree)


def differential(kernel: Any, fn: Callable[..., Any], args: tuple, argnums: tuple[int, ...],
                 cotangent_shapes: list[tuple[int, ...]], dtype: Any, case: Case) -> None:
    """The kernel's values and gradients against the `xla` implementation's on the same
    inputs in float32 at HIGHEST precision (a 16-bit `xla` run rounds where the kernel
    does not, and strays further from the exact result than the kernel)."""
    cotangents = [random_normal(100 + i, s) for i, s in enumerate(cotangent_shapes)]
    with reference_precision():
        got = value_and_grads(kernel, fn, args, argnums, cotangents)
        want = value_and_grads("xla", fn, as_float32(args), argnums, cotangents)
        peer = None
        if jnp.dtype(dtype) != jnp.float32:
            peer = value_and_grads("xla", fn, args, argnums, cotangents)
    assert_matches(got, want, dtype, case, peer)


# Attention.


def attention_case(rng: random.Random, *, bias_and_mask: bool = True) -> Case:
    batch, seq_q, seq_k = rng.randint(1, 3), rng.randint(1, 90), rng.randint(1, 90)
    kv_heads, group = rng.randint(1, 2), rng.choice((1, 2, 3, 4))
    head_dim = rng.choice((8, 12, 16, 24, 33, 40, 64, 72))
    heads = kv_heads * group
    case: Case = dict(batch=batch, seq_q=seq_q, seq_k=seq_k, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, value_dim=rng.choice((head_dim, head_dim, 8, 17, 40)),
                      dtype=rng.choice(("float32", "float32", "bfloat16", "float16")),
                      bias=None, mask=None, options={})
    if bias_and_mask and rng.random() < 0.4:
        case["bias"] = (*(rng.choice((n, 1)) for n in (batch, heads, seq_q)),
                        rng.choice((seq_k, seq_k, 1)))
    if bias_and_mask and rng.random() < 0.25:
        case["mask"] = tuple(rng.choice((n, 1)) for n in (batch, heads, seq_q, seq_k))
    options = case["options"]
    if rng.random() < 0.3:
        options["is_causal"] = True
    if rng.random() < 0.3:
        options["local_window_size"] = (rng.randint(0, 60), rng.randint(0, 60))
    if rng.random() < 0.2:
        options["logits_soft_cap"] = rng.choice((2.0, 5.0))
    if rng.random() < 0.2:
        options["scale"] = rng.choice((0.05, 2.5))
    for name, seq in (("query_seq_lengths", seq_q), ("key_value_seq_lengths", seq_k)):
        if rng.random() < 0.25:
            options[name] = [rng.choice((0, seq, rng.randint(0, seq))) for _ in range(batch)]
    options["return_residual"] = rng.random() < 0.2
    return case


def attention_inputs(case: Case) -> tuple:
    dtype = jnp.dtype(case["dtype"])
    b, h, kvh = case["batch"], case["heads"], case["kv_heads"]
    q = random_normal(0, (b, case["seq_q"], h, case["head_dim"]), dtype)
    k = random_normal(1, (b, case["seq_k"], kvh, case["head_dim"]), dtype)
    v = random_normal(2, (b, case["seq_k"], kvh, case["value_dim"]), dtype)
    bias = None if case["bias"] is None else random_normal(3, case["bias"], dtype)
    return q, k, v, bias


def check_attention(kernel: Any, case: Case) -> None:
    q, k, v, bias = attention_inputs(case)
    mask = None if case["mask"] is None else random_normal(4, case["mask"]) > -0.5
    options = {name: jnp.asarray(x, jnp.int32) if name.endswith("lengths") else x
               for name, x in case["options"].items()}

    def attention(impl, q, k, v, bias):
        out = dot_product_attention(q, k, v, bias, mask, implementation=impl,
                                    precision="highest", **options)
        if not options["return_residual"]:
            return out
        out, lse = out
        # The lse of a row that sees no key is a stand-in (-0.7 * float32 max).
        return out, jnp.where(lse > -1e30, lse, 0)

    shapes = [(*q.shape[:-1], v.shape[-1])]
    if options["return_residual"]:
        shapes.append(q.shape[:-1])
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    differential(kernel, attention, (q, k, v, bias), argnums, shapes, q.dtype, case)


def triton_attention(rng: random.Random) -> tuple[Any, Case]:
    case = attention_case(rng)
    fwd = PallasTritonFlashAttentionConfig(block_q=rng.choice(SMALL_BLOCKS),
                                           block_k=rng.choice(SMALL_BLOCKS),
                                           num_warps=4, num_stages=2)
    vjp = PallasTritonFlashAttentionVjpConfig(
        block_q_dkv=rng.choice(SMALL_BLOCKS), block_k_dkv=rng.choice(SMALL_BLOCKS),
        num_warps_dkv=4, num_stages_dkv=2, block_q_dq=rng.choice(SMALL_BLOCKS),
        block_k_dq=rng.choice(SMALL_BLOCKS), num_warps_dq=4, num_stages_dq=2)
    case["configs"] = (fwd, vjp)
    kernel = PallasTritonFlashAttention(
        interpret=True, config=fwd, vjp=PallasTritonFlashAttentionVjp(interpret=True, config=vjp))
    return kernel, case


def mosaic_tpu_attention(rng: random.Random) -> tuple[Any, Case]:
    """The TPU kernels take no bias or mask, and one head dim for queries and values."""
    case = attention_case(rng, bias_and_mask=False)
    case["value_dim"] = case["head_dim"]
    case["dtype"] = "bfloat16" if case["dtype"] == "float16" else case["dtype"]
    fwd, vjp = (TpuAttentionConfig(rng.choice((16, 32, 48)), rng.choice((16, 32, 48)))
                for _ in range(2))
    case["configs"] = (fwd, vjp)
    kernel = PallasMosaicTpuFlashAttention(
        interpret=True, config=fwd,
        vjp=PallasMosaicTpuFlashAttentionVjp(interpret=True, config=vjp))
    return kernel, case


# Layer norm, gated linear unit, ragged dot.


def check_triton_layer_norm(rng: random.Random) -> None:
    dtype = jnp.dtype(rng.choice(("float32", "bfloat16")))
    rows = tuple(rng.randint(1, 9) for _ in range(rng.randint(0, 2)))
    n = rng.choice((1, 3, 17, 40, 63, 100, 129, 300))
    shape = (*rows, n)

    def config(cls):
        block_rows = rng.choice((1, 2, 4, 8))
        return cls(block_rows=block_rows, block_n=rng.choice((16, 32, 64, 128, 256)),
                   rows_per_program=block_rows * rng.choice((1, 2, 4)), num_warps=4,
                   num_stages=rng.choice((1, 2)))
    fwd, vjp = config(ln_triton.Config), config(ln_triton_vjp.Config)
    kernel = ln_triton.PallasTritonLayerNorm(
        interpret=True, config=fwd,
        vjp=ln_triton_vjp.PallasTritonLayerNormVjp(interpret=True, config=vjp))
    x = random_normal(0, shape, dtype) * 2 + 0.5
    scale = random_normal(1, (n,), dtype) if rng.random() < 0.7 else None
    offset = random_normal(2, (n,), dtype) if rng.random() < 0.7 else None
    residual = random_normal(3, shape, dtype) if rng.random() < 0.3 else None
    options = dict(subtract_mean=rng.random() < 0.6, scale_offset=rng.choice((0.0, 0.0, 1.0)),
                   epsilon=rng.choice((1e-6, 1e-2)))
    case = dict(shape=shape, dtype=dtype.name, scale=scale is not None,
                offset=offset is not None, residual=residual is not None, **options,
                configs=(fwd, vjp))

    def norm(impl, x, scale, offset, residual):
        return layer_norm(x, scale, offset, residual=residual, implementation=impl, **options)

    args = (x, scale, offset, residual)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)
    differential(kernel, norm, args, argnums,
                 [shape] * (1 if residual is None else 2), dtype, case)


def matmul_config(rng: random.Random) -> Any:
    return glu_triton.Config(block_m=rng.choice(SMALL_BLOCKS), block_n=rng.choice(SMALL_BLOCKS),
                             block_k=rng.choice(SMALL_BLOCKS), num_warps=4, num_stages=2)


def check_triton_gated_linear_unit(rng: random.Random) -> None:
    dtype = jnp.dtype(rng.choice(("float32", "bfloat16")))
    leading = (rng.randint(1, 3),) if rng.random() < 0.5 else ()
    m, k, n = rng.randint(1, 70), rng.choice((8, 17, 40, 64, 72)), rng.choice((8, 24, 33, 72))
    fwd, vjp = matmul_config(rng), matmul_config(rng)
    kernel = glu_triton.PallasTritonGatedLinearUnit(
        interpret=True, config=fwd, vjp=PallasTritonGatedLinearUnitVjp(interpret=True, config=vjp))
    activation = rng.choice((None, jax.nn.swish, jax.nn.gelu, jax.nn.relu))
    x = random_normal(0, (*leading, m, k), dtype)
    weights = random_normal(1, (k, 2, n), dtype) / 4
    fused = rng.random() < 0.5
    weights = weights if fused else (weights[:, 0], weights[:, 1])
    case = dict(shape=(*leading, m, k), n=n, dtype=dtype.name, fused=fused,
                activation=getattr(activation, "__name__", None), configs=(fwd, vjp))

    def glu(impl, x, weights):
        return gated_linear_unit(x, weights, activation=activation, precision="highest",
                                 implementation=impl)

    differential(kernel, glu, (x, weights), (0, 1), [(*leading, m, n)], dtype, case)


def group_sizes(rng: random.Random, groups: int, m: int) -> list[int]:
    """Every row in one group; or random cuts, summing to m or to less (rows past the sum)."""
    if rng.random() < 0.2:
        sizes = [0] * groups
        sizes[rng.randrange(groups)] = m
        return sizes
    cuts = sorted(rng.randint(0, m) for _ in range(groups))
    sizes = [cuts[0]] + [b - a for a, b in itertools.pairwise(cuts)]
    if rng.random() < 0.5:
        sizes[-1] += m - sum(sizes)
    return sizes


def check_triton_ragged_dot(rng: random.Random) -> None:
    """Plain operands (values, dlhs, drhs), or int8 / float8 weights with scales per
    channel or per 16 rows of K (values, dlhs), and activations quantized too (values)."""
    dtype = jnp.dtype(rng.choice(("float32", "bfloat16")))
    m, k, n = rng.randint(1, 80), rng.choice((16, 32, 48, 64)), rng.choice((8, 24, 33, 48))
    groups = rng.randint(1, 5)
    sizes = group_sizes(rng, groups, m)
    config = RaggedDotConfig(block_m=rng.choice(SMALL_BLOCKS), block_n=rng.choice(SMALL_BLOCKS),
                             block_k=rng.choice(SMALL_BLOCKS), num_warps=4, num_stages=2)
    kernel = PallasTritonRaggedDot(interpret=True, config=config)
    lhs, rhs = random_normal(0, (m, k), dtype), random_normal(1, (groups, k, n), dtype)
    case: Case = dict(m=m, k=k, n=n, sizes=sizes, dtype=dtype.name, config=config)
    sizes_array = jnp.asarray(sizes, jnp.int32)
    if rng.random() < 0.4:
        qtype = jnp.dtype(rng.choice(("int8", "float8_e4m3fn")))
        axes = rng.choice((dict(channelwise_axes=(0, 2)), dict(channelwise_axes=(0,)),
                           dict(channelwise_axes=(0, 2), tiled_axes={1: 16})))
        rhs = QuantizedArray.quantize(rhs, qtype, **axes)
        quantized_lhs = rng.random() < 0.3
        if quantized_lhs:
            lhs = QuantizedArray.quantize(lhs, qtype, channelwise_axes=(0,))
        case |= dict(qtype=qtype.name, rhs_axes=axes, quantized_lhs=quantized_lhs)
        argnums: tuple[int, ...] = () if quantized_lhs else (0,)
    else:
        argnums = (0, 1)

    def dot(impl, lhs, rhs):
        return ragged_dot(lhs, rhs, sizes_array, precision="highest", implementation=impl)

    if argnums:
        differential(kernel, dot, (lhs, rhs), argnums, [(m, n)], dtype, case)
    else:
        with reference_precision():
            assert_matches(dot(kernel, lhs, rhs), dot("xla", *as_float32((lhs, rhs))), dtype,
                           case)


def check_mosaic_tpu_cross_entropy(rng: random.Random) -> None:
    """Tokens, H and V that no block divides; ignored labels; each reduction, soft cap,
    label smoothing (without a cap) and z-loss."""
    dtype = jnp.dtype(rng.choice(("float32", "bfloat16")))
    tokens = (rng.randint(1, 3), rng.randint(1, 40))
    h, v = rng.choice((40, 128, 200, 260)), rng.choice((100, 128, 300, 520))
    config = MosaicTpuLossConfig(block_tokens=rng.choice((16, 32)),
                                 block_vocab=rng.choice((128, 256)),
                                 block_h=rng.choice((128, 256)))
    kernel = PallasMosaicTpuLinearSoftmaxCrossEntropyLoss(
        interpret=True, config=config,
        vjp=PallasMosaicTpuLinearSoftmaxCrossEntropyLossVjp(interpret=True, config=config))
    x = random_normal(0, (*tokens, h), dtype)
    weights = (random_normal(1, (h, v)) / np.sqrt(h) * 2).astype(dtype)
    labels = np.asarray(jax.random.randint(jax.random.key(2), tokens, -1, v))
    options: dict[str, Any] = dict(reduction=rng.choice(("sum", "mean", "none")))
    if rng.random() < 0.3:
        options["logits_soft_cap"] = rng.choice((3.0, 30.0))
    elif rng.random() < 0.3:
        options["label_smoothing"] = 0.1
    if rng.random() < 0.3:
        options["z_loss"] = 1e-3
    case = dict(tokens=tokens, h=h, v=v, dtype=dtype.name, config=config, **options)

    def loss(impl, x, weights):
        return linear_softmax_cross_entropy_loss(x, labels, weights, implementation=impl,
                                                 precision="highest", **options)

    shape = tokens if options["reduction"] == "none" else ()
    differential(kernel, loss, (x, weights), (0, 1), [shape], dtype, case)


# Lowering for an H200.


def h200():
    """An H200 to lower for; Auto axes, which `jax.lax.ragged_dot_general` (the ragged
    dot's reference, used for shapes) needs."""
    return jax.sharding.use_abstract_mesh(AbstractMesh(
        (1,), ("_target",), axis_types=(AxisType.Auto,),
        abstract_device=AbstractDevice(H200, None, "cuda")))


def lowers_or_refuses(fn: Callable[..., Any], *args: Any, kernel: str = "__gpu$xla.gpu.triton"
                      ) -> None:
    """`fn` exports for cuda with a `kernel` call in it, or raises `NotImplementedError`."""
    try:
        with h200(), core.targeting(H200):
            exported = jax.export.export(
                jax.jit(fn), platforms=["cuda"],
                disabled_checks=tokamax_pass.DISABLE_JAX_EXPORT_CHECKS)(*args)
    except NotImplementedError:
        return
    assert kernel in exported.mlir_module()


def tuned(rng: random.Random, op_cls: Any, *args: Any, **keywords: Any) -> tuple[Any, Any]:
    """`op_cls` with its heuristic config (`None`) or one drawn from its autotuning space."""
    if rng.random() < 0.4:
        return op_cls(), None
    with h200(), core.targeting(H200):
        configs = sorted(op_cls().bind(*args, **keywords).autotuning_configs, key=str)
    config = rng.choice(configs)
    return op_cls(config=config), config


def summed_gradient(fn: Callable[..., Any], argnums: tuple[int, ...]) -> Callable[..., Any]:
    def loss(*args):
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(fn(*args)))
    return jax.grad(loss, argnums=argnums)


def lower_attention(rng: random.Random, case: Case, fwd_cls: Any, vjp_cls: Any,
                    kernel: str) -> Case:
    """`case`'s attention and its gradient exported with `fwd_cls` and `vjp_cls`, their
    heuristic configs or ones drawn from their autotuning spaces."""
    q, k, v, bias = attention_inputs_shapes(case)
    mask = None if case["mask"] is None else jax.ShapeDtypeStruct(case["mask"], jnp.bool_)
    options = dict(case["options"])
    lengths = {name: jax.ShapeDtypeStruct((case["batch"],), jnp.int32)
               for name in ("query_seq_lengths", "key_value_seq_lengths")
               if options.pop(name, None) is not None}
    op = fwd_cls()
    if rng.random() < 0.6:
        with core.targeting(H200):
            try:
                bound = op.bind(q, k, v, bias, mask, **lengths,
                                is_causal=options.get("is_causal", False))
                vjp_bound = vjp_cls().bind((None,), None, None, **bound.arguments)
                configs = (rng.choice(sorted(bound.autotuning_configs, key=str)),
                           rng.choice(sorted(vjp_bound.autotuning_configs, key=str)))
            except NotImplementedError:
                return case
        op = fwd_cls(config=configs[0], vjp=vjp_cls(config=configs[1]))
        case["configs"] = configs

    def attention(q, k, v, bias, mask, lengths):
        return dot_product_attention(q, k, v, bias, mask, implementation=op, **lengths,
                                     **options)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    for fn in (attention, summed_gradient(attention, argnums)):
        lowers_or_refuses(fn, q, k, v, bias, mask, lengths, kernel=kernel)
    return case


def lower_triton_attention(rng: random.Random) -> Case:
    """Long sequences (200 to 700) and head dims to 256, or the small cases' sizes."""
    case = attention_case(rng)
    if rng.random() < 0.5:
        case["seq_q"] = rng.randint(200, 700)
        case["seq_k"] = rng.choice((case["seq_q"], rng.randint(200, 700)))
        case["head_dim"] = rng.choice((40, 64, 72, 96, 128, 160, 256))
        case["value_dim"] = rng.choice((case["head_dim"], 64, 96))
        for name in ("bias", "mask"):
            if case[name] is not None:
                case[name] = (*case[name][:2], case["seq_q"], case["seq_k"])
    return lower_attention(rng, case, PallasTritonFlashAttention, PallasTritonFlashAttentionVjp,
                           "__gpu$xla.gpu.triton")


def lower_mosaic_gpu_attention(rng: random.Random) -> Case:
    """Within what the Mosaic GPU kernels take (no bias, head dims 64, 128 or 256 for
    queries and values, sequences in 128-row blocks), at 16-bit dtypes."""
    case = attention_case(rng, bias_and_mask=False)
    case["seq_q"] = 128 * rng.randint(1, 6)
    case["seq_k"] = rng.choice((case["seq_q"], 128 * rng.randint(1, 6)))
    case["head_dim"] = case["value_dim"] = rng.choice((64, 128, 256))
    case["dtype"] = rng.choice(("bfloat16", "float16"))
    return lower_attention(rng, case, PallasMosaicGpuFlashAttention,
                           PallasMosaicGpuFlashAttentionVjp, "mosaic_gpu")


def attention_inputs_shapes(case: Case) -> tuple:
    dtype = jnp.dtype(case["dtype"])
    b, h, kvh = case["batch"], case["heads"], case["kv_heads"]
    shapes = ((b, case["seq_q"], h, case["head_dim"]), (b, case["seq_k"], kvh, case["head_dim"]),
              (b, case["seq_k"], kvh, case["value_dim"]), case["bias"])
    return tuple(None if s is None else jax.ShapeDtypeStruct(s, dtype) for s in shapes)


def lower_triton_layer_norm(rng: random.Random) -> Case:
    dtype = jnp.dtype(rng.choice(("bfloat16", "float16", "float32")))
    n = rng.choice((7, 40, 257, 1000, 4096, 5120, 12288, 16385))
    x = jax.ShapeDtypeStruct((rng.randint(1, 8), rng.randint(1, 700), n), dtype)
    scale = jax.ShapeDtypeStruct((n,), dtype) if rng.random() < 0.7 else None
    offset = jax.ShapeDtypeStruct((n,), dtype) if rng.random() < 0.7 else None
    with_residual, subtract_mean = rng.random() < 0.3, rng.random() < 0.6
    op, config = tuned(rng, ln_triton.PallasTritonLayerNorm, x, scale, offset,
                       subtract_mean=subtract_mean)

    def norm(x, scale, offset):
        return layer_norm(x, scale, offset, subtract_mean=subtract_mean,
                          residual=x if with_residual else None, implementation=op)
    argnums = tuple(i for i, a in enumerate((x, scale, offset)) if a is not None)
    lowers_or_refuses(summed_gradient(norm, argnums), x, scale, offset)
    return dict(x=x, scale=scale is not None, offset=offset is not None,
                residual=with_residual, subtract_mean=subtract_mean, config=config)


def lower_triton_gated_linear_unit(rng: random.Random) -> Case:
    dtype = jnp.dtype(rng.choice(("bfloat16", "float16", "float32")))
    m, k = rng.randint(1, 1500), rng.choice((40, 72, 256, 512, 1000, 2048))
    n = rng.choice((24, 72, 384, 1000, 1408))
    x = jax.ShapeDtypeStruct((m, k), dtype)
    pair = (jax.ShapeDtypeStruct((k, n), dtype),) * 2
    weights = jax.ShapeDtypeStruct((k, 2, n), dtype) if rng.random() < 0.5 else pair
    activation = rng.choice((None, jax.nn.swish, jax.nn.gelu))
    op, config = tuned(rng, glu_triton.PallasTritonGatedLinearUnit, x, weights,
                       activation=activation)

    def glu(x, weights):
        return gated_linear_unit(x, weights, activation=activation, implementation=op)
    lowers_or_refuses(summed_gradient(glu, (0, 1)), x, weights)
    return dict(x=x, weights=weights, config=config)


def lower_triton_ragged_dot(rng: random.Random) -> Case:
    """Plain operands (values and both gradients), or int8 / float8 weights with scales
    per channel or per block of K (values and dlhs; float8 activations: values)."""
    dtype = jnp.dtype(rng.choice(("bfloat16", "float16", "float32")))
    m, k = rng.randint(1, 2000), rng.choice((64, 72, 256, 512, 1000, 2048))
    n, groups = rng.choice((24, 72, 384, 1000, 1408)), rng.randint(1, 16)
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    if rng.random() < 0.5:
        op, config = tuned(rng, PallasTritonRaggedDot, jax.ShapeDtypeStruct((m, k), dtype),
                           jax.ShapeDtypeStruct((groups, k, n), dtype), sizes)
        lowers_or_refuses(summed_gradient(
            lambda lhs, rhs, sizes: ragged_dot(lhs, rhs, sizes, implementation=op), (0, 1)),
            jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((groups, k, n), dtype),
            sizes)
        return dict(m=m, k=k, n=n, groups=groups, dtype=dtype.name, config=config)
    qtype = jnp.dtype(rng.choice(("int8", "float8_e4m3fn")))
    blocks = rng.choice([b for b in (1, k // 64, k // 128) if b and k % b == 0])
    quantized_lhs = rng.random() < 0.4
    scale_dtype = jnp.dtype(rng.choice(("bfloat16", "float32")))

    def fn(lhs, qvalue, scale, sizes):
        rhs = QuantizedArray(qvalue, scale)
        if quantized_lhs:
            lhs = QuantizedArray(lhs, jnp.ones((m, blocks), scale_dtype))
            return ragged_dot(lhs, rhs, sizes, implementation="triton")
        return summed_gradient(
            lambda lhs: ragged_dot(lhs, rhs, sizes, implementation="triton"), (0,))(lhs)

    lowers_or_refuses(fn, jax.ShapeDtypeStruct((m, k), qtype if quantized_lhs else dtype),
                      jax.ShapeDtypeStruct((groups, k, n), qtype),
                      jax.ShapeDtypeStruct((groups, blocks, n), scale_dtype), sizes)
    return dict(m=m, k=k, n=n, groups=groups, dtype=dtype.name, qtype=qtype.name,
                blocks=blocks, quantized_lhs=quantized_lhs)


# Seeds: those in `ci` run in CI (drawn cases that are small, yet take several options at
# once: seed 7's attention has a per-batch key mask, causal, a soft cap, a value head dim
# unlike the query's and the lse), the rest are slow.


def seeds(ci: list[int], slow: range) -> list[Any]:
    return [*ci, *(pytest.param(s, marks=pytest.mark.slow) for s in slow if s not in ci)]


@pytest.mark.parametrize("seed", seeds([7], range(0, 60)))
def test_triton_attention_matches_xla(seed):
    check_attention(*triton_attention(random.Random(seed)))


@pytest.mark.parametrize("seed", seeds([], range(0, 20)))
def test_mosaic_tpu_attention_matches_xla(seed):
    check_attention(*mosaic_tpu_attention(random.Random(seed)))


@pytest.mark.parametrize("seed", seeds([], range(0, 20)))
def test_mosaic_tpu_cross_entropy_matches_xla(seed):
    check_mosaic_tpu_cross_entropy(random.Random(seed))


@pytest.mark.parametrize("seed", seeds([6], range(0, 40)))
def test_triton_layer_norm_matches_xla(seed):
    check_triton_layer_norm(random.Random(seed))


@pytest.mark.parametrize("seed", seeds([1], range(0, 40)))
def test_triton_gated_linear_unit_matches_xla(seed):
    check_triton_gated_linear_unit(random.Random(seed))


@pytest.mark.parametrize("seed", seeds([19], range(0, 40)))
def test_triton_ragged_dot_matches_xla(seed):
    check_triton_ragged_dot(random.Random(seed))


@pytest.mark.parametrize("seed", seeds([9], range(0, 100)))
@pytest.mark.parametrize("family", ["attention", "layer_norm", "gated_linear_unit",
                                    "ragged_dot"])
def test_triton_lowers_for_cuda_or_refuses(family, seed):
    lower = {"attention": lower_triton_attention, "layer_norm": lower_triton_layer_norm,
             "gated_linear_unit": lower_triton_gated_linear_unit,
             "ragged_dot": lower_triton_ragged_dot}[family]
    lower(random.Random(seed))


@pytest.mark.parametrize("seed", seeds([], range(0, 30)))
def test_mosaic_gpu_attention_lowers_for_cuda_or_refuses(seed):
    lower_mosaic_gpu_attention(random.Random(seed))
