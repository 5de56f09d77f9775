"""`PallasMosaicGpuGatedLinearUnitVjp`: the grouped GLU gradient with Mosaic GPU ragged dots.

`dgate` and `dup` come from the forward's residuals in one XLA elementwise fusion; then
`dx` (a dlhs against the (G, K, 2N) view of fused weights, or one per weight of a pair)
and the weights' gradients (drhs) run as `PallasMosaicGpuRaggedDot` calls, each tuned and
cached as its own ragged-dot shape. Under `implementation=None` this op competes with
`GatedLinearUnitVjp` (XLA ragged dots) on the measurements of those ragged dots.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from tokamax_kernels.gated_linear_unit.base import GatedLinearUnitVjp
from tokamax_kernels.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot
from tokamax_pass.core import BoundArguments, Op, Target


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicGpuGatedLinearUnitVjp(GatedLinearUnitVjp):
    """The grouped GLU gradient: XLA `dgate`/`dup`, Mosaic GPU ragged dots (Hopper)."""

    implementation: ClassVar[str] = "mosaic"
    platforms: ClassVar[frozenset[str] | None] = frozenset({"cuda"})

    def reference_op(self) -> Op:
        return GatedLinearUnitVjp()

    def ragged_dot_op(self) -> Op:
        return PallasMosaicGpuRaggedDot()

    def check_supported(self, ba: BoundArguments, target: Target | None) -> None:
        if "group_sizes" not in ba.arguments:
            raise NotImplementedError(
                "the Mosaic GPU GLU gradient runs grouped calls (group_sizes) only")
        super().check_supported(ba, target)
