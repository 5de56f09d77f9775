"""Recovers every op call of a profiled program from its `.xplane.pb` profile.

    python -m tokamax_pass.tools.xplane_to_bound_args \\
        --xplane_file=my_model.xplane.pb --output_file=/tmp/bound_args.json

Where the ops survive: `jax.profiler.trace` records the HLO of the programs the
process has loaded (on CPU also those compiled before the trace) in the
`/host:metadata` plane, as `HloProto` bytes in the plane's event metadata.
Compiled HLO keeps each instruction's frontend attributes, so every instruction
of an op call carries the map entry `tokamax_pass_spec -> <BoundArguments JSON>`.
`jax.profiler.ProfileData` (no TensorFlow) opens and checks the XSpace but does
not expose event metadata, so the spec strings are read from the protobuf wire
form of that map entry (field 1 = the key, field 2 = the JSON) anywhere in the
file. The list holds every op of those programs, whether or not it ran in the trace.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

import jax

from tokamax_pass.autotuning import discovery
from tokamax_pass.core import spec
from tokamax_pass.core.bound_arguments import BoundArguments
from tokamax_pass.core.caller_warnings import warn_at_caller
from tokamax_pass.core.primitive import METADATA_KEY

_KEY = METADATA_KEY.encode()
# A protobuf map entry: field 1 (length-delimited) = the key, then field 2 = the value.
_ENTRY_PREFIX = b"\x0a" + bytes([len(_KEY)]) + _KEY + b"\x12"


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    """The varint at `pos` and the position after it; `None` where the data ends in it."""
    value, shift = 0, 0
    while pos < len(data):
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def specs_from_xspace(data: bytes, *, what: str = "the profile") -> list[str]:
    """The distinct spec JSON strings in a serialized XSpace, in file order.

    An entry that cannot be read (its length runs past the end of the data, or its value
    is not UTF-8 text) is skipped with a warning naming `what`, and the others are read."""
    specs: dict[str, None] = {}
    start = data.find(_ENTRY_PREFIX)
    while start != -1:
        found = _varint(data, start + len(_ENTRY_PREFIX))
        try:
            if found is None or found[1] + found[0] > len(data):
                raise ValueError("its length runs past the end of the file")
            end = found[1] + found[0]
            specs.setdefault(data[found[1]:end].decode("utf-8"))
        except ValueError as e:  # `UnicodeDecodeError` too
            warn_at_caller(f"{what}: skipped a {METADATA_KEY} entry at byte {start} that "
                           f"cannot be read: {e}")
            end = start + 1
        start = data.find(_ENTRY_PREFIX, end)
    return list(specs)


def bound_args_from_xplane(path: str | pathlib.Path) -> list[BoundArguments]:
    """Every distinct op call (config stripped) recorded in an `.xplane.pb` file.

    A profile holds every program the process had loaded; a call whose op cannot be
    loaded here (a class defined inside a function) is skipped with a warning. A file that
    is not a profile, or is larger than this machine's memory, is a `spec.SpecError`
    naming it."""
    data = spec.read_binary_file(path, what=str(path))
    try:
        jax.profiler.ProfileData.from_serialized_xspace(data)
    except Exception as e:  # noqa: BLE001 - any parse failure means "not a profile"
        raise spec.SpecError(f"{path} is not an XSpace profile (.xplane.pb): {e}") from None
    bound = []
    for encoded in specs_from_xspace(data, what=str(path)):
        try:
            bound.append(BoundArguments.from_json(encoded))
        except spec.SpecError as e:  # one unloadable op (a local class) spoils nothing else
            warn_at_caller(f"{path}: skipped an op call that cannot be loaded here: {e}")
    return discovery.dedupe(bound)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--xplane_file", "--xplane-file", required=True,
                        help="an .xplane.pb written by jax.profiler.trace")
    parser.add_argument("--output_file", "--output-file", required=True,
                        help="where to write the JSON list of bound arguments")


def convert(xplane_file: str, output_file: str) -> int:
    bound = bound_args_from_xplane(xplane_file)
    discovery.bound_args_to_json(bound, output_file)
    print(f"wrote {len(bound)} op calls to {output_file}")
    if not bound:
        print("no tokamax_pass ops found: was the program compiled while profiling?",
              file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return convert(args.xplane_file, args.output_file)


if __name__ == "__main__":
    sys.exit(main())
