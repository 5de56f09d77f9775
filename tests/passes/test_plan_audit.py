"""`implementation=None` at model sizes nobody benchmarked: the plan audit, a slice of it.

Each model is planned for the H200 from this CPU machine at grid points that no cache
entry was measured at; every kernel chosen must be justified by a measurement at that
shape or at a neighbour the lookup may borrow from (`benchmarks.models.plan_audit`).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict

import pytest

from benchmarks.models import MODELS, plan_audit
from benchmarks.models.plan_audit import Shape
from tokamax_pass.autotuning import keys, neighbours

# Unseen: head dims 64/80/96/256, GQA groups 1 to 8, sequence 1024/3000, batch 1/2. At
# these a lookup that borrowed any measured shape would run kernels (checked below).
SLICE = (Shape(4096, 64, 8, 1024, 1), Shape(3072, 80, 1, 1024, 1),
         Shape(3072, 128, 8, 3000, 2), Shape(3072, 128, 4, 1024, 2),
         Shape(1024, 256, 4, 3000, 2))


# The same kind of points in float16 and float32, which no cache entry was measured in:
# every kernel the bf16 measurements near them justify must stay off.
DTYPE_SLICE = (Shape(4096, 64, 8, 1024, 1, "float16"), Shape(1024, 256, 4, 3000, 2, "float16"),
               Shape(3072, 128, 4, 1024, 2, "float32"))


# The broken lookups below need only be flagged somewhere: a dense decoder (attention,
# norms, the LM head) with an MoE model (ragged dots, GLUs) flag them at every dtype and at
# most points, and plan in a third of the time of every model.
BROKEN_SLICE_MODELS = {"distance": ["llama", "moe_decode"], "dtype": ["llama", "mixtral"]}


def _rows(shapes: tuple[Shape, ...] = SLICE, names: list[str] | None = None) -> list[dict]:
    return list(plan_audit.audit(list(MODELS) if names is None else names, shapes))


def test_every_kernel_chosen_at_unseen_sizes_was_measured_there_or_near():
    rows = _rows()
    flagged = [r for r in rows if r["flagged"]]
    assert not flagged, flagged[:3]
    kinds = {r["evidence"]["kind"] for r in rows}
    # Not vacuous: kernels run here, on measurements at neighbouring shapes.
    assert {"plain path", "neighbour", "far neighbour"} <= kinds, kinds
    assert {(r["model"], tuple(r["overrides"])) for r in rows} == {
        (name, tuple(s.overrides(MODELS[name]))) for name in MODELS for s in SLICE}


def test_a_cpu_export_runs_kernels_only_on_measurements():
    """Planned as `tokamax-pass export` plans on this CPU machine (cuDNN cannot be lowered
    here): every kernel chosen is justified, by beating the plain paths this machine can
    lower or by beating cuDNN's measurement on the target, which XLA's yields to, or by
    standing in for cuDNN where the target runs it (the export's fallback)."""
    rows = list(plan_audit.audit(list(MODELS), SLICE, cudnn=False))
    flagged = [r for r in rows if r["flagged"]]
    assert not flagged, flagged[:3]
    assert not any(r["implementation"] == "cudnn" for r in rows)
    assert any(r["evidence"]["kind"] != "plain path" for r in rows
               if "attention" in r["path"])


def test_the_audit_flags_a_lookup_that_borrows_from_any_distance(monkeypatch):
    """Selection broken on purpose: a neighbour at any distance lends its timings."""
    distance = neighbours.distance
    monkeypatch.setattr(neighbours, "distance",
                        lambda a, b, max_ratio=neighbours.MAX_RATIO: distance(a, b, math.inf))
    assert any(r["flagged"] for r in _rows(names=BROKEN_SLICE_MODELS["distance"]))


def test_unseen_tiny_sizes_match_plain_jax():
    """Ours against plain JAX on this machine at a tiny size the smoke check does not hold
    (odd sequence length and head dim, GQA group 3, batch 1): the dense decoder and the
    encoder in bfloat16 here, the MoE and Gemma-2 models in float16 and float32 below."""
    assert plan_audit.smoke_unseen(["llama", "encoder"], plan_audit.SMOKE_SIZES[:1]) == []


@pytest.mark.slow  # the same audit in the models' own dtype above covers the path
def test_float16_and_float32_calls_run_kernels_only_on_measurements_in_their_dtype():
    rows = _rows(DTYPE_SLICE)
    flagged = [r for r in rows if r["flagged"]]
    assert not flagged, flagged[:3]
    assert {r["dtype"] for r in rows} == {"float16", "float32"}
    assert all(f"dtype={r['dtype']}" in r["overrides"] for r in rows)
    # cuDNN's attention runs for float16 (plain JAX's path on the H200), never for float32.
    cudnn = {r["dtype"] for r in rows if r["implementation"] == "cudnn"}
    assert cudnn == {"float16"}, cudnn


def test_the_audit_flags_a_lookup_that_lends_measurements_across_dtypes(monkeypatch):
    """Selection broken on purpose: the similarity category ignores dtypes, so the bf16
    measurements near a float16 or float32 call lend it their kernels."""
    similarity = keys.similarity

    def dtype_blind(ba):
        category, sizes = similarity(ba)
        return re.sub(r"(bfloat16|float16|float32)\[", "any[", category), sizes

    monkeypatch.setattr(keys, "similarity", dtype_blind)
    monkeypatch.setattr(neighbours, "_INDEXES", OrderedDict())  # built by the unbroken rule
    monkeypatch.setattr(plan_audit, "_MEASURED", {})
    flagged = [r for r in _rows(DTYPE_SLICE, BROKEN_SLICE_MODELS["dtype"]) if r["flagged"]]
    assert {r["dtype"] for r in flagged} == {"float16", "float32"}, flagged[:3]


@pytest.mark.slow
def test_unseen_tiny_sizes_match_plain_jax_in_float16_and_float32():
    """The MoE decoder in float16 and Gemma-2's soft-capped, windowed attention in float32,
    at an unseen tiny size, against plain JAX within the dtype's tolerance."""
    sizes = plan_audit.SMOKE_SIZES[:1]
    assert plan_audit.smoke_unseen(["mixtral"], sizes, ["float16"]) == []
    assert plan_audit.smoke_unseen(["gemma2"], sizes, ["float32"]) == []
