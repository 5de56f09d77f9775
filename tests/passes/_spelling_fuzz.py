"""A randomized differential check of `optimize`'s rewrites.

From a seed, `generate` composes a small plain-JAX function out of the spellings the pass
claims to match (written-out attention, `jax.nn.dot_product_attention`, LayerNorm and
RMSNorm, gated linear units, softmax cross-entropy, `jax.lax.ragged_dot`) and of near
misses of them (a wrong axis, an off-by-one band, a fill too small to hide a key, a
statistic the op does not compute), possibly wrapped in a JAX transformation. `check`
runs it through `optimize`, every rewrite candidate kept (the `rewritten` fixture), and
compares values and gradients with `jax.jit` of the same function: a difference is a
wrong rewrite. A near miss may be rewritten only where its values stay.
"""

import dataclasses
import random
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tokamax_pass as tokamax

HIGHEST = jax.lax.Precision.HIGHEST
# Relative to the reference's largest magnitude: float32 rounding of a reordered sum is
# far below it, a wrong rewrite far above.
TOLERANCE = 1e-4


@dataclasses.dataclass
class Case:
    """One generated function, its inputs, and the pattern it should be rewritten by
    (`None` for a near miss, which may be rewritten only where its values stay)."""

    description: str
    function: Callable[..., Any]
    args: tuple[Any, ...]
    pattern: str | None


@dataclasses.dataclass
class Outcome:
    """What `check` found: `mismatch` is the first difference from `jax.jit` (a wrong
    rewrite), `rewritten` the patterns of the matches kept."""

    case: Case
    mismatch: str | None
    rewritten: list[str]


def einsum(spec, a, b):
    return jnp.einsum(spec, a, b, precision=HIGHEST)


def matmul(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


class _Inputs:
    """Random inputs of one case, from the case's seed."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, *shape, scale=1.0):
        return jnp.asarray(self.rng.standard_normal(shape) * scale, jnp.float32)

    def mask(self, *shape, hidden_rows=False):
        """A random boolean mask; every row keeps a key unless `hidden_rows`, which
        hides the first two rows of the first batch element whole."""
        keep = self.rng.random(shape) < 0.7
        keep[..., 0] = True
        if hidden_rows:
            keep[0, ..., :2, :] = False
        return jnp.asarray(keep)

    def integers(self, high, *shape):
        return jnp.asarray(self.rng.integers(0, high, shape), jnp.int32)


# Attention ------------------------------------------------------------------------------

B, T, N, D = 2, 8, 2, 8


def _arange_band(r: random.Random, t: int, s: int):
    """A mask of `jnp.arange` rows and columns compared, with random dtypes, starts,
    steps, offsets, comparisons and operand orders, possibly built transposed or flipped
    and possibly within a window: a band of key offsets or not, hiding rows or not."""
    dtype = r.choice([jnp.int32, jnp.int32, jnp.int8, jnp.uint8, jnp.float32, jnp.bfloat16])
    start, step = r.choice([0, 0, 1]), r.choice([1, 1, 2])
    offset, window = r.choice([0, 0, 1, -1, 2]), r.choice([None, None, 1, 2])
    comparison = r.choice(["le", "lt", "ge", "gt"])
    layout = r.choice(["plain", "plain", "transposed", "flipped"])
    n_rows, n_cols = (s, t) if layout == "transposed" else (t, s)
    rows = jnp.arange(start, start + n_rows * step, step, dtype=dtype)[:, None]
    cols = jnp.arange(0, n_cols * step, step, dtype=dtype)[None, :]
    if layout == "transposed":
        rows, cols = cols, rows
    shifted = rows + jnp.asarray(offset * step, dtype) if offset >= 0 else (
        rows - jnp.asarray(-offset * step, dtype))
    compare = {"le": jnp.less_equal, "lt": jnp.less, "ge": jnp.greater_equal,
               "gt": jnp.greater}[comparison]
    mask = compare(shifted, cols) if comparison in ("ge", "gt") else compare(cols, shifted)
    if window is not None:
        mask = mask & (rows - cols <= jnp.asarray(window * step, dtype))
    if layout == "transposed":
        mask = mask.T
    elif layout == "flipped":
        mask = mask[::-1]
    description = (f"arange({jnp.dtype(dtype).name},start={start},step={step},"
                   f"offset={offset},{comparison},window={window},{layout})")
    return mask, description


def _band(r: random.Random, t: int, s: int, hidden_rows: bool):
    """A band mask of `t` queries and `s` keys spelled one of several ways, and its
    description; some bands are off by one from the causal band, some aligned to the
    last key (`s > t`): each a different band, which the op must keep."""
    if hidden_rows:
        kind = r.choice(["tril_km2", "arange_lt_bare", "triu_not_m1"])
        rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
        if kind == "tril_km2":
            return jnp.tril(jnp.ones((t, s), bool), -2), kind
        if kind == "arange_lt_bare":
            return cols < rows, kind
        return ~jnp.triu(jnp.ones((t, s), bool), 0), kind
    if r.random() < 0.4:
        return _arange_band(r, t, s)
    kind = r.choice(["tril", "tril_k1", "tril_km1", "arange_le", "arange_lt", "window",
                     "window_triu", "triu_not", "np_tril", "end_aligned"])
    ones = jnp.ones((t, s), bool)
    rows, cols = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    if kind == "tril":
        return jnp.tril(ones), kind
    if kind == "tril_k1":
        return jnp.tril(ones, 1), kind
    if kind == "tril_km1":
        mask = jnp.tril(ones, -1)
        return mask.at[0, 0].set(True), kind  # the first row keeps a key
    if kind == "arange_le":
        return cols <= rows, kind
    if kind == "arange_lt":
        return (cols < rows) | (cols == 0), kind
    if kind == "window":
        w = r.choice([1, 2, 3])
        return (cols <= rows) & (rows - cols <= w), f"window{w}"
    if kind == "window_triu":
        w = r.choice([1, 2, 3])
        return jnp.triu(jnp.tril(ones), -w), f"window_triu{w}"
    if kind == "triu_not":
        k = r.choice([1, 2])
        return ~jnp.triu(ones, k), f"triu_not{k}"
    if kind == "end_aligned":
        return cols <= rows + (s - t), kind
    return jnp.asarray(np.tril(np.ones((t, s), bool))), kind


def _attention_case(r: random.Random, inputs: _Inputs) -> Case:
    near = []
    S = r.choice([T, T, T + 3])  # the keys; T is the queries
    layout = r.choice(["bthd", "bhtd"])
    product = r.choice(["einsum", "matmul"])
    kv_heads = r.choice([N, N, 1])
    grouping = r.choice(["repeat", "reshape", "broadcast"]) if kv_heads != N else "none"
    scale_at = r.choice(["q", "logits", "after_mask", "none", "k"])
    scale = r.choice([1 / np.sqrt(D), 0.3, 1.0 / D, -0.3])
    traced_scale = scale_at != "none" and r.random() < 0.15
    bias = r.choice(["none", "none", "add", "sub", "multiply", "minus_logits"])
    bias_shape = r.choice([(B, N, T, S), (1, N, T, S), (B, 1, 1, S), (T, S), (B, 1, T, 1)])
    soft_cap = r.choice([None, None, 5.0])
    cap_inside = soft_cap if r.random() < 0.8 else 4.0
    traced_cap = soft_cap is not None and r.random() < 0.2
    escape = r.choice([None, None, None, None, None, "logits", "probs"])
    mask_source = r.choice(["none", "band", "band", "data", "traced_band"])
    hidden_rows = mask_source in ("band", "data") and r.random() < 0.25
    mask_how = r.choice(["where", "where", "additive", "multiply", "select_min",
                         "softmax_where", "where_hidden"])
    fill = r.choice(["-inf", "finfo_min", "-1e9", "-1e30", "-10"])
    softmax = r.choice(["nn", "nn", "exp_max", "exp_log_softmax", "wrong_axis",
                        "max_of_queries", "exp_max_live"])
    if r.random() < 0.5:  # a spelling the pass matches: no near miss among the options
        bias = {"multiply": "add", "minus_logits": "sub"}.get(bias, bias)
        fill = "-1e9" if fill == "-10" else fill
        mask_how = "where" if mask_how == "multiply" else mask_how
        softmax = "nn" if softmax in ("wrong_axis", "max_of_queries") else softmax
        cap_inside, escape = soft_cap, None
        scale = abs(scale)
    if mask_how == "softmax_where" and softmax != "nn":
        mask_how = "where"  # `where=` is `jax.nn.softmax`'s alone
    stopped_sum = softmax in ("exp_max", "exp_max_live") and r.random() < 0.15
    if stopped_sum:
        near.append("the softmax's sum not differentiated")
    sliced = r.random() < 0.1
    v_transposed = r.random() < 0.15
    dropout = r.random() < 0.1
    cast_probs = r.random() < 0.2

    if bias == "multiply":
        near.append("logits times an array")
    if bias == "minus_logits":
        near.append("a bias minus the logits")
    if soft_cap is not None and cap_inside != soft_cap:
        near.append("a soft cap dividing by another number")
    if escape:
        near.append(f"the {escape} also returned")
    if scale < 0 and scale_at == "after_mask" and mask_source != "none":
        near.append("a negative scale after the mask")
    if mask_source != "none" and mask_how in ("where", "additive", "select_min",
                                               "where_hidden") and (
            fill == "-10"):
        near.append("a fill of -10")
    if mask_source != "none" and mask_how == "multiply":
        near.append("logits times the mask")
    if softmax == "wrong_axis":
        near.append("softmax over the queries")
    if softmax == "max_of_queries":
        near.append("logits shifted by their max over the queries")
    if scale_at == "after_mask" and mask_source != "none" and fill == "-10":
        near.append("scaled small fill")
    band = None
    mask_arg = None
    if mask_source == "band":
        band, band_name = _band(r, T, S, hidden_rows)
    elif mask_source == "data":
        mask_arg = inputs.mask(B, 1, T, S, hidden_rows=hidden_rows)
        band_name = "data"
    elif mask_source == "traced_band":
        mask_arg = jnp.asarray(r.choice([0, 1]), jnp.int32)
        band_name = f"traced_band{int(mask_arg)}"
    else:
        band_name = "none"
    fills = {"-inf": -jnp.inf, "finfo_min": float(jnp.finfo(jnp.float32).min),
             "-1e9": -1e9, "-1e30": -1e30, "-10": -10.0}
    fill_value = fills[fill]
    if mask_how == "additive" and fill == "finfo_min" and bias != "none":
        fill_value = -1e30  # finfo.min plus a negative bias overflows in either program

    def attend_only(q, k, v, *rest):
        rest = list(rest)
        bias_value = rest.pop(0) if bias != "none" else None
        mask_value = rest.pop(0) if mask_arg is not None else band
        keep = rest.pop(0) if dropout else None
        scale_value = rest.pop(0) if traced_scale else scale
        cap_value = rest.pop(0) if traced_cap else soft_cap
        cap_in = cap_value if cap_inside == soft_cap else cap_inside
        if mask_source == "traced_band":
            rows, cols = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
            mask_value = cols <= rows + mask_value
        if kv_heads != N:
            group = N // kv_heads
            if grouping == "repeat":
                k = jnp.repeat(k, group, axis=2)
                v = jnp.repeat(v, group, axis=2)
            elif grouping == "broadcast":
                k = jnp.broadcast_to(k[:, :, :, None], (B, S, kv_heads, group, D)).reshape(
                    B, S, N, D)
                v = jnp.broadcast_to(v[:, :, :, None], (B, S, kv_heads, group, D)).reshape(
                    B, S, N, D)
        if scale_at == "q":
            q = q * scale_value
        if scale_at == "k":
            k = k * scale_value
        if grouping == "reshape":
            qg = q.reshape(B, T, kv_heads, N // kv_heads, D)
            logits = einsum("btkgd,bskd->bkgts", qg, k).reshape(B, N, T, S)
        elif layout == "bthd" and product == "einsum":
            logits = einsum("bthd,bshd->bhts", q, k)
        else:
            qh, kh = jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2)
            logits = (matmul(qh, jnp.swapaxes(kh, -1, -2)) if product == "matmul"
                      else einsum("bhtd,bhsd->bhts", qh, kh))
        if scale_at == "logits":
            logits = logits * scale_value
        if bias_value is not None:
            bias_b = bias_value.reshape(bias_shape)
            logits = {"add": logits + bias_b, "sub": logits - bias_b,
                      "multiply": logits * bias_b, "minus_logits": bias_b - logits}[bias]
        if soft_cap is not None:
            logits = cap_value * jnp.tanh(logits / cap_in)
        where = None
        if mask_value is not None:
            if mask_how == "where":
                logits = jnp.where(mask_value, logits, fill_value)
            elif mask_how == "select_min":
                logits = jax.lax.select(jnp.broadcast_to(mask_value, logits.shape), logits,
                                        jnp.full(logits.shape, fill_value))
            elif mask_how == "additive":
                logits = logits + jnp.where(mask_value, 0.0, fill_value)
            elif mask_how == "where_hidden":
                logits = jnp.where(~mask_value, fill_value, logits)
            elif mask_how == "multiply":
                logits = logits * mask_value
            else:
                where = jnp.broadcast_to(mask_value, logits.shape)
        if scale_at == "after_mask":
            logits = logits * scale_value
        escaped = logits
        keys = S
        if sliced:
            keys = S - 2
            logits = logits[..., :keys]
            if where is not None:
                where = where[..., :keys]
        if softmax == "nn":
            probs = jax.nn.softmax(logits, axis=-1, where=where)
        elif softmax == "wrong_axis":
            probs = jax.nn.softmax(logits, axis=-2)
        elif softmax in ("exp_max", "exp_max_live", "max_of_queries"):
            peak = logits.max(-2 if softmax == "max_of_queries" else -1, keepdims=True)
            if softmax != "exp_max_live":
                peak = jax.lax.stop_gradient(peak)
            shifted = logits - peak
            e = jnp.exp(shifted)
            total = e.sum(-1, keepdims=True)
            probs = e / (jax.lax.stop_gradient(total) if stopped_sum else total)
        else:
            probs = jnp.exp(jax.nn.log_softmax(logits, axis=-1))
        if keep is not None:
            probs = probs * keep[..., :keys] / 0.7
        if escape == "probs":
            escaped = probs
        if cast_probs:
            probs = probs.astype(v.dtype)
        v = v[:, :keys]
        if grouping == "reshape":
            pg = probs.reshape(B, kv_heads, N // kv_heads, T, keys)
            return einsum("bkgts,bskd->btkgd", pg, v).reshape(B, T, N, D), escaped
        if v_transposed:
            vt = jnp.transpose(v, (0, 2, 3, 1))  # (B, N, D, S)
            return jnp.swapaxes(einsum("bhts,bhds->bhtd", probs, vt), 1, 2), escaped
        if layout == "bthd" and product == "einsum":
            return einsum("bhts,bshd->bthd", probs, v), escaped
        return jnp.swapaxes(matmul(probs, jnp.swapaxes(v, 1, 2)), 1, 2), escaped

    def attend(*args):
        out, escaped = attend_only(*args)
        return out if escape is None else (out, escaped)

    args = [inputs.normal(B, T, N, D), inputs.normal(B, S, kv_heads, D),
            inputs.normal(B, S, kv_heads, D)]
    if bias != "none":
        args.append(inputs.normal(*bias_shape))
    if mask_arg is not None:
        args.append(mask_arg)
    if dropout:
        args.append(jnp.asarray(inputs.rng.random((B, N, T, S)) < 0.7, jnp.float32))
        near.append("dropout")
    if traced_scale:
        args.append(jnp.asarray(scale, jnp.float32))
    if traced_cap:
        args.append(jnp.asarray(soft_cap, jnp.float32))
    description = (f"attention keys={S} layout={layout} product={product} kv_heads={kv_heads} "
                   f"grouping={grouping} scale_at={scale_at} scale={scale:.3g} bias={bias}"
                   f"{bias_shape if bias != 'none' else ''} soft_cap={soft_cap} "
                   f"mask={band_name}/{mask_how}/{fill} softmax={softmax} sliced={sliced} "
                   f"v_transposed={v_transposed} dropout={dropout} cast={cast_probs} "
                   f"traced_scale={traced_scale} cap_inside={cap_inside} "
                   f"traced_cap={traced_cap} escape={escape} hidden_rows={hidden_rows} "
                   f"stopped_sum={stopped_sum}")
    return Case(description, attend, tuple(args), None if near else "attention")


def _nn_attention_case(r: random.Random, inputs: _Inputs) -> Case:
    kv_heads = r.choice([N, 1])
    use_bias = r.random() < 0.3
    use_mask = r.random() < 0.3
    is_causal = r.random() < 0.5
    window = r.choice([None, None, (2, 0), (1, 1), (3, 2)])
    scale = r.choice([None, 0.2])
    lengths = r.random() < 0.2
    args = [inputs.normal(B, T, N, D), inputs.normal(B, T, kv_heads, D),
            inputs.normal(B, T, kv_heads, D)]
    if use_bias:
        args.append(inputs.normal(B, N, T, T))
    hidden_rows = use_mask and r.random() < 0.3
    if use_mask:
        args.append(inputs.mask(B, N, T, T, hidden_rows=hidden_rows))
    if lengths:
        args.append(jnp.asarray(inputs.rng.integers(1, T + 1, (B,)), jnp.int32))
        args.append(jnp.asarray(inputs.rng.integers(0, T + 1, (B,)), jnp.int32))

    def attend(q, k, v, *rest):
        rest = list(rest)
        bias = rest.pop(0) if use_bias else None
        mask = rest.pop(0) if use_mask else None
        q_len, kv_len = (rest.pop(0), rest.pop(0)) if lengths else (None, None)
        return jax.nn.dot_product_attention(
            q, k, v, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
            query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
            local_window_size=window)

    description = (f"jax.nn attention kv_heads={kv_heads} bias={use_bias} mask={use_mask} "
                   f"causal={is_causal} window={window} scale={scale} lengths={lengths} "
                   f"hidden_rows={hidden_rows}")
    return Case(description, attend, tuple(args), "dot_product_attention")


# Norms ----------------------------------------------------------------------------------

NORM_SHAPE = (2, 6, 16)


def _norm_case(r: random.Random, inputs: _Inputs) -> Case:
    near = []
    kind = r.choice(["rms", "layer"])
    eps = r.choice([1e-6, 1e-5, 0.1])
    eps_at = r.choice(["inside", "inside", "outside"])
    stat = r.choice(["mean", "mean", "sum_n", "sum_n1", "var", "e_x2"])
    if kind == "rms" and stat in ("var", "e_x2"):
        stat = "mean"
    axis = r.choice([-1, -1, -1, -2])
    scale_how = r.choice(["w", "one_plus_w", "none", "row", "two_plus_w"])
    stopped_stat = r.random() < 0.1
    traced_eps = r.random() < 0.1
    offset_sign = r.choice([1, 1, -1])
    if stopped_stat:
        near.append("the statistic not differentiated")
    offset = kind == "layer" and r.random() < 0.6
    inv = r.choice(["rsqrt", "div_sqrt", "recip", "pow"])
    cast = r.choice(["f32", "f32", "bf16_stats", "upcast_bf16"])
    centered_by_other_axis = kind == "layer" and r.random() < 0.1
    other_normalized = r.random() < 0.1
    if other_normalized:
        near.append("the statistic of another value")
    twin = r.random() < 0.08
    if twin:
        near.append("the statistic of x * 2, x * 3 normalized")
    # Rows as many as features: a `(B, T)` mean broadcast as `mean[:, None, :]` fits.
    square_rows = kind == "layer" and axis == -1 and r.random() < 0.15
    if square_rows:
        near.append("the mean broadcast along the features")
    if eps_at == "outside":
        near.append("eps outside the square root")
    if stat == "sum_n1":
        near.append("sum / (n - 1)")
    if axis != -1:
        near.append("a statistic over a non-last axis")
    if scale_how == "row":
        near.append("a scale per row")
    if cast == "bf16_stats":
        near.append("bfloat16 statistics")
    if centered_by_other_axis:
        near.append("centered by another axis's mean")
    n = NORM_SHAPE[axis]

    def norm(x, *params):
        params = list(params)
        w = params.pop(0) if scale_how != "none" else None
        b = params.pop(0) if offset else None
        if cast == "upcast_bf16":
            x = x.astype(jnp.bfloat16).astype(jnp.float32)
        xs = x.astype(jnp.bfloat16) if cast == "bf16_stats" else x
        if twin:
            x, xs = x * 3.0, xs * 2.0

        def mean(a):
            if stat in ("sum_n",):
                return jnp.sum(a, axis=axis, keepdims=True) / n
            if stat == "sum_n1":
                return jnp.sum(a, axis=axis, keepdims=True) / (n - 1)
            return jnp.mean(a, axis=axis, keepdims=True)

        if kind == "layer":
            mu = jnp.mean(xs, axis=-2 if centered_by_other_axis else axis, keepdims=True)
            if square_rows:
                mu = jnp.mean(xs, axis=-1)[:, None, :]
            if stat == "var":
                var = jnp.var(xs, axis=axis, keepdims=True)
            elif stat == "e_x2":
                var = jnp.mean(xs * xs, axis=axis, keepdims=True) - jnp.square(
                    jnp.mean(xs, axis=axis, keepdims=True))
            else:
                var = mean(jnp.square(xs - mu))
            centered = x - mu.astype(x.dtype)
        else:
            var = mean(jnp.square(xs))
            centered = x
        var = var.astype(jnp.float32)
        if stopped_stat:
            var = jax.lax.stop_gradient(var)
        eps_value = params.pop(0) if traced_eps else eps
        if eps_at == "outside":
            factor = 1 / (jnp.sqrt(var) + eps_value)
        elif inv == "rsqrt":
            factor = jax.lax.rsqrt(var + eps_value)
        elif inv == "div_sqrt":
            factor = None
        elif inv == "recip":
            factor = jnp.reciprocal(jnp.sqrt(var + eps_value))
        else:
            factor = (var + eps_value) ** -0.5
        if other_normalized:
            centered = centered + 1.0
        y = centered / jnp.sqrt(var + eps_value) if factor is None else centered * factor
        if w is not None:
            y = y * {"one_plus_w": 1 + w, "two_plus_w": 2 + w}.get(scale_how, w)
        if b is not None:
            y = y + offset_sign * b
        return y

    shape = (2, 16, 16) if square_rows else NORM_SHAPE
    args = [inputs.normal(*shape, scale=r.choice([1.0, 3.0])) + r.choice([0.0, 2.0])]
    if scale_how != "none":
        args.append(inputs.normal(*((*shape[:-1], 1) if scale_how == "row" else (16,))))
    if offset:
        args.append(inputs.normal(16))
    if traced_eps:
        args.append(jnp.asarray(eps, jnp.float32))
    description = (f"norm kind={kind} eps={eps}/{eps_at} stat={stat} axis={axis} "
                   f"scale={scale_how} offset={offset} inv={inv} cast={cast} "
                   f"other_axis_mean={centered_by_other_axis} other_normalized={other_normalized} "
                   f"stopped_stat={stopped_stat} traced_eps={traced_eps} "
                   f"offset_sign={offset_sign} twin={twin} square_rows={square_rows}")
    return Case(description, norm, tuple(args), None if near else "layer_norm")


# Gated linear units ---------------------------------------------------------------------

GLU_K, GLU_N = 16, 8


def _glu_case(r: random.Random, inputs: _Inputs) -> Case:
    near = []
    act_name = r.choice(["silu", "swish", "x_sigmoid", "gelu_tanh", "gelu_exact", "relu",
                         "sigmoid", "none", "tanh", "softplus", "quick_gelu", "silu_2x",
                         "stopped_silu"])
    acts = {
        "silu": jax.nn.silu, "swish": jax.nn.swish,
        "x_sigmoid": lambda g: g * jax.nn.sigmoid(g),
        "gelu_tanh": lambda g: jax.nn.gelu(g, approximate=True),
        "gelu_exact": lambda g: jax.nn.gelu(g, approximate=False),
        "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "none": lambda g: g,
        "tanh": jnp.tanh, "softplus": jax.nn.softplus,
        "quick_gelu": lambda g: g * jax.nn.sigmoid(1.702 * g),
        "silu_2x": lambda g: jax.nn.silu(2.0 * g),
        "stopped_silu": lambda g: g * jax.lax.stop_gradient(jax.nn.sigmoid(g)),
    }
    act = acts[act_name]
    weights = r.choice(["two", "two", "fused_halves", "fused_swapped", "fused_uneven",
                        "stacked_first", "stacked_last", "interleaved"])
    swapped = weights in ("stacked_first", "stacked_last", "interleaved") and r.random() < 0.3
    gate_bias = r.random() < 0.1
    other_input = r.random() < 0.1
    up_act = r.random() < 0.1
    twin = r.choice([None] * 8 + ["literal", "scaled_alike", "sliced"])
    if twin:
        near.append(f"the projections' inputs alike but different ({twin})")
    if act_name in ("tanh", "softplus", "quick_gelu", "silu_2x", "stopped_silu"):
        near.append("an activation the op lacks")
    if weights == "fused_uneven":
        near.append("a fused weight split off its halves")
    if gate_bias:
        near.append("a bias on the gate")
    if other_input:
        near.append("the up projection of another input")
    if up_act:
        near.append("an activation on the up projection")

    def glu(x, w, *rest):
        rest = list(rest)
        if weights == "two":
            w_up = rest.pop(0)
            x_up = rest.pop(0) if other_input else x
            x_gate = x
            if twin == "literal":
                x_gate, x_up = x * 2.0, x * 3.0
            elif twin == "scaled_alike":
                x_gate, x_up = jnp.tanh(x), jnp.tanh(x[::-1])
            elif twin == "sliced":
                x_gate, x_up = x[:, :-1], x[:, 1:]
            g, u = matmul(x_gate, w), matmul(x_up, w_up)
        elif weights in ("fused_halves", "fused_swapped"):
            h = matmul(x, w)
            g, u = jnp.split(h, 2, axis=-1)
            if weights == "fused_swapped":
                g, u = u, g
        elif weights == "fused_uneven":
            h = matmul(x, w)
            g, u = h[..., :GLU_N], h[..., GLU_N + 1:2 * GLU_N + 1]
        elif weights == "stacked_first":
            h = einsum("btk,kcn->btcn", x, w)
            g, u = h[..., 0, :], h[..., 1, :]
            if swapped:
                g, u = u, g
        elif weights == "stacked_last":
            h = einsum("btk,knc->btnc", x, w)
            g, u = (h[..., 1], h[..., 0]) if swapped else (h[..., 0], h[..., 1])
        else:
            h = matmul(x, w).reshape(*x.shape[:-1], GLU_N, 2)
            g, u = (h[..., 1], h[..., 0]) if swapped else (h[..., 0], h[..., 1])
        if gate_bias:
            g = g + rest.pop(0)
        if up_act:
            u = jax.nn.relu(u)
        return act(g) * u

    x = inputs.normal(2, 4, GLU_K)
    shapes = {"two": (GLU_K, GLU_N), "fused_halves": (GLU_K, 2 * GLU_N),
              "fused_swapped": (GLU_K, 2 * GLU_N), "fused_uneven": (GLU_K, 2 * GLU_N + 3),
              "stacked_first": (GLU_K, 2, GLU_N), "stacked_last": (GLU_K, GLU_N, 2),
              "interleaved": (GLU_K, 2 * GLU_N)}
    args = [x, inputs.normal(*shapes[weights], scale=0.3)]
    if weights == "two":
        args.append(inputs.normal(GLU_K, GLU_N, scale=0.3))
        if other_input:
            args.append(inputs.normal(2, 4, GLU_K))
    elif other_input:
        other_input = False
        near.remove("the up projection of another input")
    if twin and weights != "two":
        near.remove(f"the projections' inputs alike but different ({twin})")
        twin = None
    if gate_bias:
        args.append(inputs.normal(GLU_N))
    description = (f"glu act={act_name} weights={weights} swapped={swapped} gate_bias={gate_bias} "
                   f"other_input={other_input} up_act={up_act} twin={twin}")
    return Case(description, glu, tuple(args), None if near else "gated_linear_unit")


# Cross-entropy --------------------------------------------------------------------------

CE_T, CE_H, CE_V = 6, 8, 12


def _cross_entropy_case(r: random.Random, inputs: _Inputs) -> Case:
    near = []
    tied = r.random() < 0.3
    soft_cap = r.choice([None, None, None, 4.0])
    loss_how = r.choice(["take_along", "take_along", "lse_minus", "one_hot", "one_hot_lse",
                         "fancy", "compare_one_hot"])
    log_softmax_how = r.choice(["nn", "lse"])
    label_shift = r.choice([0, 0, 0, 1])
    reduction = r.choice(["none", "mean", "sum"])
    ignore = r.random() < 0.2
    smoothing = r.random() < 0.15
    wrong_axis = r.random() < 0.1 and loss_how in ("take_along", "one_hot", "compare_one_hot")
    temperature = r.random() < 0.1
    stopped_lse = loss_how in ("lse_minus", "one_hot_lse") and r.random() < 0.15
    if stopped_lse:
        near.append("the log-sum-exp not differentiated")
    raw_labels = r.random() < 0.15
    if raw_labels:
        near.append("labels outside [0, V) given as they are")
    other_logits = r.random() < 0.1 and loss_how in ("lse_minus", "one_hot_lse")
    if smoothing:
        near.append("label smoothing")
    if wrong_axis:
        near.append("log_softmax over the tokens")
    if temperature:
        near.append("logits divided by a temperature after the cap")
    if other_logits:
        near.append("the label's logit of other logits")
    if ignore:
        near.append("ignored labels")

    def log_softmax(logits, axis):
        if log_softmax_how == "nn":
            return jax.nn.log_softmax(logits, axis=axis)
        return logits - jax.nn.logsumexp(logits, axis=axis, keepdims=True)

    def loss(x, w, labels, *rest):
        w2 = rest[0] if other_logits else None
        logits = matmul(x, w.T) if tied else matmul(x, w)
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        if temperature:
            logits = logits / 0.7
        labels = labels + label_shift if raw_labels else (labels + label_shift) % CE_V
        if ignore:
            valid = labels != 3
            safe = jnp.where(valid, labels, 0)
        else:
            safe = labels
        axis = -2 if wrong_axis else -1
        if loss_how == "take_along":
            per = -jnp.take_along_axis(log_softmax(logits, axis), safe[..., None], -1)[..., 0]
        elif loss_how == "lse_minus":
            picked_from = matmul(x, w2) if w2 is not None else logits
            picked = jnp.take_along_axis(picked_from, safe[..., None], -1)[..., 0]
            lse = jax.nn.logsumexp(logits, axis=axis)
            per = (jax.lax.stop_gradient(lse) if stopped_lse else lse) - picked
        elif loss_how in ("one_hot", "compare_one_hot"):
            one_hot = (jax.nn.one_hot(safe, CE_V) if loss_how == "one_hot"
                       else (safe[..., None] == jnp.arange(CE_V)).astype(jnp.float32))
            if smoothing:
                one_hot = one_hot * 0.9 + 0.1 / CE_V
            per = -(one_hot * log_softmax(logits, axis)).sum(-1)
        elif loss_how == "one_hot_lse":
            one_hot = jax.nn.one_hot(safe, CE_V)
            picked_from = matmul(x, w2) if w2 is not None else logits
            lse = jax.nn.logsumexp(logits, axis=axis)
            lse = jax.lax.stop_gradient(lse) if stopped_lse else lse
            per = lse - jnp.sum(one_hot * picked_from, -1)
        else:
            flat = log_softmax(logits, axis).reshape(-1, CE_V)
            per = -flat[jnp.arange(flat.shape[0]), safe.reshape(-1)].reshape(safe.shape)
        if ignore:
            per = jnp.where(valid, per, 0.0)
        if reduction == "mean":
            return per.mean()
        if reduction == "sum":
            return per.sum()
        return per

    x = inputs.normal(2, CE_T, CE_H)
    w = inputs.normal(*((CE_V, CE_H) if tied else (CE_H, CE_V)), scale=0.5)
    labels = inputs.integers(CE_V, 2, CE_T)
    if raw_labels:
        labels = labels.at[0, 0].set(-1).at[1, 1].set(CE_V + 2)
    args = [x, w, labels]
    if other_logits:
        args.append(inputs.normal(CE_H, CE_V, scale=0.5))
    description = (f"cross_entropy tied={tied} soft_cap={soft_cap} loss={loss_how} "
                   f"log_softmax={log_softmax_how} label_shift={label_shift} "
                   f"reduction={reduction} ignore={ignore} smoothing={smoothing} "
                   f"wrong_axis={wrong_axis} temperature={temperature} "
                   f"other_logits={other_logits} raw_labels={raw_labels} stopped_lse={stopped_lse}")
    return Case(description, loss, tuple(args),
                None if near else "linear_softmax_cross_entropy_loss")


def _ragged_dot_case(r: random.Random, inputs: _Inputs) -> Case:
    groups, m, k, n = 3, 12, 8, 6
    sizes = r.choice([[4, 4, 4], [0, 6, 6], [5, 0, 3], [12, 0, 0]])
    transposed = r.random() < 0.3

    def grouped(x, w, group_sizes):
        if transposed:
            return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes,
                                      precision=HIGHEST)
        return jax.lax.ragged_dot(x, w, group_sizes, precision=HIGHEST)

    w = inputs.normal(*((groups, n, k) if transposed else (groups, k, n)))
    args = (inputs.normal(m, k), w, jnp.asarray(sizes, jnp.int32))
    return Case(f"ragged_dot sizes={sizes} transposed={transposed}", grouped, args,
                "ragged_dot")


def _block_case(r: random.Random, inputs: _Inputs) -> Case:
    """Several spellings chained, as a transformer block and its loss write them: the
    norm's result read by the attention's q, k and v alike and by the residual, the
    unit's output by the loss; some intermediate results also returned."""
    t, features, heads, hidden, vocab = 6, 16, 2, 8, 12
    attend = r.random() < 0.6
    causal = r.choice(["tril", "arange", "none"])
    act = r.choice([jax.nn.silu, jax.nn.gelu, jax.nn.relu])
    escape = r.choice([None, None, "normed", "logits"])
    loss = r.choice(["take_along", "one_hot"])

    def rms(x, scale):
        return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6) * scale

    def self_attention(h):
        q = k = v = h.reshape(h.shape[0], t, heads, features // heads)
        logits = einsum("bthd,bshd->bhts", q, k) / np.sqrt(features // heads)
        rows, cols = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        mask = {"tril": jnp.tril(jnp.ones((t, t), bool)), "arange": cols <= rows,
                "none": None}[causal]
        if mask is not None:
            logits = jnp.where(mask, logits, -1e30)
        out = einsum("bhts,bshd->bthd", jax.nn.softmax(logits, -1), v)
        return out.reshape(h.shape)

    def block(x, scale, w_gate, w_up, w_out, labels):
        normed = rms(x, scale)
        x = x + self_attention(normed) if attend else x
        h = rms(x, scale) if attend else normed
        logits = matmul(act(matmul(h, w_gate)) * matmul(h, w_up), w_out)
        log_probs = jax.nn.log_softmax(logits, -1)
        if loss == "take_along":
            per = -jnp.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
        else:
            per = -(jax.nn.one_hot(labels, vocab) * log_probs).sum(-1)
        extra = {"normed": normed, "logits": logits}.get(escape)
        return per.mean() if extra is None else (per.mean(), extra)

    args = (inputs.normal(2, t, features), inputs.normal(features),
            inputs.normal(features, hidden, scale=0.3), inputs.normal(features, hidden, scale=0.3),
            inputs.normal(hidden, vocab, scale=0.3), inputs.integers(vocab, 2, t))
    description = (f"block attend={attend} causal={causal} act={act.__name__} "
                   f"escape={escape} loss={loss}")
    return Case(description, block, args, "layer_norm")


GENERATORS = {
    "attention": _attention_case,
    "nn_attention": _nn_attention_case,
    "norm": _norm_case,
    "glu": _glu_case,
    "cross_entropy": _cross_entropy_case,
    "ragged_dot": _ragged_dot_case,
    "block": _block_case,
}
WEIGHTS = {"attention": 5, "nn_attention": 1, "norm": 3, "glu": 3, "cross_entropy": 3,
           "ragged_dot": 1, "block": 2}


# Transformations ------------------------------------------------------------------------


def _differentiable(args) -> tuple[int, ...]:
    return tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))


def _grad_inside(f, args, inputs):
    cotangents = [inputs.normal(*o.shape) for o in jax.tree.leaves(jax.eval_shape(f, *args))]
    return jax.grad(_weighted_loss(f, cotangents), argnums=_differentiable(args))


def _with_custom_vjp(f):
    @jax.custom_vjp
    def wrapped(*args):
        return f(*args)

    def forward(*args):
        return jax.vjp(f, *args)

    def backward(pullback, cotangent):
        return pullback(cotangent)

    wrapped.defvjp(forward, backward)
    return wrapped


def _stacked(args):
    return tuple(jnp.stack([a, a if not jnp.issubdtype(a.dtype, jnp.floating)
                            else a * 0.5 + 0.1]) for a in args)


def _wrap(r: random.Random, case: Case, inputs: _Inputs) -> Case:
    how = r.choice(["none", "none", "none", "grad", "vmap", "scan", "checkpoint", "jit",
                    "custom_vjp"])
    f, args = case.function, case.args
    if how == "grad":
        f = _grad_inside(f, args, inputs)
    elif how == "vmap":
        f, args = jax.vmap(f), _stacked(args)
    elif how == "scan":
        body = f
        f = lambda *stacked: jax.lax.scan(lambda c, a: (c, body(*a)), None, stacked)[1]
        args = _stacked(args)
    elif how == "checkpoint":
        f = jax.checkpoint(f)
    elif how == "jit":
        f = jax.jit(f)
    elif how == "custom_vjp":
        f = _with_custom_vjp(f)
    return dataclasses.replace(case, description=f"{case.description} wrap={how}",
                               function=f, args=args)


def generate(seed: int, family: str | None = None) -> Case:
    """The case of `seed`: a family (weighted), its spelling, then a transformation."""
    r = random.Random(seed)
    if family is None:
        family = r.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
    inputs = _Inputs(seed)
    case = GENERATORS[family](r, inputs)
    return _wrap(r, case, inputs)


# Checking -------------------------------------------------------------------------------


def _largest(arrays) -> float:
    """The largest finite magnitude among `arrays`, at least 1 (the inputs' scale): the
    scale each of them is compared at, so that a gradient that is zero but for rounding
    (of a bias constant along the keys) is not compared with its own rounding."""
    finite = [np.abs(a[np.isfinite(a)]) for a in map(np.asarray, arrays)]
    return max([float(a.max()) for a in finite if a.size] + [1.0])


def _difference(actual, expected, scale: float) -> str | None:
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    finite = np.isfinite(expected)
    if not np.array_equal(finite, np.isfinite(actual)):
        return "non-finite values differ"
    if not finite.any():
        return None
    err = float(np.max(np.abs(actual[finite] - expected[finite])))
    if err > TOLERANCE * scale:
        return f"max abs error {err:.3g} > {TOLERANCE:g} * scale {scale:.3g}"
    return None


def _weighted_loss(f, cotangents):
    def loss(*args):
        outs = jax.tree.leaves(f(*args))
        return sum((o.astype(jnp.float32) * c).sum() for o, c in zip(outs, cotangents,
                                                                    strict=True))
    return loss


def check(case: Case, seed: int) -> Outcome:
    """`optimize(case.function)` against `jax.jit` of it, values and gradients (random
    cotangents from `seed`) at HIGHEST precision. The caller keeps every rewrite
    candidate (the `rewritten` fixture), so that each match is checked on CPU."""
    with jax.default_matmul_precision("highest"):
        return _compare(case, seed)


def _compare(case: Case, seed: int) -> Outcome:
    f, args = case.function, case.args
    optimized = tokamax.optimize(f)
    rewritten = [m.pattern for m in optimized.plan(*args).matches if m.rewritten]
    expected = jax.tree.leaves(jax.jit(f)(*args))
    actual = jax.tree.leaves(optimized(*args))
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if (problem := _difference(a, e, _largest([e]))) is not None:
            return Outcome(case, f"output {i}: {problem}", rewritten)
    argnums = _differentiable(args)
    if not argnums:
        return Outcome(case, None, rewritten)
    inputs = _Inputs(seed + 1_000_003)
    cotangents = [inputs.normal(*e.shape) for e in expected]
    try:  # the gradient of `jax.jit(f)`, as `optimize(f)` is differentiated (the gradient
        # of a jitted `f` and a jitted gradient of it differ where the case is ill-conditioned)
        wanted = jax.grad(_weighted_loss(jax.jit(f), cotangents), argnums=argnums)(*args)
    except NotImplementedError:  # a second derivative JAX lacks (of a ragged dot)
        return Outcome(case, None, rewritten)
    got = jax.grad(_weighted_loss(optimized, cotangents), argnums=argnums)(*args)
    scale = _largest(wanted)
    for i, a, e in zip(argnums, got, wanted, strict=True):
        if (problem := _difference(a, e, scale)) is not None:
            return Outcome(case, f"gradient of argument {i}: {problem}", rewritten)
    return Outcome(case, None, rewritten)
