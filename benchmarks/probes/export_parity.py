"""Checks a CPU-exported attention-gradient artifact against the same program exported on the GPU.

    python -m benchmarks.probes.export_parity make DIR [--axes explicit|auto]   # CPU machine
    python -m benchmarks.probes.export_parity check DIR                         # the H200

`make` exports `jax.grad` of attention at b4 s8192 h16 d128 bf16 for the H200 from this
machine, under an abstract mesh that carries the device (Explicit axes by default), into
DIR/cpu_export. `check` exports the same program on the GPU it runs on, runs both on the
same random inputs, checks their gradients agree (bf16 tolerance), times both (CUPTI,
median after a warm-up), prints the ratio and writes the report to `$OUT/export_parity.json`
(`$OUT` or the working directory); it exits 1 when the CPU export is more
than 10% slower or the outputs differ.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import warnings
from typing import Any

import jax
import jax.numpy as jnp

import tokamax_pass as tokamax
from tokamax_pass import benchmarking
from tokamax_pass.export import ExportFallbackWarning

SHAPE = (4, 8192, 16, 128)
DTYPE = jnp.bfloat16
DEVICE_KIND = "NVIDIA H200"
CPU_EXPORT = "cpu_export"
MAX_SLOWDOWN = 1.10
# The largest difference between the two programs' gradients, relative to the largest
# gradient: both are bf16 results of float32 accumulation, by different kernels.
TOLERANCE = 2e-2


def loss(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
    return jnp.sum(tokamax.dot_product_attention(query, key, value).astype(jnp.float32))


def gradient() -> Any:
    return jax.grad(loss, argnums=(0, 1, 2))


def _specs() -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(SHAPE, DTYPE)] * 3


def make(directory: pathlib.Path, axes: str) -> int:
    """Exports the gradient for the H200 from this machine into `directory / CPU_EXPORT`."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[axes]
    mesh = AbstractMesh((1,), ("x",), axis_types=(axis_type,),
                        abstract_device=AbstractDevice(DEVICE_KIND, None, "cuda"))
    with jax.sharding.use_abstract_mesh(mesh), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportFallbackWarning)
        artifact = tokamax.export(gradient(), *_specs(), platforms=["cuda"],
                                  name="attention_grad")
    for warning in caught:
        print(f"warning: {warning.message}")
    path = artifact.save(directory / CPU_EXPORT)
    print(f"{path}: custom calls {artifact.manifest['custom_calls']}, ops "
          + ", ".join(f"{r['path']}={r['implementation']}" for r in artifact.manifest["ops"]))
    return 0


def _time(fn: Any, args: list[jax.Array]) -> float:
    run = benchmarking.compile_benchmark(lambda a: fn(*a), args)
    return run(args, method="cupti", iterations=20).median_evaluation_time_ms


def check(directory: pathlib.Path) -> int:
    """Runs and times the CPU export against the same program exported here."""
    cpu = tokamax.load_artifact(directory / CPU_EXPORT)
    here = tokamax.load_artifact(tokamax.export(gradient(), *_specs(), name="attention_grad"))
    args = benchmarking.random_initialize(_specs(), seed=0)
    got, want = cpu(*args), here(*args)
    scale = max(float(jnp.max(jnp.abs(w.astype(jnp.float32)))) for w in want)
    error = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
                for g, w in zip(got, want, strict=True))
    cpu_ms, here_ms = _time(cpu, args), _time(here, args)
    ratio = cpu_ms / here_ms
    report = {
        "device": jax.devices()[0].device_kind, "shape": list(SHAPE),
        "cpu_export_ms": cpu_ms, "device_export_ms": here_ms, "ratio": ratio,
        "max_abs_error": error, "relative_error": error / scale,
        "cpu_export_ops": [f"{r['path']}={r['implementation']}" for r in cpu.manifest["ops"]],
        "device_export_ops": [f"{r['path']}={r['implementation']}"
                              for r in here.manifest["ops"]],
    }
    text = json.dumps(report, indent=1)
    print(text)
    out = pathlib.Path(os.environ.get("OUT", ".")) / "export_parity.json"
    out.write_text(text + "\n")
    agree = error <= TOLERANCE * scale
    fast = ratio <= MAX_SLOWDOWN
    print(f"outputs agree: {agree}; CPU export / device export = {ratio:.3f} "
          f"({'within' if fast else 'past'} {MAX_SLOWDOWN - 1:.0%})")
    return 0 if agree and fast else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.export_parity",
                                     description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make_parser = commands.add_parser("make", help="export from this (CPU) machine")
    make_parser.add_argument("directory", type=pathlib.Path)
    make_parser.add_argument("--axes", choices=("explicit", "auto"), default="explicit")
    check_parser = commands.add_parser("check", help="compare and time on the GPU")
    check_parser.add_argument("directory", type=pathlib.Path)
    args = parser.parse_args(argv)
    if args.command == "make":
        return make(args.directory, args.axes)
    return check(args.directory)


if __name__ == "__main__":
    sys.exit(main())
