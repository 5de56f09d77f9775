"""The model suite on CPU: every model tiny, ours against plain JAX, and the timing path."""

from __future__ import annotations

import json
import statistics

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from benchmarks.models import MODELS, ops, run


def test_list_names_every_model(capsys):
    assert run.main(["--list"]) == 0
    listed = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["llama", "mixtral", "deepseek_moe", "moe_decode", "gemma2",
                      "encoder", "lm_head"] == list(MODELS)


@pytest.mark.slow  # CI's `benchmarks.models --smoke` step runs both models
def test_fine_grained_moe_training_and_decode_smoke():
    """The DeepSeek-MoE-style model (64 experts top-6 at full size, shared expert) and its
    decode step run tiny: ours matches plain JAX; the decode step is forward only."""
    assert run.smoke(["deepseek_moe", "moe_decode"], dtypes=["float32"]) == []
    decode = MODELS["moe_decode"]
    assert decode.forward_only and not decode.config.with_attention
    assert decode.config.batch * decode.config.seq == 256
    # The smoke above ran both steps' losses and gradients (and a non-finite loss fails
    # it); what is left are the steps' structures, which shapes alone give (no second
    # compilation of either model).
    params, batch = run._inputs(decode, smoke=True)
    out = jax.eval_shape(decode.step_fn(ops.Plain(), smoke=True), params, batch)
    assert out.shape == ()
    train = MODELS["deepseek_moe"]
    assert (train.config.experts, train.config.top_k, train.config.mlp) == (64, 6, 1408)
    grads = jax.eval_shape(train.step_fn(ops.Plain(), smoke=True),
                           *run._inputs(train, smoke=True))
    assert set(grads["layers"][0]) >= {"shared_gate_up", "shared_down", "router", "down"}


def test_lm_head_model_smoke_and_its_plain_twin_holds_the_head_and_loss_pattern():
    """The LM head + loss model runs tiny (ours matches plain JAX); its plain twin, handed
    to `optimize` unmodified, shows the head + cross-entropy and the norm as matches."""
    assert run.smoke(["lm_head"], dtypes=["float32"]) == []
    model = MODELS["lm_head"]
    assert (model.config.width, model.config.vocab) == (4096, 128256)
    params, batch = run._inputs(model, smoke=True)
    plan = tokamax.optimize(model.step_fn(ops.Plain(), smoke=True)).plan(params, batch)
    assert sorted(m.pattern for m in plan.matches) == [
        "layer_norm", "linear_softmax_cross_entropy_loss"]


@pytest.mark.slow  # a check of the smoke checker
def test_smoke_catches_a_wrong_op(monkeypatch):
    """The smoke check is what CI runs on every model; here it must fail when one of our
    ops computes something else (attention with its scale dropped, a norm off by 1%); the
    unbroken models pass it in `dev.sh test`'s smoke run."""
    original = ops.Library.attention

    def unscaled(self, q, k, v, **kwargs):
        return original(self, q * jnp.sqrt(q.shape[-1]).astype(q.dtype), k, v, **kwargs)

    monkeypatch.setattr(ops.Library, "attention", unscaled)
    assert run.smoke(["llama"]) != []
    monkeypatch.setattr(ops.Library, "attention", original)
    monkeypatch.setattr(ops.Library, "layer_norm",
                        lambda self, x, s, o, eps=1e-6: ops.Plain().layer_norm(x, s * 1.01, o))
    assert run.smoke(["encoder"]) != []


def test_mixtral_smoke_checks_the_router_in_float32(monkeypatch):
    """Mixtral's gradients (its top-k routing is a choice that rounding can flip at 16
    bits) are compared in float32, where a wrong MoE combine must fail them."""
    plain_combine = ops.Plain.moe_combine
    monkeypatch.setattr(ops.Library, "moe_dispatch", ops.Plain.moe_dispatch)
    monkeypatch.setattr(ops.Library, "moe_combine", lambda self, out, order, weights:
                        plain_combine(self, out, order, weights[..., ::-1]))
    assert run.smoke(["mixtral"], dtypes=["float32"]) != []
    monkeypatch.undo()
    assert run.smoke(["mixtral"], dtypes=["float32"]) == []


def test_smoke_in_float16_and_float32_and_its_tighter_tolerance(monkeypatch):
    """`--smoke` checks each dtype; float32's tolerance catches a norm off by 0.1%, which
    bfloat16's rounding would hide."""
    assert run.main(["--smoke", "--only", "encoder", "--dtypes", "float16,float32"]) == 0
    assert run.SMOKE_TOLERANCE["float32"] < 1e-3 < run.SMOKE_TOLERANCE["bfloat16"]
    monkeypatch.setattr(ops.Library, "layer_norm",
                        lambda self, x, s, o, eps=1e-6: ops.Plain().layer_norm(x, s * 1.001, o))
    assert run.smoke(["encoder"], dtypes=["float32"]) != []


@pytest.mark.slow
def test_tiny_timing_writes_every_variant_and_the_tuned_result(tmp_path):
    out = tmp_path / "models.json"
    assert run.main(["--tiny", "--only", "encoder", "--iterations", "2", "--output", str(out),
                     "--variants", "plain,ours,optimize,tuned", "--tuned-dir",
                     str(tmp_path / "tuned")]) == 0
    row = json.loads(out.read_text())["models"]["encoder"]
    for variant in ("plain", "ours", "optimize", "tuned"):
        assert row[variant]["ms"] > 0 and row[variant]["vs_plain"] > 0, variant
    assert row["autotune_op_calls"] >= 4  # norms and attention, forward and backward
    assert "layer_norm" in row["optimize_plan"]
    assert (tmp_path / "tuned" / "encoder_tuned.json").exists()
    assert isinstance(row["tuned_plan_changes"], list)
    assert len(row["tuned_alternated"]["tuned_ms"]) == run.ALTERNATED_ROUNDS
    assert out.with_suffix(".png").exists()


def test_plan_changes_names_the_calls_a_tuned_result_changes():
    """The suite records which calls tuning changed: none means tuned and untuned run the
    same kernels and configs, and any time between them is run-to-run variance."""
    from _square_op import ChunkConfig, fastest_result, square_bound, square_loss
    from conftest import random_normal

    x, scale = random_normal(0, (16, 64)), random_normal(1, (64,))
    assert run.plan_changes(square_loss, x, scale, fastest_result()) == []
    changed = run.plan_changes(square_loss, x, scale,
                               fastest_result((square_bound(x, scale), ChunkConfig(4))))
    assert len(changed) == 1 and changed[0].endswith("ChunkConfig(chunk=4)"), changed


def test_alternated_times_untuned_and_tuned_in_turn():
    from _square_op import ChunkConfig, fastest_result, square_bound, square_loss
    from conftest import random_normal

    x, scale = random_normal(0, (16, 64)), random_normal(1, (64,))
    found = run.alternated(jax.grad(square_loss), x, scale,
                           fastest_result((square_bound(x, scale), ChunkConfig(4))), iterations=2,
                           rounds=2)
    assert len(found["untuned_ms"]) == len(found["tuned_ms"]) == 2
    assert min(found["untuned_ms"] + found["tuned_ms"]) > 0
    assert found["tuned_speedup"] == pytest.approx(
        statistics.median(found["untuned_ms"]) / statistics.median(found["tuned_ms"]))


def test_alternated_swaps_which_goes_first_so_a_steady_drift_cancels(monkeypatch):
    """Two runners of one program whose times grow by 1 ms per timing: the rounds go
    untuned, tuned, tuned, untuned, ... and the speedup comes out 1 exactly (always
    untuned first, it would read below 1)."""
    from _square_op import ChunkConfig, fastest_result, square_bound, square_loss

    order, clock = [], iter(range(100))

    runners: list[str] = []

    def runner(step, params, batch):
        del step, params, batch
        label = ["untuned", "tuned"][len(runners)]  # made untuned first, then tuned
        runners.append(label)
        return lambda iterations: order.append(label) or 40.0 + next(clock)

    monkeypatch.setattr(run, "_runner", runner)
    x, scale = jax.ShapeDtypeStruct((16, 64), "float32"), jax.ShapeDtypeStruct((64,), "float32")
    found = run.alternated(jax.grad(square_loss), x, scale,
                           fastest_result((square_bound(x, scale), ChunkConfig(4))), iterations=2,
                           rounds=4)
    assert order == ["untuned", "tuned", "tuned", "untuned"] * 2
    assert found["tuned_speedup"] == 1.0


def test_ablation_swaps_exactly_the_named_op_family():
    from benchmarks.models import ablation

    model = MODELS["mixtral"]
    params, batch = run._inputs(model, smoke=True)
    assert ablation._families_called(model, params, batch) == [
        "rms_norm", "add_rms_norm", "attention", "moe_glu", "ragged_dot", "lm_head_loss"]
    ours = ops.variants()["ours"]
    swapped = ops.Swapped(ours, frozenset({"ragged_dot"}))
    assert swapped.ragged_dot.__self__ == ops.Plain() and swapped.attention.__self__ is ours
    assert swapped.name == "ours with plain ragged_dot"


def test_breakdown_sorts_kernels_into_categories():
    from benchmarks.models import breakdown

    assert breakdown.category("cudnn_generated_fort_native_sdpa_sm90", "custom-call.3") == (
        "attention")
    assert breakdown.category("nvjet_tst_128x256", "dot.12") == "gemm"
    assert breakdown.category("loop_multiply_fusion", "multiply_fusion.4") == "xla fusion"
    assert breakdown.category("sort_kernel", "sort.1") == "other"


def test_breakdown_profiles_a_tiny_step():
    from benchmarks.models import breakdown

    model = MODELS["llama"]
    params, batch = run._inputs(model, smoke=True)
    step = jax.jit(jax.grad(model.loss_fn(ops.Plain(), smoke=True)))
    found = breakdown.profile_step(step, (params, batch), steps=1)
    assert found["busy_ms"] > 0 and found["categories_ms"]["gemm"] > 0
    assert abs(sum(found["categories_ms"].values()) - found["busy_ms"]) < 1e-6
    assert found["top_kernels"][0]["ms"] >= found["top_kernels"][-1]["ms"]


def test_set_overrides_config_fields_by_their_type():
    def error(message):
        raise ValueError(message)

    model = run.resized(MODELS["llama"], ["width=4096", "soft_cap=30", "window=None"], error)
    assert model.config.width == 4096 and model.config.soft_cap == 30.0
    assert model.config.window is None and model.config.mlp == MODELS["llama"].config.mlp
    assert run.resized(MODELS["encoder"], ["dtype=float16"], error).config.dtype == "float16"
    for bad in (["widht=4096"], ["width"], ["width=wide"], ["dtype=float8"]):
        try:
            run.resized(MODELS["llama"], bad, error)
        except ValueError as e:
            assert bad[0].split("=")[0] in str(e)
        else:
            raise AssertionError(f"--set {bad} was accepted")


def test_ratios_to_plain_whichever_order_the_variants_ran_in():
    row = {"config": "c", "ours": {"ms": 40.0}, "autotune_s": 3.0}
    run._ratios_to_plain(row)
    assert "vs_plain" not in row["ours"]
    row["plain"] = {"ms": 42.0}
    run._ratios_to_plain(row)
    assert row["ours"]["vs_plain"] == 42.0 / 40.0 and row["plain"]["vs_plain"] == 1.0
