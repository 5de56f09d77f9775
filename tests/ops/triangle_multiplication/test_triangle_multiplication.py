"""`triangle_multiplication` against the float32 HIGHEST reference: forward and the
gradient of every float argument (random cotangent), both triangle types, a batch of
pair representations, float32 and bfloat16; the `implementation=` names; bad arguments."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _triangle_multiplication_reference import WEIGHTS, random_arguments, reference
from conftest import assert_close, random_normal

BATCH, N, C, H, D = (2,), 6, 8, 4, 5
# bfloat16 gradients pass through two layer norms (one over H channels) and the products
# rounded to bfloat16 between them: the plain bfloat16 expression (the ops' XLA GEMMs in
# bfloat16, the norms' statistics in float32) is off by up to 9% of the scale here too.
BFLOAT16_GRADIENT_RTOL = 0.15


def check_against_reference(arguments, triangle_type, dtype, **keywords):
    """Forward and every float argument's gradient against `reference` run on the same
    (rounded) inputs in float32."""
    mask = arguments["mask"]
    floats = [arguments["x"], *(arguments[name] for name in WEIGHTS)]

    def op(x, *weights):
        return tokamax.triangle_multiplication(x, mask, *weights, triangle_type, **keywords)

    def ref(x, *weights):
        return reference(x, mask, *weights, triangle_type)

    out, pullback = jax.vjp(op, *floats)
    expected, ref_pullback = jax.vjp(ref, *[a.astype(jnp.float32) for a in floats])
    assert out.dtype == dtype and out.shape == (*BATCH, N, N, D)
    assert_close(out, expected, dtype)
    cotangent = random_normal(7, out.shape, dtype)
    grads = pullback(cotangent)
    rtol = BFLOAT16_GRADIENT_RTOL if dtype == jnp.bfloat16 else None
    for name, g, e in zip(("x", *WEIGHTS), grads, ref_pullback(cotangent.astype(jnp.float32)),
                          strict=True):
        assert g.dtype == dtype, name
        assert_close(g, e, dtype, scale_rtol=rtol)


@pytest.mark.parametrize(("triangle_type", "implementation"),
                         [("outgoing", "xla"), ("incoming", None)])
def test_float32_forward_and_gradient(triangle_type, implementation):
    arguments = random_arguments(0, BATCH, N, C, H, D)
    check_against_reference(arguments, triangle_type, jnp.float32,
                            implementation=implementation)


@pytest.mark.slow  # the float32 cases cover the path
@pytest.mark.parametrize("triangle_type", ["outgoing", "incoming"])
def test_bfloat16_forward_and_gradient(triangle_type):
    arguments = random_arguments(1, BATCH, N, C, H, D, jnp.bfloat16)
    check_against_reference(arguments, triangle_type, jnp.bfloat16)


@pytest.mark.slow  # a batch of 2 runs in every other case
def test_batch_matches_one_pair_representation_at_a_time_and_vmap():
    arguments = random_arguments(2, BATCH, N, C, H, D)
    weights = [arguments[name] for name in WEIGHTS]
    call = lambda x, mask: tokamax.triangle_multiplication(
        x, mask, *weights, "outgoing")
    batched = call(arguments["x"], arguments["mask"])
    np.testing.assert_allclose(jax.vmap(call)(arguments["x"], arguments["mask"]), batched,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(call(arguments["x"][1], arguments["mask"][1]), batched[1],
                               rtol=1e-6, atol=1e-6)


def test_float_mask_and_epsilon_precision_keywords():
    arguments = random_arguments(3, BATCH, N, C, H, D)
    x, mask = arguments["x"], arguments["mask"]
    weights = [arguments[name] for name in WEIGHTS]
    out = tokamax.triangle_multiplication(x, mask.astype(jnp.float32), *weights, "incoming",
                                          epsilon=0.5, precision="highest")
    assert_close(out, reference(x, mask, *weights, "incoming", epsilon=0.5))


def test_the_ops_namespace_holds_it():
    assert tokamax.ops.triangle_multiplication is tokamax.triangle_multiplication


class TestImplementation:
    arguments = random_arguments(4, (), 4, 4, 2, 3)

    def call(self, implementation):
        return tokamax.triangle_multiplication(**self.arguments, triangle_type="outgoing",
                                               implementation=implementation)

    @pytest.mark.parametrize("name", ["triton", "mosaic", "unsupported"])
    def test_a_name_other_than_xla_is_not_implemented(self, name):
        with pytest.raises(NotImplementedError, match=name):
            self.call(name)

    def test_a_sequence_moves_past_upstreams_kernels_to_xla(self):
        expected = self.call("xla")
        np.testing.assert_array_equal(self.call(("triton", "mosaic", "xla")), expected)
        with pytest.raises(tokamax.AllImplementationsFailedError) as info:
            self.call(("triton", "mosaic"))
        assert len(info.value.exceptions) == 2

    def test_an_unknown_name_in_a_sequence_is_not_skipped(self):
        with pytest.raises(NotImplementedError, match="typo"):
            self.call(("typo", "xla"))

    def test_empty_sequence_and_other_types(self):
        with pytest.raises(ValueError, match="empty"):
            self.call(())
        with pytest.raises(TypeError):
            self.call(3)

    def test_a_function_gets_the_call_as_written(self):
        calls = []

        def declines(*args, **keywords):
            calls.append((len(args), args[-1], keywords))
            raise NotImplementedError("declined")

        out = tokamax.triangle_multiplication(
            *(self.arguments[k] for k in ("x", "mask", *WEIGHTS)), "incoming", epsilon=1e-3,
            implementation=(declines, "xla"))
        assert calls == [(11, "incoming", {"epsilon": 1e-3})]
        assert out.shape == (4, 4, 3)


@pytest.mark.parametrize(("change", "match"), [
    (dict(triangle_type="sideways"), "triangle_type"),
    (dict(x=jnp.zeros((4, 5, 4))), "pair representation"),
    (dict(mask=jnp.ones((4, 3), bool)), "mask"),
    (dict(gate_in_weights=jnp.zeros((4, 2, 3))), "gate_in_weights"),
    (dict(gate_out_weights=jnp.zeros((4, 2))), "gate_out_weights"),
    (dict(layernorm_out_offset=jnp.zeros((4,))), "layernorm_out_offset"),
    (dict(epsilon=-1.0), "epsilon"),
    (dict(precision="nonsense"), "precision"),
])
def test_bad_arguments_name_the_argument(change, match):
    arguments = {**random_arguments(5, (), 4, 4, 2, 3), "triangle_type": "outgoing", **change}
    with pytest.raises(ValueError, match=match):
        tokamax.triangle_multiplication(**arguments)
