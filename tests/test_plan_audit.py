"""`implementation=None` at model sizes nobody benchmarked: the plan audit, a slice of it.

Each model is planned for the H200 from this CPU machine at grid points that no cache
entry was measured at; every kernel chosen must be justified by a measurement at that
shape or at a neighbour the lookup may borrow from (`benchmarks.models.plan_audit`).
"""

from __future__ import annotations

import math

from benchmarks.models import MODELS, plan_audit
from benchmarks.models.plan_audit import Shape
from tokamax_pass.autotuning import neighbours

# Unseen: head dims 64/80/96/256, GQA groups 1 to 8, sequence 1024/3000, batch 1/2. At
# these a lookup that borrowed any measured shape would run kernels (checked below).
SLICE = (Shape(4096, 64, 8, 1024, 1), Shape(3072, 80, 1, 1024, 1),
         Shape(3072, 128, 8, 3000, 2), Shape(3072, 128, 4, 1024, 2),
         Shape(1024, 256, 4, 3000, 2))


def _rows() -> list[dict]:
    return list(plan_audit.audit(list(MODELS), SLICE))


def test_every_kernel_chosen_at_unseen_sizes_was_measured_there_or_near():
    rows = _rows()
    flagged = [r for r in rows if r["flagged"]]
    assert not flagged, flagged[:3]
    kinds = {r["evidence"]["kind"] for r in rows}
    # Not vacuous: kernels run here, on measurements at neighbouring shapes.
    assert {"plain path", "neighbour", "far neighbour"} <= kinds, kinds
    assert {(r["model"], tuple(r["overrides"])) for r in rows} == {
        (name, tuple(s.overrides(MODELS[name]))) for name in MODELS for s in SLICE}


def test_the_audit_flags_a_lookup_that_borrows_from_any_distance(monkeypatch):
    """Selection broken on purpose: a neighbour at any distance lends its timings."""
    distance = neighbours.distance
    monkeypatch.setattr(neighbours, "distance",
                        lambda a, b, max_ratio=neighbours.MAX_RATIO: distance(a, b, math.inf))
    assert any(r["flagged"] for r in _rows())


def test_unseen_tiny_sizes_match_plain_jax():
    """Ours against plain JAX on this machine at a tiny size the smoke check does not hold
    (odd sequence length and head dim, GQA group 3, batch 1)."""
    assert plan_audit.smoke_unseen(list(MODELS), plan_audit.SMOKE_SIZES[:1]) == []
