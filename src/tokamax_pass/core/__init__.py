"""The op framework: ops, bound arguments, the `tokamax_call` primitive, the registry."""

from tokamax_pass.core.bound_arguments import BoundArguments, NullConfig
from tokamax_pass.core.device import Target, current_target, targeting
from tokamax_pass.core.op import CannotLowerHere, Op, SizeLike, snake_case_name
from tokamax_pass.core.primitive import METADATA_KEY, tokamax_call_p
from tokamax_pass.core.registry import Family, register_family
from tokamax_pass.core.roofline import Work
from tokamax_pass.core.selection import register_config_source
from tokamax_pass.core.vjp import AutodiffVjp, VjpOp

__all__ = [
    "METADATA_KEY",
    "AutodiffVjp",
    "BoundArguments",
    "CannotLowerHere",
    "Family",
    "NullConfig",
    "Op",
    "SizeLike",
    "Target",
    "VjpOp",
    "Work",
    "current_target",
    "register_config_source",
    "register_family",
    "snake_case_name",
    "targeting",
    "tokamax_call_p",
]
