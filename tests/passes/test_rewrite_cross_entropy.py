"""`optimize` rewrites `x @ w` (or `x @ embedding.T`, a tied `(V, H)` embedding)
followed by softmax cross-entropy with integer labels, written in plain JAX
(`log_softmax` + `take_along_axis`, as optax spells it, also under the user's `jax.vmap`
or in a `jax.shard_map` body, the label's log-probability negated after its mean, the
label picked by fancy indexing, or against one-hot labels, negated there or after the
mean), into the
`linear_softmax_cross_entropy_loss` op where `implementation=None` picks a kernel for
it, and leaves near-misses as written.

On CPU the plain path is chosen, so `rewritten` keeps every candidate: values and
gradients of the rewritten program (the op's `xla` path and its VJP) are compared with
`jax.jit` of the user's function, in float32 at HIGHEST precision.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from _rewriting import HIGHEST, REWRITTEN, h200_plan, op_names, outcomes
from conftest import assert_close, calibrate, random_normal

B, T, H, V = 2, 6, 16, 24


def logits_of(x, w):
    return jnp.matmul(x, w, precision=HIGHEST).astype(jnp.float32)


def log_softmax_loss(x, w, labels):
    log_probs = jax.nn.log_softmax(logits_of(x, w), axis=-1)
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]


def optax_spelling(x, w, labels):
    """`optax.softmax_cross_entropy_with_integer_labels(x @ w, labels)`, as optax writes it."""
    logits = logits_of(x, w)
    label_logits = jnp.take_along_axis(logits, jnp.expand_dims(labels, -1), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - label_logits.squeeze(-1)


def optax_shifted_spelling(x, w, labels):
    """`optax.softmax_cross_entropy_with_integer_labels` as optax computes it: the logits
    shifted by their gradient-stopped max, `log(sum(exp))` minus the label's."""
    logits = logits_of(x, w)
    logits -= jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.log(jnp.sum(jnp.exp(logits), axis=-1)) - label_logits


def optax_shifted_spelling_with_initial(x, w, labels):
    """optax's versions taking `where=`: the max with `initial=-jnp.inf`."""
    logits = logits_of(x, w)
    logits_max = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
    logits -= jax.lax.stop_gradient(logits_max)
    label_logits = jnp.take_along_axis(logits, jnp.expand_dims(labels, -1), axis=-1)
    return jnp.log(jnp.sum(jnp.exp(logits), axis=-1)) - label_logits.squeeze(-1)


def mean_loss(x, w, labels):
    return optax_spelling(x, w, labels).mean()


def negated_mean_log_probability(x, w, labels):
    """The minus applied after the mean, as `-log_probs[...].mean()` parses."""
    log_probs = jax.nn.log_softmax(logits_of(x, w), axis=-1)
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0].mean()


def negated_mean_of_unsqueezed_log_probabilities(x, w, labels):
    """The picked log-probabilities left `(..., 1)` and averaged, then negated."""
    log_probs = jax.nn.log_softmax(logits_of(x, w), axis=-1)
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1).mean()


def log_softmax_by_lse(logits):
    return logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)


def lse_log_softmax_mean_loss(x, w, labels):
    """The log-softmax written as `logits - logsumexp(logits)`, the label's picked."""
    log_probs = log_softmax_by_lse(logits_of(x, w))
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0].mean()


def lse_one_hot_loss(x, w, labels):
    return -(jax.nn.one_hot(labels, V) * log_softmax_by_lse(logits_of(x, w))).sum(-1)


def one_hot_loss_summed_over_every_axis(x, w, labels):
    """Every token's loss summed in one reduction, as `-jnp.sum(one_hot * log_probs)`."""
    return -jnp.sum(jax.nn.log_softmax(logits_of(x, w)) * jax.nn.one_hot(labels, V))


def one_hot_loss(x, w, labels):
    """`optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, V))`: a label outside
    [0, V) has an all-zero row, so no loss."""
    return -(jax.nn.one_hot(labels, V) * jax.nn.log_softmax(logits_of(x, w))).sum(-1)


def bfloat16_one_hot_loss(x, w, labels):
    """The one-hot in bfloat16, which holds its zeros and ones exactly: the product
    promotes it to the float32 log-probabilities'."""
    one_hot = jax.nn.one_hot(labels, V, dtype=jnp.bfloat16)
    return -jnp.sum(one_hot * jax.nn.log_softmax(logits_of(x, w)), axis=-1)


def flax_one_hot(labels, num_classes):
    """`flax.training.common_utils.onehot`: a comparison selecting 1.0 or 0.0."""
    x = labels[..., None] == jnp.arange(num_classes).reshape((1,) * labels.ndim + (-1,))
    return jax.lax.select(x, jnp.full(x.shape, 1.0), jnp.full(x.shape, 0.0)).astype(jnp.float32)


def flax_one_hot_loss(x, w, labels):
    """Hugging Face's Flax training scripts: `optax.softmax_cross_entropy(logits,
    onehot(labels, V))`."""
    return -jnp.sum(flax_one_hot(labels, V) * jax.nn.log_softmax(logits_of(x, w)), axis=-1)


def compared_one_hot_loss(x, w, labels):
    one_hot = (labels[..., None] == jnp.arange(V)).astype(jnp.float32)
    return -(jax.nn.log_softmax(logits_of(x, w)) * one_hot).sum(-1)


def next_token_loss(x, w, labels):
    """Hugging Face's `run_clm_flax.py`: the logits of every token but the last against
    the labels of every token but the first."""
    logits = logits_of(x, w)[..., :-1, :]
    return -(flax_one_hot(labels[..., 1:], V) * jax.nn.log_softmax(logits)).sum(-1)


def next_token_log_softmax_loss(x, w, labels):
    logits = logits_of(x, w)[:, 1::2]
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(log_probs, labels[:, 1::2, None], axis=-1)[..., 0]


def next_token_loss_of_bfloat16_logits(x, w, labels):
    """A bfloat16 model's logits sliced, then cast to float32 for the loss."""
    logits = jnp.matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))[:, :-1]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(log_probs, labels[:, 1:, None], axis=-1)[..., 0]


def one_hot_logit_loss(x, w, labels):
    """Levanter's spelling: the log-sum-exp minus the label's logit picked by its one-hot
    (a label outside [0, V) picks nothing: the log-sum-exp alone)."""
    logits = logits_of(x, w)
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jax.nn.one_hot(labels, V) * logits, -1)


def one_hot_loss_summed_by_jnp(x, w, labels):
    return -jnp.sum(jax.nn.log_softmax(logits_of(x, w)) * jax.nn.one_hot(labels, V), axis=-1)


def negated_mean_of_one_hot_log_probabilities(x, w, labels):
    """The minus applied after the mean, as `-(one_hot * log_probs).sum(-1).mean()`
    parses."""
    one_hot = jax.nn.one_hot(labels, V)
    return -(one_hot * jax.nn.log_softmax(logits_of(x, w))).sum(-1).mean()


def soft_capped_loss(x, w, labels):
    """Gemma 2's final-logit soft cap before the loss."""
    logits = 3.0 * jnp.tanh(logits_of(x, w) / 3.0)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def flattened(x, labels):
    """The batch's tokens in one axis: fancy indexing by `jnp.arange(n)` picks from
    `(n, V)` logits."""
    return x.reshape(-1, x.shape[-1]), labels.reshape(-1)


def indexed_log_softmax_loss(x, w, labels):
    x, labels = flattened(x, labels)
    log_probs = jax.nn.log_softmax(logits_of(x, w))
    return -log_probs[jnp.arange(x.shape[0]), labels]


def indexed_negated_mean(x, w, labels):
    """`-log_probs[jnp.arange(n), labels].mean()`: the minus after the mean."""
    x, labels = flattened(x, labels)
    log_probs = jax.nn.log_softmax(logits_of(x, w))
    return -log_probs[jnp.arange(x.shape[0]), labels].mean()


def indexed_logit_loss(x, w, labels):
    x, labels = flattened(x, labels)
    logits = logits_of(x, w)
    return jax.nn.logsumexp(logits, axis=-1) - logits[jnp.arange(x.shape[0]), labels]


def indexed_soft_capped_logit_loss(x, w, labels):
    x, labels = flattened(x, labels)
    logits = 3.0 * jnp.tanh(logits_of(x, w) / 3.0)
    return jax.nn.logsumexp(logits, axis=-1) - logits[jnp.arange(x.shape[0]), labels]


def optax_per_example_under_vmap(x, w, labels):
    """optax's loss of each sequence averaged, under the user's `jax.vmap`: the batched
    log-sum-exp broadcasts its zero otherwise than the unbatched one."""
    return jax.vmap(lambda x, labels: optax_spelling(x, w, labels).mean())(x, labels)


def optax_per_token_under_vmap(x, w, labels):
    return jax.vmap(optax_spelling, in_axes=(0, None, 0))(x, w, labels)


def operands(seed=0, dtype=jnp.float32):
    x = random_normal(seed, (B, T, H), dtype)
    w = random_normal(seed + 1, (H, V), dtype)
    # Negative labels count from the end, as take_along_axis indexes.
    labels = jax.random.randint(jax.random.key(seed + 2), (B, T), -V, V)
    return x, w, labels


@pytest.mark.parametrize("f", [log_softmax_loss, optax_spelling, mean_loss,
                               optax_shifted_spelling, negated_mean_log_probability,
                               bfloat16_one_hot_loss,
                               negated_mean_of_unsqueezed_log_probabilities, one_hot_loss,
                               one_hot_loss_summed_by_jnp,
                               negated_mean_of_one_hot_log_probabilities, soft_capped_loss,
                               indexed_log_softmax_loss, indexed_negated_mean,
                               indexed_logit_loss, indexed_soft_capped_logit_loss,
                               optax_per_example_under_vmap, optax_per_token_under_vmap,
                               lse_log_softmax_mean_loss, lse_one_hot_loss,
                               one_hot_loss_summed_over_every_axis, flax_one_hot_loss,
                               compared_one_hot_loss, next_token_loss,
                               next_token_log_softmax_loss, one_hot_logit_loss],
                         ids=lambda f: f.__name__)
def test_values_and_gradients_match_jit(rewritten, f):
    x, w, labels = operands()
    cotangent = random_normal(9, jax.eval_shape(f, x, w, labels).shape)

    def loss(x, w, labels):
        return (f(x, w, labels) * cotangent).sum()

    expected = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w, labels)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    assert op_names(optimized, x, w, labels) == ["LinearSoftmaxCrossEntropyLoss"]
    assert_close(optimized(x, w, labels), jax.jit(f)(x, w, labels))
    value, grads = jax.value_and_grad(lambda x, w, labels: (optimized(x, w, labels)
                                                            * cotangent).sum(),
                                      argnums=(0, 1))(x, w, labels)
    assert_close(value, expected[0])
    for actual, wanted in zip(grads, expected[1], strict=True):
        assert_close(actual, wanted)


def test_bfloat16_logits_sliced_before_their_cast(rewritten):
    """The slice read between the product and the cast; gradients within bfloat16's
    rounding of the product's operands."""
    f = next_token_loss_of_bfloat16_logits
    x, w, labels = operands()
    cotangent = random_normal(9, (B, T - 1))

    def loss(fn, x, w):
        return (fn(x, w, labels) * cotangent).sum()

    optimized = tokamax.optimize(f)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    assert_close(optimized(x, w, labels), jax.jit(f)(x, w, labels))
    wanted = jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1)))(x, w)
    grads = jax.grad(functools.partial(loss, optimized), argnums=(0, 1))(x, w)
    for got, want in zip(grads, wanted, strict=True):
        assert_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("f", [log_softmax_loss, optax_spelling, negated_mean_log_probability,
                               optax_shifted_spelling_with_initial, bfloat16_one_hot_loss,
                               negated_mean_of_unsqueezed_log_probabilities, one_hot_loss,
                               negated_mean_of_one_hot_log_probabilities,
                               indexed_log_softmax_loss, indexed_negated_mean,
                               indexed_logit_loss, indexed_soft_capped_logit_loss,
                               optax_per_token_under_vmap, lse_log_softmax_mean_loss,
                               lse_one_hot_loss, one_hot_loss_summed_over_every_axis,
                               flax_one_hot_loss, compared_one_hot_loss, one_hot_logit_loss],
                         ids=lambda f: f.__name__)
def test_labels_out_of_range_have_the_values_and_gradients_of_jit(rewritten, f):
    """Labels past either end: `take_along_axis` gives NaN there (negative ones in range
    count from the end) and the gradient its spelling gives (the log-sum-exp's alone for
    optax's, none through `log_softmax`); `one_hot` selects nothing; fancy indexing
    clamps the label into [0, V) and drops its gradient (the log-sum-exp's alone
    through `lse - logit`, none through `log_softmax`)."""
    x, w, _ = operands()
    labels = jnp.array([[0, V, -V - 1, 3, -1, V + 2]] * B, jnp.int32)
    cotangent = random_normal(9, jax.eval_shape(f, x, w, labels).shape)
    expected = jax.jit(f)(x, w, labels)
    optimized = tokamax.optimize(f)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    actual = optimized(x, w, labels)
    assert jnp.array_equal(jnp.isnan(actual), jnp.isnan(expected))
    assert_close(jnp.nan_to_num(actual), jnp.nan_to_num(expected))

    def loss(fn, x, w):
        return (fn(x, w, labels) * cotangent).sum()

    wanted = jax.jit(jax.grad(functools.partial(loss, f), argnums=(0, 1)))(x, w)
    grads = jax.grad(functools.partial(loss, optimized), argnums=(0, 1))(x, w)
    for got, want in zip(grads, wanted, strict=True):
        assert jnp.isfinite(want).all()
        assert_close(got, want)


@pytest.mark.parametrize("dtype", [jnp.int16, jnp.uint8], ids=lambda d: d.__name__)
def test_fancy_indexing_reads_labels_of_a_narrower_integer_type(rewritten, dtype):
    """jnp converts the labels to the rows' int32 before pairing them: their own dtype is
    found a few equations back, and the clamping is the same."""
    x, w, _ = operands()
    labels = jnp.array([[0, V, 3, V + 2, 1, 2 * V]] * B, dtype)
    cotangent = random_normal(9, (B * T,))

    def loss(fn, x, w):
        return (fn(x, w, labels) * cotangent).sum()

    optimized = tokamax.optimize(indexed_logit_loss)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    assert_close(optimized(x, w, labels), jax.jit(indexed_logit_loss)(x, w, labels))
    wanted = jax.jit(jax.grad(functools.partial(loss, indexed_logit_loss), argnums=(0, 1)))
    grads = jax.grad(functools.partial(loss, optimized), argnums=(0, 1))(x, w)
    for got, want in zip(grads, wanted(x, w), strict=True):
        assert_close(got, want)


def test_out_of_range_labels_masked_after_the_loss_have_the_gradients_of_jit(rewritten):
    """Padding labels past the vocabulary, masked out with `jnp.where` after the loss:
    plain JAX's gradients are finite there, and so are the rewritten program's."""
    x, w, _ = operands()
    labels = jnp.array([[0, V, -V - 1, 3, -1, 2]] * B, jnp.int32)
    cotangent = random_normal(9, labels.shape)

    def loss(x, w, labels):
        losses = log_softmax_loss(x, w, labels)
        return jnp.sum(jnp.where((labels < V) & (labels >= -V), losses, 0.0) * cotangent)

    grad = jax.grad(loss, argnums=(0, 1))
    optimized = tokamax.optimize(grad)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    for actual, wanted in zip(optimized(x, w, labels), jax.jit(grad)(x, w, labels),
                              strict=True):
        assert jnp.isfinite(actual).all()
        assert_close(actual, wanted)


def test_a_per_example_loss_under_vmap_is_matched(rewritten):
    """`jax.vmap` of a per-sequence loss with shared weights: the batched equations leave
    NumPy integers in their parameters, which the spellings' are compared without."""
    x, w, labels = operands()
    per_example = jax.vmap(lambda x, w, labels: log_softmax_loss(x, w, labels).mean(),
                           in_axes=(0, None, 0))
    cotangent = random_normal(9, (B,))

    def loss(x, w, labels):
        return (per_example(x, w, labels) * cotangent).sum()

    optimized = tokamax.optimize(per_example)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    assert_close(optimized(x, w, labels), jax.jit(per_example)(x, w, labels))
    grads = jax.grad(lambda x, w: (optimized(x, w, labels) * cotangent).sum(),
                     argnums=(0, 1))(x, w)
    for actual, wanted in zip(grads, jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, labels),
                              strict=True):
        assert_close(actual, wanted)


def test_a_gradient_traced_inside_optimize_runs_the_op_and_its_vjp(rewritten):
    x, w, labels = operands()
    grad = jax.grad(mean_loss, argnums=(0, 1))
    optimized = tokamax.optimize(grad)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    assert op_names(optimized, x, w, labels)[0] == "LinearSoftmaxCrossEntropyLoss"
    for actual, wanted in zip(optimized(x, w, labels), jax.jit(grad)(x, w, labels),
                              strict=True):
        assert_close(actual, wanted)


def tied_logits_loss(x, embedding, labels):
    """A tied LM head, Gemma's: the logits against the `(V, H)` embedding, `x @ emb.T`
    written as one `einsum` (the `dot_general` contracts the embedding's last axis)."""
    logits = jnp.einsum("btd,vd->btv", x, embedding, precision=HIGHEST)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def transposed_embedding_loss(x, embedding, labels):
    """`x @ embedding.T` spelled with the transpose, as optax's loss of it."""
    return optax_spelling(x, embedding.T, labels)


@pytest.mark.exhaustive
@pytest.mark.parametrize("f", [tied_logits_loss, transposed_embedding_loss],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("vocabulary", [V, H], ids=["V", "square"])
def test_a_tied_embeddings_logits_are_rewritten(rewritten, f, vocabulary):
    """The `(V, H)` embedding is the op's weights transposed: values and both gradients
    (the embedding's in its own layout) are `jax.jit`'s; a square embedding, read the
    wrong way round, would give other values of the same shape."""
    x, _, labels = operands()
    embedding = random_normal(4, (vocabulary, H))
    labels = labels % vocabulary
    cotangent = random_normal(9, (B, T))

    def loss(fn, x, embedding):
        return (fn(x, embedding, labels) * cotangent).sum()

    optimized = tokamax.optimize(f)
    assert outcomes(optimized, x, embedding, labels) == [REWRITTEN]
    assert op_names(optimized, x, embedding, labels) == ["LinearSoftmaxCrossEntropyLoss"]
    expected = jax.jit(jax.value_and_grad(functools.partial(loss, f), argnums=(0, 1)))
    value, grads = jax.value_and_grad(functools.partial(loss, optimized), argnums=(0, 1))(
        x, embedding)
    wanted_value, wanted_grads = expected(x, embedding)
    assert_close(value, wanted_value)
    for actual, wanted in zip(grads, wanted_grads, strict=True):
        assert actual.shape == wanted.shape
        assert_close(actual, wanted)


def tied_language_model(tokens, embedding, labels):
    """The embedding looked up for the input tokens and tied to the LM head."""
    hidden = jnp.tanh(embedding[tokens])
    return tied_logits_loss(hidden, embedding, labels).mean()


def test_a_tied_embedding_also_looked_up_gets_the_sum_of_both_gradients(rewritten):
    _, _, labels = operands()
    tokens = jax.random.randint(jax.random.key(5), (B, T), 0, V)
    embedding = random_normal(4, (V, H))
    grad = jax.value_and_grad(tied_language_model, argnums=1)
    optimized = tokamax.optimize(grad)
    assert outcomes(optimized, tokens, embedding, labels) == [REWRITTEN]
    for actual, wanted in zip(optimized(tokens, embedding, labels),
                              jax.jit(grad)(tokens, embedding, labels), strict=True):
        assert_close(actual, wanted)


def test_a_loss_in_a_shard_map_body_checking_vma(rewritten):
    """`jax.shard_map`'s default `check_vma`: the literals in `log_softmax` and
    `take_along_axis` are cast to vary over the mesh axis (`pvary`), and still match."""
    mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    sharded = jax.shard_map(log_softmax_loss, mesh=mesh,
                            in_specs=(jax.P("d"), jax.P(), jax.P("d")), out_specs=jax.P("d"))
    x, w, labels = operands()
    optimized = tokamax.optimize(sharded)
    (match,) = optimized.plan(x, w, labels).matches
    assert (match.path, match.outcome) == ("shard_map/" + match.pattern, REWRITTEN)
    actual, expected = optimized(x, w, labels), jax.jit(sharded)(x, w, labels)
    assert jnp.array_equal(jnp.isnan(actual), jnp.isnan(expected))
    assert_close(jnp.nan_to_num(actual), jnp.nan_to_num(expected))


def logits_used_twice(x, w, labels):
    logits = logits_of(x, w)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - label_logits + logits.max(-1)


def softmax_over_the_wrong_axis(x, w, labels):
    log_probs = jax.nn.log_softmax(logits_of(x, w), axis=0)
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]


def smoothed_labels(x, w, labels):
    log_probs = jax.nn.log_softmax(logits_of(x, w), axis=-1)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return -(0.9 * picked + 0.1 * log_probs.mean(-1))


def float32_logits_of_a_bfloat16_product(x, w, labels):
    """A bfloat16 product accumulated into float32 logits (`preferred_element_type`): the
    op rounds its logits to bfloat16."""
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    log_probs = jax.nn.log_softmax(jnp.matmul(x, w, preferred_element_type=jnp.float32))
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]


def soft_capped_in_bfloat16(x, w, labels):
    """The cap applied to the bfloat16 logits before their cast: rounded where the op's
    float32 cap is not."""
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    logits = (3.0 * jnp.tanh((x @ w) / 3.0)).astype(jnp.float32)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


def bfloat16_logits(x, w, labels):
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    log_probs = jax.nn.log_softmax(x @ w, axis=-1)
    return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]


def indexed_in_reversed_rows(x, w, labels):
    """Each row's label paired with another row: not `jnp.arange(n)`."""
    x, labels = flattened(x, labels)
    log_probs = jax.nn.log_softmax(logits_of(x, w))
    return -log_probs[jnp.arange(x.shape[0])[::-1], labels]


def indexed_along_the_rows(x, w, labels):
    """The labels index the rows and `jnp.arange(n)` the vocabulary: the other axis."""
    x, labels = flattened(x, labels)
    log_probs = jax.nn.log_softmax(logits_of(x, w))
    return -log_probs[labels, jnp.arange(x.shape[0])]


def indexed_in_clip_mode(x, w, labels):
    """Another gather mode: a clipped label gets its gradient, unlike jnp's default."""
    x, labels = flattened(x, labels)
    log_probs = jax.nn.log_softmax(logits_of(x, w))
    return -log_probs.at[jnp.arange(x.shape[0]), labels].get(mode="clip")


def smoothed_bfloat16_one_hot(x, w, labels):
    """Label smoothing of a bfloat16 one-hot (`0.1 / V` rounded): no one-hot."""
    one_hot = jax.nn.one_hot(labels, V, dtype=jnp.bfloat16) * 0.9 + 0.1 / V
    return -jnp.sum(one_hot * jax.nn.log_softmax(logits_of(x, w)), axis=-1)


def smoothed_shifted_optax(x, w, labels):
    """optax's shifted spelling with label smoothing: the shifted logits read again."""
    logits = logits_of(x, w)
    logits -= jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    log_normalizers = jnp.log(jnp.sum(jnp.exp(logits), axis=-1))
    return log_normalizers - (0.9 * label_logits + 0.1 * logits.mean(-1))


def smoothed_optax_under_vmap(x, w, labels):
    """Label smoothing in the user's `jax.vmap`: the log-sum-exp is read again."""
    def per_example(x, labels):
        logits = logits_of(x, w)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return 0.9 * (lse - picked) + 0.1 * (lse - logits.mean(-1))

    return jax.vmap(per_example)(x, labels)


def a_slice_of_the_vocabulary(x, w, labels):
    """The logits' last column dropped: a softmax over fewer classes than `w` gives."""
    logits = logits_of(x, w)[..., :-1]
    return -(flax_one_hot(labels, V - 1) * jax.nn.log_softmax(logits)).sum(-1)


def one_hot_of_other_values(x, w, labels):
    """A comparison selecting 0.9 and 0.1 / (V - 1): label smoothing, not a one-hot."""
    hit = labels[..., None] == jnp.arange(V)
    smoothed = jax.lax.select(hit, jnp.full(hit.shape, 0.9), jnp.full(hit.shape, 0.1 / (V - 1)))
    return -(smoothed * jax.nn.log_softmax(logits_of(x, w))).sum(-1)


def smoothed_one_hot_logit(x, w, labels):
    logits = logits_of(x, w)
    smoothed = jax.nn.one_hot(labels, V) * 0.9 + 0.1 / V
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(smoothed * logits, -1)


def embedding_against_the_wrong_axis(x, w, labels):
    """A `(V, H)` embedding contracted with `x`'s middle axis, not its last (of the same
    length: the last would give other logits of the same shape)."""
    x, embedding = x[..., :T], w[:T].T
    logits = jnp.einsum("bdt,vd->btv", x, embedding, precision=HIGHEST)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]


@pytest.mark.parametrize("f", [softmax_over_the_wrong_axis, smoothed_labels, bfloat16_logits,
                               float32_logits_of_a_bfloat16_product, soft_capped_in_bfloat16,
                               indexed_in_reversed_rows, indexed_along_the_rows,
                               indexed_in_clip_mode, smoothed_optax_under_vmap,
                               smoothed_shifted_optax, smoothed_bfloat16_one_hot,
                               embedding_against_the_wrong_axis, a_slice_of_the_vocabulary,
                               one_hot_of_other_values, smoothed_one_hot_logit],
                         ids=lambda f: f.__name__)
def test_near_misses_are_left_as_written(rewritten, f):
    x, w, labels = operands()
    optimized = tokamax.optimize(f)
    assert not any(m.rewritten for m in optimized.plan(x, w, labels).matches)
    assert op_names(optimized, x, w, labels) == []
    assert_close(optimized(x, w, labels), jax.jit(f)(x, w, labels))


def test_logits_used_elsewhere_are_named(rewritten):
    x, w, labels = operands()
    optimized = tokamax.optimize(logits_used_twice)
    (match,) = optimized.plan(x, w, labels).matches
    assert not match.rewritten and "used elsewhere" in match.reason
    assert_close(optimized(x, w, labels), jax.jit(logits_used_twice)(x, w, labels))


# --- selection: only where a kernel is chosen ------------------------------------------

X = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
W = jax.ShapeDtypeStruct((4096, 128256), jnp.bfloat16)
LABELS = jax.ShapeDtypeStruct((8192,), jnp.int32)


def lm_head_loss(x, w, labels):
    logits = (x @ w).astype(jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return (jax.nn.logsumexp(logits, axis=-1) - label_logits).mean()


def tied_lm_head_loss(x, embedding, labels):
    logits = jnp.einsum("td,vd->tv", x, embedding).astype(jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return (jax.nn.logsumexp(logits, axis=-1) - label_logits).mean()


@pytest.mark.parametrize("f,w", [(lm_head_loss, W),
                                 (tied_lm_head_loss, jax.ShapeDtypeStruct(W.shape[::-1],
                                                                          W.dtype))],
                         ids=["untied", "tied"])
def test_a_kernel_predicted_faster_replaces_the_loss(calibration_dir, f, w):
    calibrate(calibration_dir, {"PallasMosaicGpuLinearSoftmaxCrossEntropyLoss": 0.8,
                                "LinearSoftmaxCrossEntropyLoss": 0.05})
    plan = h200_plan(f, X, w, LABELS)
    (match,) = plan.matches
    assert match.rewritten and match.implementation["cuda"] != "xla", match.outcome
    assert match.source_line.endswith(f"({f.__name__})")


def test_a_differentiated_loss_keeps_the_xla_path_for_its_memory(calibration_dir):
    """With the plain path chosen everywhere (no calibration: nothing predicts a kernel),
    a loss that is differentiated still becomes the op: its `xla` gradient keeps the
    log-sum-exp, not the float32 log-softmax. Forward only, it stays as written."""
    grad = jax.grad(lm_head_loss, argnums=(0, 1))
    (match,) = h200_plan(grad, X, W, LABELS).matches
    assert match.rewritten and match.implementation == {"cuda": "xla"}, match.outcome
    (match,) = h200_plan(lm_head_loss, X, W, LABELS).matches
    assert not match.rewritten and "plain path" in match.reason
    f32 = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (X, W)]
    (match,) = h200_plan(grad, *f32, LABELS).matches
    assert not match.rewritten and "plain path" in match.reason


def temporary_bytes(f, *args):
    return f.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_kept_xla_rewrite_keeps_less_memory_and_the_same_gradients():
    """Without the `rewritten` fixture, on CPU: a differentiated bfloat16 loss is
    rewritten to the op's `xla` path, its gradients match a float32 HIGHEST reference
    as the plain program's do, and the compiled step allocates less than the plain
    program (which keeps the float32 log-softmax). With float32 inputs both keep the
    same, and the loss stays as written."""
    grad = jax.grad(lm_head_loss, argnums=(0, 1))
    x32, w32 = random_normal(20, (2, 256, 64)), random_normal(21, (64, 2048)) / 8
    labels = jax.random.randint(jax.random.key(22), (2, 256), 0, 2048)
    x, w = x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    optimized = tokamax.optimize(grad)
    assert outcomes(optimized, x, w, labels) == [REWRITTEN]
    with jax.default_matmul_precision("highest"):
        expected = jax.jit(grad)(x.astype(jnp.float32), w.astype(jnp.float32), labels)
    for actual, plain, wanted in zip(optimized(x, w, labels), jax.jit(grad)(x, w, labels),
                                     expected, strict=True):
        assert_close(actual, wanted, jnp.bfloat16)
        assert_close(plain, wanted, jnp.bfloat16)
    assert temporary_bytes(optimized, x, w, labels) < 0.9 * temporary_bytes(
        jax.jit(grad), x, w, labels)
    assert outcomes(tokamax.optimize(grad), x32, w32, labels) == [
        "left alone: the plain path is chosen (cpu xla)"]


def test_rewrite_option_selects_the_pattern(calibration_dir):
    calibrate(calibration_dir, {"PallasMosaicGpuLinearSoftmaxCrossEntropyLoss": 0.8,
                                "LinearSoftmaxCrossEntropyLoss": 0.05})
    for option in (False, ("layer_norm",)):
        plan = h200_plan(lm_head_loss, X, W, LABELS, rewrite=option)
        assert len(plan) == 0 and not plan.matches
