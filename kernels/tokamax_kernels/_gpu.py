"""What the GPU kernels of every family share about the device: its SM count, which
persistent kernels size their grids by, and the shared memory one program may use."""

from __future__ import annotations

import jax

from tokamax_pass.core import current_target

# Streaming multiprocessors per device kind: grids are sized to fill them.
_SM_COUNTS = {"H200": 132, "H100": 132, "H800": 132, "H20": 78, "A100": 108, "L40": 142}
# The H200 (and H100 SXM) have 132 SMs; used when nothing else says.
DEFAULT_SM_COUNT = 132
# Shared memory one thread block may use, in bytes (CUDA's opt-in maximum per block):
# 227 KiB on Hopper, 163 KiB on the A100 and A800 (compute capability 8.0), 99 KiB on
# the other Ampere and Ada GPUs (A10, A40, L4, L40, RTX cards).
HOPPER_SHARED_MEMORY = 232448
_SHARED_MEMORY = {"A100": 166912, "A800": 166912}
OTHER_SHARED_MEMORY = 101376


def _by_kind(table: dict[str, int], kind: str) -> int | None:
    """`table`'s value for the longest key `kind` contains ("NVIDIA H20" is not an H200)."""
    found = [key for key in table if key in kind]
    return table[max(found, key=len)] if found else None


def sm_count() -> int:
    """SMs of the GPU the program is built for: the abstract mesh's device's core count
    where it names one, else its device kind's (so an exported program for a named kind
    gets that kind's grid), else the local GPU's, else an H200's."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    if device is not None and getattr(device, "num_cores", None):
        return int(device.num_cores)
    kind = current_target().device_kind or ""
    known = _by_kind(_SM_COUNTS, kind)
    if known is not None:
        return known
    try:
        return int(jax.devices("cuda")[0].core_count)
    except (RuntimeError, AttributeError, TypeError):
        return DEFAULT_SM_COUNT


def shared_memory_per_block() -> int:
    """Bytes of shared memory one program may use on the GPU the program is built for: a
    Hopper GPU's (an H200's where no GPU is named: a program built on a CPU machine
    without a target, as `ba.heuristics_config` asked there); an A100's or A800's; else
    what the other Ampere and Ada GPUs have."""
    target = current_target()
    if target.platform != "cuda" or target.is_hopper or not target.device_kind:
        return HOPPER_SHARED_MEMORY
    known = _by_kind(_SHARED_MEMORY, target.device_kind)
    return OTHER_SHARED_MEMORY if known is None else known
