"""Tuned StableHLO artifacts: `tokamax_pass.export`, `load_artifact`, `inspect`, and the seed's
`jax.export` snippet. CPU only; the cuda lowering is checked in the exported module."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tk
from _square_op import ChunkConfig, fastest_result, square_bound, square_loss
from conftest import H200, assert_close, random_normal, reference_precision
from tokamax_pass.export import Artifact, ArtifactMismatchError, check_compatible

# Kernels first, where the platform runs them (`None` would run the XLA paths at these
# unmeasured shapes): each platform's lowering of one artifact picks its own.
KERNEL_OR_XLA = ("triton", "xla")


def loss(x, scale):
    x = tk.layer_norm(x, scale=scale, offset=None, implementation=KERNEL_OR_XLA)
    x = tk.dot_product_attention(x, x, x, implementation=KERNEL_OR_XLA)
    return jnp.sum(x)


@pytest.fixture(scope="module")
def xs():
    return random_normal(1, (2, 16, 2, 64)), random_normal(0, (64,))


@pytest.fixture(scope="module")
def multi_platform(xs):
    """One artifact for cpu and cuda (H200) of the seed's gradient, made on this CPU."""
    return tk.export(jax.grad(loss), *xs, platforms=("cpu", "cuda"), device_kind=H200)


def test_seed_snippet(xs):
    x, scale = xs
    f_grad = jax.jit(jax.grad(loss))
    exported = jax.export.export(f_grad, disabled_checks=tk.DISABLE_JAX_EXPORT_CHECKS)(
        jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(scale.shape, scale.dtype))
    np.testing.assert_array_equal(np.asarray(exported.call(x, scale)),
                                  np.asarray(f_grad(x, scale)))


def test_cpu_round_trip(xs, tmp_path):
    x, scale = xs
    artifact = tk.export(jax.grad(loss), x, scale)
    directory = artifact.save(tmp_path / "art")
    assert sorted(p.name for p in directory.iterdir()) == ["loss.stablehlo", "manifest.json"]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["platforms"] == ["cpu"] and manifest["device_kinds"]["cpu"] == "cpu"
    assert manifest["in_specs"] == ["f32[2,16,2,64]", "f32[64]"]
    assert manifest["versions"]["jax"] == jax.__version__
    assert [op["path"] for op in manifest["ops"]] == [
        "layer_norm", "dot_product_attention", "dot_product_attention_vjp", "layer_norm_vjp"]
    assert all({"implementation", "config", "source", "bound"} <= set(op)
               for op in manifest["ops"])
    loaded = tk.load_artifact(directory)
    # Printed, it says what it is in a line, not the program's bytes.
    assert repr(loaded) == (f"LoadedArtifact(Artifact('loss', platforms=['cpu'], 4 op call(s), "
                            f"{len(artifact.serialized)} program bytes))")
    with reference_precision():
        want = jax.jit(jax.grad(loss))(x, scale)
    assert_close(loaded(x, scale), want)


def test_string_specs_and_an_optimized_function(xs):
    x, scale = xs[0][0, :, 0], xs[1]
    result = fastest_result((square_bound(x, scale), ChunkConfig(4)))
    optimized = tk.optimize(square_loss, results=result)
    artifact = tk.export(optimized, "f32[16,64]", "f32[64]", name="tuned")
    assert artifact.name == "tuned"
    (op,) = artifact.manifest["ops"]
    assert (op["config"], op["source"]) == ("ChunkConfig(chunk=4)", "autotuning result")
    assert "\\22chunk\\22:4" in artifact.mlir_text()
    assert_close(artifact(x, scale), jax.jit(square_loss)(x, scale))
    # The method form gives the same program.
    assert optimized.export(x, scale).manifest["ops"] == artifact.manifest["ops"]


def test_one_artifact_a_kernel_per_platform(multi_platform, xs, tmp_path):
    x, scale = xs
    manifest = multi_platform.manifest
    assert manifest["platforms"] == ["cpu", "cuda"]
    assert manifest["device_kinds"] == {"cpu": "cpu", "cuda": H200}
    by_platform = {}
    for op in manifest["ops"]:
        by_platform.setdefault(op["platform"], []).append(op)
    assert {op["implementation"] for op in by_platform["cpu"]} == {"xla"}
    cuda = {op["path"]: op for op in by_platform["cuda"]}
    assert cuda["layer_norm"]["op"] == "PallasTritonLayerNorm"
    assert cuda["layer_norm_vjp"]["implementation"] == "triton"
    assert cuda["dot_product_attention"]["implementation"] != "xla"
    assert "__gpu$xla.gpu.triton" in manifest["custom_calls"]
    # The cuda lowering holds the GPU kernels with their specs; the CPU one runs here.
    text = multi_platform.mlir_text()
    assert "__gpu$xla.gpu.triton" in text and "PallasTritonLayerNorm" in text
    loaded = tk.load_artifact(multi_platform.save(tmp_path / "both"))
    with reference_precision():
        assert_close(loaded(x, scale), jax.jit(jax.grad(loss))(x, scale))


def test_load_refuses_another_device(xs, tmp_path):
    x, scale = xs
    cuda_only = tk.export(loss, x, scale, device_kind=H200)
    assert cuda_only.manifest["platforms"] == ["cuda"]
    directory = cuda_only.save(tmp_path / "cuda")
    with pytest.raises(ArtifactMismatchError, match=r"exported for \['cuda'\], not for cpu"):
        tk.load_artifact(directory)
    assert tk.load_artifact(directory, check=False).manifest["device_kind"] == H200
    cpu = jax.devices()[0]
    manifest = dict(cuda_only.manifest, platforms=["cpu"], device_kinds={"cpu": "Other CPU"})
    with pytest.raises(ArtifactMismatchError, match="tuned for 'Other CPU'"):
        check_compatible(manifest, cpu)
    newer = dict(manifest, device_kinds={"cpu": cpu.device_kind},
                 versions={**manifest["versions"], "jax": "99.0.0"})
    with pytest.raises(ArtifactMismatchError, match="newer than the installed"):
        check_compatible(newer, cpu)
    check_compatible(dict(newer, versions=manifest["versions"]), cpu)


def test_bad_inputs(xs, tmp_path):
    with pytest.raises(ValueError, match="platforms must name"):
        tk.export(loss, *xs, platforms=("gpu9",))
    with pytest.raises(ValueError, match="has no 'cuda'"):
        tk.export(loss, *xs, platforms=("cpu",), device_kind=H200)
    with pytest.raises(ValueError, match="not an array spec"):
        tk.export(loss, "f32(2,3)", "f32[64]")
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        tk.load_artifact(tmp_path)


def test_inspect_every_form(multi_platform, xs, tmp_path):
    directory = multi_platform.save(tmp_path / "art")
    from_dir = tk.inspect(directory)
    assert from_dir.manifest["name"] == "loss"
    ops = {o.op for o in from_dir.ops}
    assert {"LayerNorm", "PallasTritonLayerNorm", "PallasTritonLayerNormVjp",
            "DotProductAttention"} <= ops
    assert "__gpu$xla.gpu.triton" in from_dir.custom_calls
    text = str(from_dir)
    assert "PallasTritonLayerNorm" in text and "platform" in text and H200 in text
    from_file = tk.inspect(directory / "loss.stablehlo")
    assert from_file.ops == from_dir.ops and from_file.manifest is None
    mlir = tmp_path / "lowered.mlir"
    mlir.write_text(tk.optimize(loss).lower(*xs).as_text())
    lowered = tk.inspect(mlir)
    assert [(o.op, o.implementation) for o in lowered.ops] == [
        ("LayerNorm", "xla"), ("DotProductAttention", "xla")]
    assert lowered.ops[0].arguments == "scale=f32[64], x=f32[2,16,2,64]"
    # HLO text spells the attribute as a bare JSON object; it is found too.
    hlo = jax.jit(loss).lower(*xs).as_text(dialect="hlo")
    assert {o.op for o in tk.inspect(hlo).ops} == {"LayerNorm", "DotProductAttention"}
    assert tk.inspect(Artifact.load(directory)).ops == from_dir.ops
    # The class the docs name is the package's (`tokamax_pass.Artifact`).
    assert tk.Artifact is Artifact and isinstance(tk.load_artifact(directory, check=False),
                                                  tk.LoadedArtifact)


def test_a_fresh_process_loads_the_mosaic_gpu_runtime_an_artifact_needs(tmp_path):
    """A process that only loads an artifact imports no kernel code; a Mosaic GPU kernel
    then finds no runtime library ("Symbols not found: mosaic_gpu_launch_kernel" on the
    H200). Deserializing the program imports its runtime first."""
    import subprocess
    import sys

    from examples import seed_model

    spec = [jax.ShapeDtypeStruct((32, 2048, 16, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((64,), jnp.float32)]
    artifact = tk.export(jax.grad(seed_model.loss), *spec, platforms=("cpu", "cuda"),
                         device_kind=H200)
    assert any(t.startswith("mosaic_gpu") for t in artifact.manifest["custom_calls"])
    directory = artifact.save(tmp_path / "seed")

    def run(check: bool) -> list[str]:
        script = (
            "import sys, tokamax_pass as tk\n"
            "MOSAIC = 'jax.experimental.mosaic.gpu'\n"
            f"loaded = tk.load_artifact({str(directory)!r}, check={check})\n"
            "before = MOSAIC in sys.modules\n"
            "loaded.artifact.exported\n"
            "print(before, MOSAIC in sys.modules)\n")
        ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True)
        return ran.stdout.split()

    assert run(check=False) == ["False", "True"]
    # A checked load deserializes the program to compare it with its manifest: the
    # runtime is imported before that too.
    assert run(check=True) == ["True", "True"]


def test_an_unknown_cuda_device_kind_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="'NVIDIA Bogus 9000' is not a CUDA device kind JAX "
                                         "can lower kernels for .*'NVIDIA H200'"):
        tk.export(lambda q: tk.dot_product_attention(q, q, q), "bf16[1,128,2,64]",
                  platforms=["cuda"], device_kind="NVIDIA Bogus 9000")


def test_an_artifact_with_symbolic_batch_and_sequence_runs_at_any_size(tmp_path):
    """`tk.export` (and so `optimize(f).export`) takes `jax.export.symbolic_shape` dims:
    every op call runs its XLA reference there, and the saved artifact runs, checked, at
    sizes it never saw, matching `jax.jit` of the same function."""
    b, t = jax.export.symbolic_shape("b, t")

    def block(x, scale, labels):
        h = tk.layer_norm(x, scale, None)
        q = h.reshape(*h.shape[:2], 2, 8)
        a = tk.dot_product_attention(q, q, q, is_causal=True).reshape(h.shape)
        logits = jnp.einsum("btd,dv->btv", a, scale[:, None] * jnp.ones((16, 32)))
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
        return jnp.mean(lse - picked)

    grad = jax.grad(block, argnums=(0, 1))
    specs = (jax.ShapeDtypeStruct((b, t, 16), jnp.float32),
             jax.ShapeDtypeStruct((16,), jnp.float32), jax.ShapeDtypeStruct((b, t), jnp.int32))
    artifact = tk.export(grad, *specs, name="symbolic")
    assert artifact.manifest["in_specs"] == ["f32[b,t,16]", "f32[16]", "s32[b,t]"]
    assert {row["source"] for row in artifact.manifest["ops"]} == {
        "symbolic shapes: the XLA reference"}
    loaded = tk.load_artifact(artifact.save(tmp_path / "symbolic"))
    for batch, seq in ((2, 5), (3, 12)):
        x = random_normal(batch + seq, (batch, seq, 16))
        scale = 1 + random_normal(7, (16,))
        labels = jax.random.randint(jax.random.key(seq), (batch, seq), 0, 32)
        with reference_precision():
            want = jax.jit(grad)(x, scale, labels)
        for got, expected in zip(loaded(x, scale, labels), want, strict=True):
            assert_close(got, expected)


def test_a_symbolic_moe_gradient_exports_for_the_h200_and_runs_here(tmp_path):
    """Exported for cpu and cuda (H200) with a symbolic row count (8 rows a token), the
    grouped GLU and the ragged dot's gradient run their XLA references on both platforms:
    a kernel check comparing the rows with its tile (`8*b < 64`, inconclusive) rules the
    kernel out, and the ragged dot's VJP op holding the Triton kernel is no XLA
    reference. The artifact matches `jax.jit` here at two row counts."""
    (b,) = jax.export.symbolic_shape("b")

    def moe(x, w_in, w_out, sizes):
        h = tk.gated_linear_unit(x, w_in, activation=jax.nn.silu, group_sizes=sizes)
        return jnp.sum(jnp.sin(tk.ragged_dot(h, w_out, sizes).astype(jnp.float32)))

    grad = jax.grad(moe, argnums=(0, 1, 2))
    specs = (jax.ShapeDtypeStruct((8 * b, 64), jnp.bfloat16),
             jax.ShapeDtypeStruct((4, 64, 2, 128), jnp.bfloat16),
             jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16),
             jax.ShapeDtypeStruct((4,), jnp.int32))
    artifact = tk.export(grad, *specs, platforms=("cpu", "cuda"), device_kind=H200)
    assert {(row["platform"], row["source"]) for row in artifact.manifest["ops"]} == {
        (platform, "symbolic shapes: the XLA reference") for platform in ("cpu", "cuda")}
    loaded = tk.load_artifact(artifact.save(tmp_path / "moe"))
    w_in = (0.1 * random_normal(1, (4, 64, 2, 128))).astype(jnp.bfloat16)
    w_out = (0.1 * random_normal(2, (4, 128, 64))).astype(jnp.bfloat16)
    for rows, sizes in ((24, [8, 0, 10, 6]), (40, [3, 17, 0, 20])):
        x = random_normal(rows, (rows, 64)).astype(jnp.bfloat16)
        group_sizes = jnp.array(sizes, jnp.int32)
        want = jax.jit(grad)(x, w_in, w_out, group_sizes)
        for got, expected in zip(loaded(x, w_in, w_out, group_sizes), want, strict=True):
            assert_close(got, expected)


def test_a_spec_placed_over_this_machines_devices_is_refused_for_another_platform():
    """A `NamedSharding` over this CPU machine's mesh, in an export for cuda: a
    `ValueError` naming the argument and the abstract mesh to use instead, before the
    trace (where JAX's mismatch of meshes names neither). For cpu alone it exports."""
    mesh = jax.make_mesh((1,), ("data",))
    spec = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16,
                                sharding=jax.sharding.NamedSharding(mesh, jax.P("data")))

    def loss(q):
        return tk.dot_product_attention(q, q, q).astype(jnp.float32).sum()

    with pytest.raises(ValueError, match=r"argument 0 is placed over a mesh of cpu devices, "
                                         r"but the artifact is also for \['cuda'\].*AbstractMesh"):
        tk.export(loss, spec, platforms=("cpu", "cuda"), device_kind=H200)
    assert tk.export(loss, spec).manifest["platforms"] == ["cpu"]
