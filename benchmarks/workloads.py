"""Named benchmark workloads: inputs, work (FLOPs or bytes), our ops and the peers.

Each workload makes its inputs once and offers candidate functions of those
inputs: ours (`tokamax_pass` with each implementation), peers (JAX, cuDNN, the
Pallas kernels JAX ships, FlashAttention-3 where installed) and ceilings
(`ceilings.py`: the same bytes or FLOPs by the simplest kernel).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from benchmarks import ceilings

H200_BF16_TFLOPS = 776.0
H200_COPY_TBPS = 4.29
# Forward+backward work in units of the forward's: attention's backward recomputes the
# scores and does five products to the forward's two; a matmul's backward does two.
ATTENTION_FWD_BWD_WORK = 3.5
MATMUL_FWD_BWD_WORK = 3.0


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark problem: `make()` gives the inputs, `work(mode)` its FLOPs or bytes."""

    name: str
    family: str
    make: Callable[[], tuple[Any, ...]]
    work: Callable[[str], float]
    unit: str  # "TFLOP/s" or "TB/s"
    reference: Callable[..., Any]
    ours: dict[str, Callable[..., Any]]
    peers: dict[str, Callable[..., Any]]
    ceilings: dict[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A peer that needs its inputs converted first (a dtype it insists on, a scale it
    does not take): `prepare(*inputs)` runs once, outside the timing."""

    fn: Callable[..., Any]
    prepare: Callable[..., tuple[Any, ...]]

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# --- attention -------------------------------------------------------------------------

def _attention_peers(causal: bool, head_dim: int, gqa: bool) -> dict[str, Callable[..., Any]]:
    scale = head_dim**-0.5
    peers = {
        "jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"),
        "jax.nn cudnn": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="cudnn"),
    }
    try:
        from flash_attn3_jax import flash_mha  # optional peer, installed from its wheel
    except ImportError:
        flash_mha = None
    if flash_mha is not None:
        peers["flash-attn3"] = lambda q, k, v: flash_mha(q, k, v, is_causal=causal)
    if gqa:  # JAX's Pallas kernels take one head count for q, k and v
        return peers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import attention as pallas_mha
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    block = pallas_mha.BlockSizes(
        block_q=64, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    peers["jax pallas mha (triton)"] = lambda q, k, v: pallas_mha.mha(
        q, k, v, None, sm_scale=scale, causal=causal, block_sizes=block)
    mgpu_config = attention_mgpu.TuningConfig(
        block_q=128, block_kv=128, max_concurrent_steps=2, causal=causal, compute_wgs_bwd=2,
        block_q_dkv=128, block_kv_dkv=64, block_q_dq=64, block_kv_dq=128)
    # It hard-codes float16 SMEM and takes q pre-scaled: both are done before the timing.
    peers["jax attention_mgpu (f16)"] = Prepared(
        lambda q, k, v: attention_mgpu.attention(q, k, v, mgpu_config),
        lambda q, k, v: ((q * scale).astype(jnp.float16), k.astype(jnp.float16),
                         v.astype(jnp.float16)))
    return peers


def _capped_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool,
                      window: int | None, soft_cap: float | None) -> jax.Array:
    """Attention written out in jnp (float32 logits, the cap, the masks, softmax, the
    probabilities in the inputs' dtype): what a user writes where `jax.nn` has no soft
    cap, and, in float32, the reference."""
    b, t, n, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, d)
    logits = jnp.einsum("bthgd,bshd->bhgts", q, k, preferred_element_type=jnp.float32)
    logits = logits / math.sqrt(d)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    rows, cols = jnp.arange(t)[:, None], jnp.arange(k.shape[1])[None, :]
    keep = jnp.ones((t, k.shape[1]), bool)
    if causal:
        keep &= cols <= rows
    if window is not None:
        keep &= rows - cols <= window
    probs = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1).astype(v.dtype)
    return jnp.einsum("bhgts,bshd->bthgd", probs, v).reshape(b, t, n, d)


def _attention_reference(causal: bool, window: int | None,
                         soft_cap: float | None) -> Callable[..., Any]:
    def reference(q, k, v):
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
        with jax.default_matmul_precision("highest"):
            return _capped_attention(q, k, v, causal=causal, window=window, soft_cap=soft_cap)
    return reference


def _attended_pairs(s: int, causal: bool, window: int | None) -> int:
    """(query, key) pairs a head computes: all, the causal half, or a causal window."""
    if not causal:
        return s * s
    if window is None or window >= s:
        return s * (s + 1) // 2
    return window * (window + 1) // 2 + (s - window) * (window + 1)


def attention(name: str, b: int, s: int, h: int, d: int, causal: bool, *,
              kv_heads: int | None = None, window: int | None = None,
              soft_cap: float | None = None) -> Workload:
    """Attention of (b, s, h, d) queries on `kv_heads` key/value heads (GQA when fewer than
    `h`); `window` (keys at most `window` back, causal) and `soft_cap` are Gemma-2's
    options. FLOPs count only the attended pairs (causal at about half)."""
    kv_heads = kv_heads or h
    if window is not None and not causal:
        raise ValueError("attention workload: a window is benchmarked with causal=True")
    fwd_flops = 4 * b * h * d * _attended_pairs(s, causal, window)
    extra: dict[str, Any] = {}
    if window is not None:
        extra["local_window_size"] = (window, 0)
    if soft_cap is not None:
        extra["logits_soft_cap"] = soft_cap
    impls = ("mosaic", "triton", "cudnn", "xla", None)
    ours = {
        f"tokamax {impl or 'None'}": functools.partial(
            lambda q, k, v, impl: tokamax.dot_product_attention(
                q, k, v, is_causal=causal, implementation=impl, **extra), impl=impl)
        for impl in impls
    }
    if soft_cap is None and window is None:
        peers = _attention_peers(causal, d, gqa=kv_heads != h)
    else:
        peers = {"jnp (soft cap and masks written out)": functools.partial(
            _capped_attention, causal=causal, window=window, soft_cap=soft_cap)}
        if soft_cap is None:
            peers["jax.nn cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=causal, local_window_size=(window, 0),
                implementation="cudnn")
    shapes = ((b, s, h, d), (b, s, kv_heads, d), (b, s, kv_heads, d))
    return Workload(
        name=name, family="dot_product_attention",
        make=lambda: tuple(_normal(i, shape) for i, shape in enumerate(shapes)),
        work=lambda mode: fwd_flops * (ATTENTION_FWD_BWD_WORK if mode == "fwd+bwd" else 1.0),
        unit="TFLOP/s", reference=_attention_reference(causal, window, soft_cap), ours=ours,
        peers=peers,
    )


def self_attention(name: str, b: int, s: int, h: int, d: int) -> Workload:
    """`attention(x, x, x)`: one array as query, key and value (the seed model's calls).

    Our backward sees the sharing (`shared_inputs`) and computes `dq + dk + dv` in one
    kernel; the peers get the same array three times and add three gradients."""
    base = attention(name, b, s, h, d, causal=False)

    def on_one_array(fn: Callable[..., Any]) -> Callable[..., Any]:
        if isinstance(fn, Prepared):
            return Prepared(fn.fn, lambda x: fn.prepare(x, x, x))
        return lambda x: fn(x, x, x)

    return dataclasses.replace(
        base, make=lambda: (_normal(0, (b, s, h, d)),),
        reference=on_one_array(base.reference),
        ours={k: on_one_array(f) for k, f in base.ours.items()},
        peers={k: on_one_array(f) for k, f in base.peers.items()})


# --- layer norm ------------------------------------------------------------------------

def _xla_norm(x, scale, offset, subtract_mean):
    xf = x.astype(jnp.float32)
    if subtract_mean:
        xf = xf - xf.mean(-1, keepdims=True)
    y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + 1e-6) * scale
    return (y + offset if subtract_mean else y).astype(x.dtype)


def norm(name: str, shape: tuple[int, ...], subtract_mean: bool, offset: bool = True,
         param_dtype: Any = jnp.bfloat16) -> Workload:
    """Normalizes the last axis of `shape`. `offset=False`: scale only (the seed model's
    layer norm, with a float32 scale); the peers get a zero offset."""
    cols = shape[-1]
    bytes_fwd = 2 * math.prod(shape) * 2
    with_offset = subtract_mean and offset
    ours = {
        f"tokamax {impl or 'None'}": functools.partial(
            lambda x, s, o, impl: tokamax.layer_norm(
                x, s, o if with_offset else None, subtract_mean=subtract_mean,
                implementation=impl), impl=impl)
        for impl in ("triton", "xla", None)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas.ops.gpu import layer_norm as pallas_ln
        from jax.experimental.pallas.ops.gpu import rms_norm as pallas_rms
    peers = {"xla (f32 math)": lambda x, s, o: _xla_norm(x, s, o, subtract_mean)}
    # JAX's Pallas norms take (batch, seq, features): give them one batch of all rows.
    if subtract_mean:
        peers["jax pallas layer_norm"] = lambda x, s, o: pallas_ln.layer_norm(
            x.reshape(1, -1, cols), s, o, eps=1e-6).reshape(x.shape)
    else:
        peers["jax pallas rms_norm"] = lambda x, s, o: pallas_rms.rms_norm(
            x.reshape(1, -1, cols), s, jnp.zeros_like(o), eps=1e-6).reshape(x.shape)
    return Workload(
        name=name, family="layer_norm",
        make=lambda: (_normal(0, shape), _normal(1, (cols,), param_dtype),
                      _normal(2, (cols,), param_dtype) if with_offset
                      else jnp.zeros((cols,), param_dtype)),
        work=lambda mode: bytes_fwd * (2.0 if mode == "fwd+bwd" else 1.0),
        unit="TB/s",
        reference=lambda x, s, o: _xla_norm(
            x.astype(jnp.float32), s.astype(jnp.float32), o.astype(jnp.float32), subtract_mean),
        ours=ours, peers=peers,
        ceilings={"copy (pallas triton)": lambda x, s, o: ceilings.triton_copy(x)},
    )


def norm_residual(name: str, shape: tuple[int, ...], subtract_mean: bool,
                  param_dtype: Any = jnp.bfloat16) -> Workload:
    """A transformer's pre-norm residual step over the last axis of `shape`: `s = x + h`,
    `y = norm(s)` with a scale (no offset), both outputs kept. The peer is the plain-JAX
    expression a user writes, which XLA fuses: the add, then the jnp norm."""
    cols = shape[-1]
    # Forward: read h and x, write y and s; the backward about as much (s, dy, ds -> dS).
    bytes_fwd = 4 * math.prod(shape) * 2
    ours = {
        f"tokamax {impl or 'None'}": functools.partial(
            lambda h, x, s, impl: tokamax.layer_norm(
                h, s, None, subtract_mean=subtract_mean, residual=x, implementation=impl),
            impl=impl)
        for impl in ("triton", "xla", None)
    }

    def plain(h, x, scale):
        s = x + h
        return _xla_norm(s, scale, 0.0, subtract_mean), s

    def reference(h, x, scale):
        s = x.astype(jnp.float32) + h.astype(jnp.float32)
        return _xla_norm(s, scale.astype(jnp.float32), 0.0, subtract_mean), s

    return Workload(
        name=name, family="layer_norm",
        make=lambda: (_normal(0, shape), _normal(1, shape), _normal(2, (cols,), param_dtype)),
        work=lambda mode: bytes_fwd * (2.0 if mode == "fwd+bwd" else 1.0),
        unit="TB/s", reference=reference, ours=ours,
        peers={"jnp x + h, then rms norm" if not subtract_mean else "jnp x + h, then layer norm":
               plain},
        ceilings={"copy (pallas triton)": lambda h, x, s: ceilings.triton_copy(x)},
    )


# --- gated linear unit -----------------------------------------------------------------


def glu(name: str, m: int, k: int, n: int) -> Workload:
    """SwiGLU on fused (K, 2, N) weights; the peer is the jnp expression a user writes."""
    ours = {
        f"tokamax {impl or 'None'}": functools.partial(
            lambda x, w, impl: tokamax.gated_linear_unit(x, w, activation=jax.nn.swish,
                                                         implementation=impl), impl=impl)
        for impl in ("triton", "xla", None)
    }
    peers = {"jnp swish(x @ w[:, 0]) * (x @ w[:, 1])":
             lambda x, w: jax.nn.swish(x @ w[:, 0]) * (x @ w[:, 1])}

    def reference(x, w):
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
        hi = jax.lax.Precision.HIGHEST
        return jax.nn.swish(jnp.matmul(x, w[:, 0], precision=hi)) * jnp.matmul(
            x, w[:, 1], precision=hi)

    return Workload(
        name=name, family="gated_linear_unit",
        make=lambda: (_normal(0, (m, k)), _normal(1, (k, 2, n)) / math.sqrt(k)),
        work=lambda mode: 2 * m * k * 2 * n * (MATMUL_FWD_BWD_WORK if mode == "fwd+bwd" else 1.0),
        unit="TFLOP/s", reference=reference, ours=ours, peers=peers,
        ceilings={"dense matmul (xla)": lambda x, w: ceilings.dense_matmul_xla(
            x, w.reshape(1, k, 2 * n))},
    )


# --- ragged dot ------------------------------------------------------------------------

UNEVEN_GROUPS = (2070, 2092, 2015, 2002, 2059, 2064, 2064, 2018)


def ragged(name: str, m: int, k: int, n: int, groups: tuple[int, ...]) -> Workload:
    assert sum(groups) == m
    group_sizes = jnp.asarray(groups, jnp.int32)
    ours = {
        f"tokamax {impl or 'None'}": functools.partial(
            lambda lhs, rhs, impl: tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=impl),
            impl=impl)
        for impl in ("mosaic", "triton", "xla", None)
    }
    peers = {"jax.lax.ragged_dot": lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, group_sizes)}
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    peers["jax ragged_dot_mgpu"] = lambda lhs, rhs: ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=group_sizes, block_m=128, block_n=128, block_k=64,
        max_concurrent_steps=6, grid_block_n=8)

    def reference(lhs, rhs):
        return jax.lax.ragged_dot(
            lhs.astype(jnp.float32), rhs.astype(jnp.float32), group_sizes,
            precision=jax.lax.Precision.HIGHEST)

    return Workload(
        name=name, family="ragged_dot",
        make=lambda: (_normal(0, (m, k)), _normal(1, (len(groups), k, n))),
        work=lambda mode: 2 * m * k * n * (MATMUL_FWD_BWD_WORK if mode == "fwd+bwd" else 1.0),
        unit="TFLOP/s", reference=reference, ours=ours, peers=peers,
        ceilings={"dense matmul (xla)": ceilings.dense_matmul_xla,
                  "dense matmul (hopper_matmul_mgpu)": ceilings.dense_matmul_mgpu},
    )


def moe_glu(name: str, m: int, k: int, n: int, groups: tuple[int, ...]) -> Workload:
    """MoE expert GEMMs with SwiGLU: grouped fused (G, K, 2, N) weights; the peer is
    `jax.lax.ragged_dot` over the (G, K, 2N) view, then the activation expression."""
    assert sum(groups) == m
    group_sizes = jnp.asarray(groups, jnp.int32)
    g = len(groups)
    ours = {
        f"tokamax {impl or 'None'}": functools.partial(
            lambda x, w, impl: tokamax.gated_linear_unit(x, w, group_sizes=group_sizes,
                                                         activation=jax.nn.swish,
                                                         implementation=impl), impl=impl)
        for impl in ("mosaic_gpu", "xla", None)
    }

    def plain(x, w):
        both = jax.lax.ragged_dot(x, w.reshape(g, k, 2 * n), group_sizes)
        return jax.nn.swish(both[:, :n]) * both[:, n:]

    def ragged_then_activation(x, w):  # the MoE model's form before the grouped GLU
        both = tokamax.ragged_dot(x, w.reshape(g, k, 2 * n), group_sizes)
        return jax.nn.swish(both[:, :n]) * both[:, n:]

    ours["tokamax ragged_dot None, then swish(gate) * up"] = ragged_then_activation

    def reference(x, w):
        both = jax.lax.ragged_dot(x.astype(jnp.float32), w.reshape(g, k, 2 * n).astype(
            jnp.float32), group_sizes, precision=jax.lax.Precision.HIGHEST)
        return jax.nn.swish(both[:, :n]) * both[:, n:]

    return Workload(
        name=name, family="gated_linear_unit",
        make=lambda: (_normal(0, (m, k)), _normal(1, (g, k, 2, n)) / math.sqrt(k)),
        work=lambda mode: 2 * m * k * 2 * n * (MATMUL_FWD_BWD_WORK if mode == "fwd+bwd" else 1.0),
        unit="TFLOP/s", reference=reference, ours=ours,
        peers={"jax.lax.ragged_dot, then swish(gate) * up": plain},
    )


# --- linear softmax cross entropy (LM head + loss) --------------------------------------


def _plain_lce(x: jax.Array, labels: jax.Array, w: jax.Array) -> jax.Array:
    """What a user writes: bf16 `x @ w`, then optax's integer-label softmax cross entropy
    (`softmax_cross_entropy_with_integer_labels`, written out: optax is not a dependency)
    in float32, ignored labels (< 0) masked out of a mean."""
    logits = (x @ w).astype(jnp.float32)
    logits = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    label_logits = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], axis=-1)
    losses = jnp.log(jnp.sum(jnp.exp(logits), axis=-1)) - label_logits[..., 0]
    counted = labels >= 0
    return jnp.sum(jnp.where(counted, losses, 0.0)) / jnp.maximum(jnp.sum(counted), 1)


def lce(name: str, tokens: int, h: int, v: int) -> Workload:
    """The LM head and its mean loss over `tokens` tokens (one in eight ignored); the peer
    is the plain JAX expression, which materializes the (tokens, v) logits."""
    ours = {
        f"tokamax {impl or 'None'}": functools.partial(
            lambda x, labels, w, impl: tokamax.linear_softmax_cross_entropy_loss(
                x, labels, w, reduction="mean", implementation=impl), impl=impl)
        for impl in ("mosaic", "xla_chunked", "xla", None)
    }

    def make() -> tuple[jax.Array, ...]:
        labels = jax.random.randint(jax.random.key(2), (tokens,), 0, v)
        ignored = jax.random.bernoulli(jax.random.key(3), 0.125, (tokens,))
        return (_normal(0, (tokens, h)), jnp.where(ignored, -1, labels),
                _normal(1, (h, v)) / math.sqrt(h))

    def reference(x, labels, w):
        with jax.default_matmul_precision("highest"):
            return _plain_lce(x.astype(jnp.float32), labels, w.astype(jnp.float32))

    return Workload(
        name=name, family="linear_softmax_cross_entropy_loss", make=make,
        work=lambda mode: 2 * tokens * h * v * (MATMUL_FWD_BWD_WORK if mode == "fwd+bwd" else 1.0),
        unit="TFLOP/s", reference=reference, ours=ours,
        peers={"plain jax (optax-style)": _plain_lce},
    )


def all_workloads() -> list[Workload]:
    """The benchmark workloads, most important first (a cut-short run keeps those)."""
    return [
        glu("glu 16384x2048x5632 (llama)", 16384, 2048, 5632),
        lce("lce 16384x4096x128256 (llama 3, liger)", 16384, 4096, 128256),
        lce("lce 16384x2048x32000 (llama model)", 16384, 2048, 32000),
        norm("rms norm 16384x2048 f32 scale (llama)", (4, 4096, 2048), subtract_mean=False,
             offset=False, param_dtype=jnp.float32),
        norm_residual("rms norm + residual 16384x2048 f32 scale (llama)", (4, 4096, 2048),
                      subtract_mean=False, param_dtype=jnp.float32),
        attention("attention b32 s2048 h16 d64", 32, 2048, 16, 64, causal=False),
        self_attention("self-attention x,x,x b32 s2048 h16 d64 (seed)", 32, 2048, 16, 64),
        norm("layer norm 65536x4096", (65536, 4096), subtract_mean=True),
        norm("rms norm 65536x4096", (65536, 4096), subtract_mean=False),
        ragged("ragged dot m16384 k4096 n4096 g8", 16384, 4096, 4096, UNEVEN_GROUPS),
        moe_glu("moe glu m32768 k2048 n5632 g8", 32768, 2048, 5632,
                tuple(2 * size for size in UNEVEN_GROUPS)),
        attention("attention b4 s8192 h16 d128", 4, 8192, 16, 128, causal=False),
        attention("attention b4 s8192 h16 d128 causal", 4, 8192, 16, 128, causal=True),
        norm("layer norm 65536x1024", (65536, 1024), subtract_mean=True),
        norm("layer norm 32x2048x16x64 no offset (seed)", (32, 2048, 16, 64),
             subtract_mean=True, offset=False, param_dtype=jnp.float32),
        attention("attention b16 s4096 h8 d256", 16, 4096, 8, 256, causal=False),
        attention("attention gqa b4 s4096 hq32 hkv8 d128 causal", 4, 4096, 32, 128,
                  causal=True, kv_heads=8),
        attention("attention soft cap 50 window 4096 b4 s8192 h16 d128 causal", 4, 8192, 16,
                  128, causal=True, window=4096, soft_cap=50.0),
        attention("attention soft cap 50 window 4096 b2 s8192 hq8 hkv4 d256 causal (gemma 2)",
                  2, 8192, 8, 256, causal=True, kv_heads=4, window=4096, soft_cap=50.0),
        self_attention("self-attention x,x,x b4 s8192 h16 d128", 4, 8192, 16, 128),
        lce("lce 8192x2304x256000 (gemma 2 2b, cce)", 8192, 2304, 256000),
    ]


def smoke_workloads() -> list[Workload]:
    """Tiny versions of every workload kind, to check the suite itself on CPU."""
    return [
        attention("smoke attention", 1, 32, 2, 16, causal=True),
        attention("smoke gqa soft cap window attention", 2, 32, 4, 16, causal=True,
                  kv_heads=2, window=8, soft_cap=20.0),
        self_attention("smoke self-attention", 1, 32, 2, 16),
        norm("smoke layer norm", (64, 128), subtract_mean=True),
        norm_residual("smoke rms norm + residual", (64, 128), subtract_mean=False,
                      param_dtype=jnp.float32),
        ragged("smoke ragged dot", 64, 32, 16, (10, 0, 30, 24)),
        glu("smoke glu", 64, 32, 48),
        moe_glu("smoke moe glu", 64, 32, 48, (10, 0, 30, 24)),
        lce("smoke lce", 64, 32, 96),
    ]
