"""What the GPU kernels of every family share about the device: its SM count, which
persistent kernels size their grids by.

Two readings, each kept for the kernels sized by it: `sm_count` from the target's device
kind (a table; what the attention and layer-norm kernels use, and what an exported
program for a named device kind gets), `num_sms` from the device itself (the abstract
target's core count, else the local GPU's; what the ragged-dot, GLU and LM-head kernels
use).
"""

from __future__ import annotations

import jax

from tokamax_pass.core import current_target

# Streaming multiprocessors per device kind: grids are sized to fill them.
_SM_COUNTS = {"H200": 132, "H100": 132, "H800": 132, "H20": 78, "A100": 108, "L40": 142}
DEFAULT_SM_COUNT = 132
# The H200 (and H100 SXM) have 132 SMs; used when no device can be asked.
DEFAULT_NUM_SMS = 132


def sm_count() -> int:
    """SMs of the device the program is built for (from its kind; H200 when unknown)."""
    kind = current_target().device_kind or ""
    return next((n for key, n in _SM_COUNTS.items() if key in kind), DEFAULT_SM_COUNT)


def num_sms() -> int:
    """SMs of the GPU being compiled for (the local one, else the abstract target)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and getattr(device, "num_cores", None):
        return int(device.num_cores)
    try:
        return int(jax.devices("cuda")[0].core_count)
    except (RuntimeError, AttributeError, TypeError):
        return DEFAULT_NUM_SMS
