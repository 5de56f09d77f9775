"""The `jax.export` safety checks our programs must skip, in one place that the pass, the
artifact export and the autotuner's export workers all import."""

from __future__ import annotations

from jax.export import DisabledSafetyCheck

# Custom calls whose targets jax.export does not consider stable: the Triton
# kernels (Triton IR has no compatibility guarantee) and cuDNN attention.
_UNSTABLE_TARGETS = (
    "__gpu$xla.gpu.triton",
    "__cudnn$fmhaSoftmax",
    "__cudnn$fmhaScaleBiasSoftmax",
    "__cudnn$fmhaSoftmaxBackward",
    "__cudnn$fmhaScaleBiasSoftmaxBackward",
)

DISABLE_JAX_EXPORT_CHECKS: tuple[DisabledSafetyCheck, ...] = tuple(
    DisabledSafetyCheck.custom_call(target) for target in _UNSTABLE_TARGETS
)
