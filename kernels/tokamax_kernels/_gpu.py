"""What the GPU kernels of every family share about the device: its SM count, which
persistent kernels size their grids by, and the shared memory one program may use."""

from __future__ import annotations

import jax

from tokamax_pass.core import current_target

# Streaming multiprocessors per device kind: grids are sized to fill them.
_SM_COUNTS = {"H200": 132, "H100": 132, "H800": 132, "H20": 78, "A100": 108, "L40": 142}
# The H200 (and H100 SXM) have 132 SMs; used when nothing else says.
DEFAULT_SM_COUNT = 132
# Shared memory one thread block may use, in bytes, per device kind (CUDA's opt-in
# maximum per block: 227 KiB on Hopper, 163 KiB on the A100, 99 KiB on Ada).
_SHARED_MEMORY = {"H200": 232448, "H100": 232448, "H800": 232448, "H20": 232448,
                  "A100": 166912, "L40": 101376, "L4": 101376}
DEFAULT_SHARED_MEMORY = 232448


def sm_count() -> int:
    """SMs of the GPU the program is built for: the abstract mesh's device's core count
    where it names one, else its device kind's (so an exported program for a named kind
    gets that kind's grid), else the local GPU's, else an H200's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and getattr(device, "num_cores", None):
        return int(device.num_cores)
    kind = current_target().device_kind or ""
    known = next((n for key, n in _SM_COUNTS.items() if key in kind), None)
    if known is not None:
        return known
    try:
        return int(jax.devices("cuda")[0].core_count)
    except (RuntimeError, AttributeError, TypeError):
        return DEFAULT_SM_COUNT


def shared_memory_per_block() -> int:
    """Bytes of shared memory one program may use on the GPU the program is built for
    (its device kind's, else an H200's)."""
    kind = current_target().device_kind or ""
    return next((n for key, n in _SHARED_MEMORY.items() if key in kind), DEFAULT_SHARED_MEMORY)
