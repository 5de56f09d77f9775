"""Seeded random damage to every file the library reads, and interrupted or concurrent
writes of every file it writes.

Each loader in `LOADERS` starts from a file the library wrote itself and reads
`MUTATIONS` damaged copies of it: cut at a random offset, random bytes flipped, or (for
JSON) one random value replaced with a poison (a number as a string, a list as an object,
null, 10**400, NaN, a list nested 100000 deep, a long string, a lone surrogate, bytes that
are not UTF-8, a key given twice, a key added or left out, a negative or zero size). Each
read must give a valid result or the loader's documented error naming the file; a loader
that reports by warning must warn whenever it drops what the file held.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import json
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import threading
import warnings
from collections.abc import Callable
from typing import Any

import jax
import pytest

import tokamax_pass as tk
from conftest import random_normal
from tokamax_pass import cli
from tokamax_pass.artifact import ArtifactMismatchError
from tokamax_pass.autotuning import bound_args_from_json, bound_args_to_json, cache
from tokamax_pass.autotuning.result import AutotuningResult
from tokamax_pass.core import calibration
from tokamax_pass.core.primitive import METADATA_KEY
from tokamax_pass.core.spec import SpecError
from tokamax_pass.passes.inspection import Inspection
from tokamax_pass.tools import xplane_to_bound_args

SEED = 0
MUTATIONS = 40
DEVICE_KIND = "NVIDIA H200"
SHIPPED = pathlib.Path(tk.__file__).parent / "data"
LAYER_NORM_CACHE = SHIPPED / "autotuning" / "nvidia_h200" / "pallas_triton_layer_norm.json"
X = random_normal(0, (2, 8, 32))
SCALE = random_normal(1, (32,))


# --- mutations ------------------------------------------------------------------------

# Where the poison goes in the re-serialized document (no real value holds NULs).
_SLOT = "\x00poison\x00"


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """The path of every value in a JSON document, the document's own `()` first."""
    found = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _nodes(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _nodes(item, (*path, i))
    return found


def _replaced(document: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    copy = dict(document) if isinstance(document, dict) else list(document)
    copy[path[0]] = _replaced(document[path[0]], path[1:], new)
    return copy


def _at(document: Any, path: tuple) -> Any:
    for key in path:
        document = document[key]
    return document


def _object_with_a_key_twice(value: Any, rng: random.Random) -> bytes:
    pairs = list(value.items()) if isinstance(value, dict) and value else [("a", 1)]
    key, item = rng.choice(pairs)
    text = json.dumps(dict(pairs))
    return (text[:-1] + f", {json.dumps(key)}: {json.dumps(item)}}}").encode()


def _with_a_key_more(value: Any, rng: random.Random) -> bytes:
    return json.dumps({**(value if isinstance(value, dict) else {}), "unexpected": 1}).encode()


def _with_a_key_less(value: Any, rng: random.Random) -> bytes:
    if not isinstance(value, dict) or not value:
        return b"{}"
    gone = rng.choice(sorted(value))
    return json.dumps({k: v for k, v in value.items() if k != gone}).encode()


def _swapped_container(value: Any, rng: random.Random) -> bytes:
    if isinstance(value, dict):
        return json.dumps(list(value.values())).encode()
    if isinstance(value, list):
        return json.dumps({str(i): v for i, v in enumerate(value)}).encode()
    return json.dumps([value]).encode()


# Each poison: the raw JSON text that replaces a value (given the value and the rng).
POISONS: dict[str, Callable[[Any, random.Random], bytes]] = {
    "string <-> other": lambda v, rng: b"7" if isinstance(v, str) else json.dumps(str(v)).encode(),
    "list <-> object": _swapped_container,
    "null": lambda v, rng: b"null",
    "true": lambda v, rng: b"true",
    "10**400": lambda v, rng: str(10**400).encode(),
    "-10**400": lambda v, rng: str(-10**400).encode(),
    "NaN": lambda v, rng: b"NaN",
    "Infinity": lambda v, rng: b"Infinity",
    "-Infinity": lambda v, rng: b"-Infinity",
    "1e999": lambda v, rng: b"1e999",
    "negative": lambda v, rng: b"-1",
    "zero": lambda v, rng: b"0",
    "fraction": lambda v, rng: b"2.5",
    "nested 100000 deep": lambda v, rng: b"[" * 100_000 + b"]" * 100_000,
    "long string": lambda v, rng: b'"' + b"x" * 100_000 + b'"',
    "5000 digits": lambda v, rng: b'"' + b"9" * 5000 + b'"',
    "lone surrogate": lambda v, rng: b'"\\ud800x"',
    "not UTF-8": lambda v, rng: b'"\xff\xfe\xed\xa0\x80"',
    "a key twice": _object_with_a_key_twice,
    "a key more": _with_a_key_more,
    "a key less": _with_a_key_less,
}


def _poisoned(data: bytes, rng: random.Random, poison: str, focus: tuple
              ) -> tuple[bytes, str]:
    document = json.loads(data)
    path = rng.choice([path for path in _nodes(document) if path[:len(focus)] == focus])
    raw = POISONS[poison](_at(document, path), rng)
    text = json.dumps(_replaced(document, path, _SLOT), indent=1).encode()
    return text.replace(json.dumps(_SLOT).encode(), raw, 1), f"{poison} at {list(path)}"


def _truncated(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    end = rng.randrange(len(data))
    return data[:end], f"cut at byte {end}"


def _flipped(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    damaged = bytearray(data)
    offsets = [rng.randrange(len(data)) for _ in range(rng.randint(1, 4))]
    for offset in offsets:
        damaged[offset] ^= rng.randrange(1, 256)
    return bytes(damaged), f"bytes flipped at {offsets}"


def mutations(data: bytes, *, is_json: bool, seed: int, focus: tuple = ()
              ) -> list[tuple[bytes, str]]:
    """`MUTATIONS` damaged copies of `data`, each with what was done to it: cut, bytes
    flipped, and (for JSON) each poison in turn at a random value (under `focus`)."""
    rng = random.Random(seed)
    poisons = itertools.cycle(sorted(POISONS))
    found = []
    for i in range(MUTATIONS):
        if is_json and i % 3:
            found.append(_poisoned(data, rng, next(poisons), focus))
        else:
            found.append(rng.choice([_truncated, _flipped])(data, rng))
    return found


# --- the files, as the library writes them ---------------------------------------------

def _small_result() -> AutotuningResult:
    """Two entries of the shipped layer-norm cache, three configs each."""
    shipped = AutotuningResult.load(LAYER_NORM_CACHE)
    entries = [dataclasses.replace(e, data=dict(list(e.data.items())[:3]))
               for e in shipped.entries[:2]]
    return AutotuningResult(shipped.device_kind, entries)


def _profile_of(bound: tk.core.BoundArguments) -> bytes:
    """An XSpace whose only content is the frontend-attribute map entry a profile records
    for `bound` (in an unknown field, which the XSpace parser keeps)."""
    key, value = xplane_to_bound_args._KEY, bound.to_json().encode()
    entry = b"\x0a" + bytes([len(key)]) + key + b"\x12" + _varint(len(value)) + value
    return b"\x7a" + _varint(len(entry)) + entry


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@pytest.fixture(scope="module")
def originals(tmp_path_factory) -> pathlib.Path:
    """Every kind of file the loaders read, written by the library."""
    root = tmp_path_factory.mktemp("originals")
    result = _small_result()
    result.dump(root / "result.json")
    result.save_to_cache(root / "user_cache")
    cache.write_library_cache(result, root / "library_cache")
    bound_args_to_json([e.bound for e in result.entries], root / "bound_args.json")
    norm = jax.jit(lambda x, s: tk.layer_norm(x, s, None))
    (root / "program.mlir").write_text(norm.lower(X, SCALE).as_text())
    (root / "program.hlo").write_text(norm.lower(X, SCALE).compile().as_text())
    artifact = tk.export(lambda x, s: tk.layer_norm(x, s, None), "f32[2,8,32]", "f32[32]",
                         name="prog")
    artifact.save(root / "artifact")
    shutil.copyfile(root / "artifact" / "prog.stablehlo", root / "prog.stablehlo")
    (root / "profile.xplane.pb").write_bytes(_profile_of(result.entries[0].bound))
    (root / "calibration").mkdir()
    shutil.copyfile(SHIPPED / "calibration" / "nvidia_h200.json",
                    root / "calibration" / "nvidia_h200.json")
    return root


# --- the loaders -------------------------------------------------------------------------

def _load_user_cache(path: pathlib.Path) -> Any:
    """What an op call reads: the user cache of `$TOKAMAX_PASS_CACHE_DIR`."""
    os.environ[cache.ENV_CACHE_DIR] = str(path.parent)
    try:
        return cache._UserCache().result(DEVICE_KIND)
    finally:
        del os.environ[cache.ENV_CACHE_DIR]


def _load_library_cache(path: pathlib.Path) -> Any:
    """What an op call reads: the library cache folder of a device kind."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cache, "library_cache_dir", lambda kind: path.parent)
        cache.library_result.cache_clear()
        try:
            return cache.library_result(DEVICE_KIND)
        finally:
            cache.library_result.cache_clear()


def _save_into_cache(path: pathlib.Path) -> Any:
    """A save merges into the file there: it must refuse a damaged one, or keep it valid."""
    saved = pathlib.Path(_small_result().save_to_cache(path.parent))
    return cache.read(saved, kind_key=saved.stem)


def _load_calibration(path: pathlib.Path) -> Any:
    os.environ[calibration.ENV_DIR] = str(path.parent)
    try:
        return calibration.for_device_kind(DEVICE_KIND)
    finally:
        del os.environ[calibration.ENV_DIR]


def _inspect(source: pathlib.Path) -> Any:
    found = tk.inspect(source)
    str(found).encode("utf-8")  # what `tokamax-pass inspect` prints, as a terminal takes it
    return found


class CommandLineError(Exception):
    """A command's own one-line error message (its `SystemExit`)."""


def _cli(*argv: str) -> Callable[[pathlib.Path], Any]:
    """The command line on `argv` (`{}` is the damaged file, `{dir}` its folder), with
    tracebacks on: an error that is not the command's own message propagates as it is.
    Returns what it printed, to a UTF-8 stream as a terminal's is (pytest's replaces what
    it cannot encode)."""

    def run(path: pathlib.Path) -> str:
        os.environ[cli.TRACEBACK_ENV] = "1"
        printed = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
        try:
            with contextlib.redirect_stdout(printed):
                assert cli.main([a.format(path, dir=path.parent) for a in argv]) == 0
            printed.seek(0)
            return printed.read()
        except SystemExit as e:
            if not isinstance(e.code, str):
                raise
            raise CommandLineError(e.code) from None
        finally:
            del os.environ[cli.TRACEBACK_ENV]

    return run


@dataclasses.dataclass(frozen=True)
class Loader:
    file: str  # the file damaged, under `originals`
    load: Callable[[pathlib.Path], Any]
    errors: tuple[type[Exception], ...]  # what it may raise (naming the file); () for none
    is_json: bool = True
    reads_a_path: bool = True  # its errors name the file (a loader of text cannot)
    focus: tuple = ()  # the part of a JSON document poisoned (a few values among many)


LOADERS = {
    "AutotuningResult.load": Loader("result.json", AutotuningResult.load, (SpecError,)),
    "cache.read": Loader("user_cache/nvidia_h200.json",
                         lambda p: cache.read(p, kind_key=p.stem), (SpecError,)),
    "user cache lookup": Loader("user_cache/nvidia_h200.json", _load_user_cache, ()),
    "user cache save": Loader("user_cache/nvidia_h200.json", _save_into_cache,
                              (cache.CacheError,)),
    "library cache lookup": Loader("library_cache/nvidia_h200/pallas_triton_layer_norm.json",
                                   _load_library_cache, ()),
    "bound_args_from_json": Loader("bound_args.json", bound_args_from_json, (SpecError,)),
    "get_bound_args(text)": Loader(
        "program.mlir", lambda p: tk.autotuning.get_bound_args(p.read_bytes().decode(
            errors="replace")), (SpecError, ValueError), is_json=False, reads_a_path=False),
    "load_artifact manifest": Loader("artifact/manifest.json", lambda p: tk.load_artifact(
        p.parent), (SpecError, ArtifactMismatchError, FileNotFoundError)),
    "load_artifact manifest versions": Loader(
        "artifact/manifest.json", lambda p: tk.load_artifact(p.parent),
        (SpecError, ArtifactMismatchError), focus=("versions",)),
    "load_artifact program": Loader("artifact/prog.stablehlo", lambda p: tk.load_artifact(
        p.parent), (SpecError,), is_json=False),
    "inspect artifact": Loader("artifact/manifest.json", lambda p: _inspect(p.parent),
                               (SpecError, FileNotFoundError)),
    # Some damaged StableHLO bytecode hangs or crashes XLA's own parser, which no check
    # before it can tell: these seeded mutations hold none.
    "inspect .stablehlo": Loader("prog.stablehlo", _inspect, (SpecError,), is_json=False),
    "inspect .mlir": Loader("program.mlir", _inspect, (SpecError, ValueError), is_json=False),
    "inspect HLO text": Loader("program.hlo", _inspect, (SpecError, ValueError), is_json=False),
    "cli inspect": Loader("artifact/manifest.json", _cli("inspect", "{dir}"),
                          (CommandLineError,)),
    "cli cache list": Loader("user_cache/nvidia_h200.json",
                             _cli("cache", "--cache-dir", "{dir}", "list"), ()),
    "cli cache show": Loader("user_cache/nvidia_h200.json", _cli(
        "cache", "--cache-dir", "{dir}", "show", "--device-kind", DEVICE_KIND),
        (CommandLineError,)),
    "cli cache import": Loader("result.json", _cli(
        "cache", "--cache-dir", "{dir}/imported", "import", "{}"), (SpecError,)),
    "profile": Loader("profile.xplane.pb", xplane_to_bound_args.bound_args_from_xplane,
                      (SpecError,), is_json=False),
    "calibration lookup": Loader("calibration/nvidia_h200.json", _load_calibration, ()),
}


def _damaged_copies(originals: pathlib.Path, tmp_path: pathlib.Path, name: str):
    """For each mutation: a fresh copy of the originals with the loader's file damaged."""
    loader = LOADERS[name]
    data = (originals / loader.file).read_bytes()
    seed = SEED + sorted(LOADERS).index(name)
    for i, (damaged, how) in enumerate(mutations(data, is_json=loader.is_json, seed=seed,
                                                 focus=loader.focus)):
        root = tmp_path / str(i)
        shutil.copytree(originals, root)
        (root / loader.file).write_bytes(damaged)
        yield root / loader.file, how


_ATTRIBUTE = re.compile(METADATA_KEY + r'\s*=\s*["{]')


def _count(value: Any) -> int | None:
    """How many things a loaded value holds: a result's entries, a list's calls."""
    if isinstance(value, AutotuningResult):
        return len(value)
    return len(value) if isinstance(value, list) else None


def _check_loaded(value: Any, original: Any, path: pathlib.Path,
                  caught: list[warnings.WarningMessage], how: str) -> None:
    """A loaded value is valid: a result reads back as itself, an artifact runs. One
    holding less than the undamaged file (`None`: nothing), an inspection that read
    fewer op attributes than the text holds, a document giving a key twice, was
    reported."""
    if isinstance(value, AutotuningResult):
        assert AutotuningResult.loads(value.dumps(), strict=True) == value, how
    if isinstance(value, tk.artifact.LoadedArtifact):
        value(X, SCALE)
    lost = value is None or (_count(value) or 0) < (_count(original) or 0)
    if isinstance(value, Inspection) and path.suffix in (".mlir", ".hlo"):
        text = path.read_bytes().decode(errors="replace")
        lost = sum(o.instructions for o in value.ops) < len(_ATTRIBUTE.findall(text))
    # A warning reports it, or the listing of `tokamax-pass cache list`.
    reported = bool(caught) or (isinstance(value, str) and "unreadable" in value)
    assert reported or not lost, f"{how}: {value!r:.200} lost what the file held, silently"
    # JSON keeps a repeated key's last value: the first is lost, and must not be silently.
    assert reported or not how.startswith("a key twice"), f"{how}: read without a word"


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_a_damaged_file_loads_valid_or_fails_naming_it(originals, tmp_path, name):
    loader = LOADERS[name]
    shutil.copytree(originals, tmp_path / "undamaged")
    # What the undamaged file holds; a damaged text or profile may hold less, unknowingly.
    original = loader.load(tmp_path / "undamaged" / loader.file) if loader.is_json else None
    for path, how in _damaged_copies(originals, tmp_path, name):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = loader.load(path)
            except loader.errors as e:
                message = str(e)
                assert path.name in message or str(path.parent) in message or (
                    not loader.reads_a_path), (how, message)
                continue
        _check_loaded(value, original, path, caught, how)


# --- writers ----------------------------------------------------------------------------

class Interrupted(BaseException):
    """A stop no `except Exception` catches, as a KeyboardInterrupt."""


def _interrupt(*args: Any, **kwargs: Any) -> Any:
    raise Interrupted


# Where a write is stopped: while it serializes, while it writes the bytes, as it renames.
STOPS = {
    "serializing": (json, "dumps"),
    "writing": (os, "fsync"),
    "renaming": (os, "replace"),
}


def _other_result() -> AutotuningResult:
    """A result whose entries differ from `_small_result`'s: the shipped file's third."""
    shipped = AutotuningResult.load(LAYER_NORM_CACHE)
    return AutotuningResult(shipped.device_kind, shipped.entries[2:3])


# Each writer: the file it replaces, what it writes (made before the write is stopped)
# and the write.
WRITERS: dict[str, tuple[str, Callable[[], Any], Callable[[Any, pathlib.Path], Any]]] = {
    "AutotuningResult.dump": ("result.json", _other_result, lambda r, p: r.dump(p)),
    "save_to_cache": ("user_cache/nvidia_h200.json", _other_result,
                      lambda r, p: r.save_to_cache(p.parent)),
    "write_library_cache": ("library_cache/nvidia_h200/pallas_triton_layer_norm.json",
                            _other_result,
                            lambda r, p: cache.write_library_cache(r, p.parent.parent)),
    "bound_args_to_json": ("bound_args.json", lambda: [e.bound for e in _other_result().entries],
                           lambda calls, p: bound_args_to_json(calls, p)),
    "Artifact.save": ("artifact/manifest.json",
                      lambda: tk.export(jax.numpy.sum, "f32[2,4]", name="prog"),
                      lambda artifact, p: artifact.save(p.parent)),
}


def _listing(folder: pathlib.Path) -> dict[str, bytes]:
    """Every file under `folder` but lock files, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


@pytest.mark.parametrize("stop", sorted(STOPS))
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_stopped_writer_leaves_the_old_file_and_no_other(originals, tmp_path, writer,
                                                           stop, monkeypatch):
    file, make, write = WRITERS[writer]
    shutil.copytree(originals, tmp_path / "root")
    path = tmp_path / "root" / file
    before, new = _listing(path.parent), make()
    monkeypatch.setattr(*STOPS[stop], _interrupt)
    with pytest.raises(Interrupted):
        write(new, path)
    monkeypatch.undo()
    assert _listing(path.parent) == before


WRITERS_AT_ONCE = 4


def _share(i: int) -> AutotuningResult:
    """Writer `i`'s measurements of one entry: its share of the configs measured there."""
    [entry] = _other_result().entries
    configs = list(entry.data.items())[i::WRITERS_AT_ONCE]
    return AutotuningResult(DEVICE_KIND, [dataclasses.replace(entry, data=dict(configs))])


def _save_in_process(i: int, directory: str, barrier: Any) -> None:
    barrier.wait()
    _share(i).save_to_cache(directory)
    os._exit(0)


# Python and JAX warn that fork and threads mix: the children only write files.
@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("how", ["threads", "processes"])
def test_concurrent_saves_of_one_cache_entry_keep_every_config(originals, tmp_path, how):
    directory = tmp_path / "cache"
    shutil.copytree(originals / "user_cache", directory)
    if how == "threads":
        barrier = threading.Barrier(WRITERS_AT_ONCE)
        with concurrent.futures.ThreadPoolExecutor(WRITERS_AT_ONCE) as pool:
            saves = [pool.submit(lambda i: (barrier.wait(), _share(i).save_to_cache(directory)),
                                 i) for i in range(WRITERS_AT_ONCE)]
        for save in saves:
            save.result()  # raises what the save raised
    else:
        context = multiprocessing.get_context("fork")
        shared = context.Barrier(WRITERS_AT_ONCE)
        writers = [context.Process(target=_save_in_process, args=(i, str(directory), shared))
                   for i in range(WRITERS_AT_ONCE)]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(timeout=120)
        assert [w.exitcode for w in writers] == [0] * WRITERS_AT_ONCE
    path = cache.cache_file(DEVICE_KIND, directory)
    saved = AutotuningResult.loads(path.read_text(), strict=True)
    assert _measured(saved) == _measured(_small_result() | _other_result())
    assert sorted(p.name for p in directory.iterdir() if not p.name.endswith(".lock")) == [
        path.name]


def _measured(result: AutotuningResult) -> dict[tuple, Any]:
    """Each entry's measurement of each config, whatever order the saves merged them in."""
    return {(entry.key, config): m for entry in result.entries
            for config, m in entry.data.items()}


def test_the_mutations_cut_flip_and_apply_every_poison():
    data = json.dumps({"entries": [{"a": 1, "b": [2, 3]}], "name": "x"}).encode()
    found = mutations(data, is_json=True, seed=SEED)
    assert {how.split(" at ")[0] for _, how in found} == {"cut", "bytes flipped", *POISONS}


def test_the_profile_of_a_bound_call_is_read_back(originals):
    path = originals / "profile.xplane.pb"
    [bound] = xplane_to_bound_args.bound_args_from_xplane(path)
    assert bound.to_json() == _small_result().entries[0].bound.to_json()
