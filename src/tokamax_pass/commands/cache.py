"""`tokamax-pass cache list|show|clear|import FILE`: the user autotuning cache."""

from __future__ import annotations

import argparse

from tokamax_pass.commands import _argtypes


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cache", help="inspect or edit the user autotuning cache")
    parser.add_argument("--cache-dir", type=_argtypes.non_empty,
                        help="default: $TOKAMAX_PASS_CACHE_DIR, else the platform's user "
                             "cache directory (~/.cache/tokamax_pass on Linux)")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the cache files, their device kinds and entry counts")
    show = actions.add_parser("show", help="the entries of one device kind as a table")
    show.add_argument("--device-kind", type=_argtypes.non_empty,
                      help="default: the default device's kind")
    clear = actions.add_parser("clear", help="delete cache files")
    clear.add_argument("--device-kind", type=_argtypes.non_empty,
                       help="only this device kind (default: all)")
    imp = actions.add_parser("import", help="merge an AutotuningResult JSON into the cache")
    imp.add_argument("file", type=_argtypes.non_empty)


def run(args: argparse.Namespace) -> int:
    from tokamax_pass.autotuning import cache
    from tokamax_pass.autotuning.result import AutotuningResult
    from tokamax_pass.core import spec

    folder = cache.cache_dir(args.cache_dir)
    if folder.exists() and not folder.is_dir():
        raise SystemExit(f"cache: the cache directory {folder} (--cache-dir or "
                         f"${cache.ENV_CACHE_DIR}) is a file, not a directory")
    if args.action == "list":
        files = sorted(folder.glob("*.json")) if folder.is_dir() else []
        print(f"cache directory: {folder}")
        for path in files:
            try:
                result = cache.read(path, kind_key=path.stem)
                if result is not None:  # None: removed since it was listed
                    print(f"  {path.name}: {result.device_kind!r}, {len(result)} entries")
            except spec.SpecError as e:
                print(f"  {path.name}: unreadable ({e}); `tokamax-pass cache clear` "
                      f"removes it (--device-kind: only one kind's file)")
        if not files:
            print("  (empty)")
        return 0
    if args.action == "show":
        from tokamax_pass.core.device import check_device_kind, current_target

        kind = args.device_kind or current_target().device_kind
        path = cache.cache_file(kind, args.cache_dir)
        try:
            result = cache.read(path, kind_key=path.stem)
        except spec.SpecError as e:
            raise SystemExit(f"cache: {e}; `tokamax-pass cache clear --device-kind "
                             f"'{kind}'` removes it") from None
        if result is None and args.device_kind:
            check_device_kind(args.device_kind, typed=True)  # "H200" found no file, silently
        print(f"{path}: no cache file" if result is None else result)
        return 0
    if args.action == "clear":
        removed = cache.clear(args.cache_dir, args.device_kind)
        print("\n".join(f"removed {p}" for p in removed) or "nothing to remove")
        return 0
    result = AutotuningResult.load(args.file)
    print(f"merged {len(result)} entries into {cache.save(result, args.cache_dir)}")
    return 0
