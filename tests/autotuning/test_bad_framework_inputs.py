"""Bad input to the framework's APIs (autotune, AutotuningResult, the user cache, optimize,
export and artifacts, benchmarking, the command line) is a clear error naming the argument
and what it expects, raised at the API's entry: never a crash deep in JAX, `json` or `os`,
never a silently ignored value.

`tests/ops/test_bad_inputs.py` holds the ops' own bad inputs; each row here is a case an audit
tried, most of which crashed deep or were silently accepted before it.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import warnings

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from tokamax_pass import benchmarking
from tokamax_pass.autotuning import bound_args_from_json
from tokamax_pass.autotuning import cache as cache_lib
from tokamax_pass.autotuning.result import FORMAT, AutotuningResult
from tokamax_pass.cli import main
from tokamax_pass.core.spec import SpecError

X, S = jnp.ones((8, 32)), jnp.ones((32,))


def _loss(x, s):
    return tokamax.layer_norm(x, scale=s, offset=None, implementation="xla").sum()


def _loss_default(x, s):
    return tokamax.layer_norm(x, scale=s, offset=None).sum()


@pytest.fixture(autouse=True)
def _user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache_lib.ENV_CACHE_DIR, str(tmp_path / "user"))
    cache_lib._USER.invalidate()


def _document(**changes):
    return json.dumps({"format": FORMAT, "schema_version": 1, "device_kind": "cpu",
                       "entries": [], **changes})


# --- autotune ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    ({"max_configs": -1}, ValueError, "max_configs must be an int >= 1"),
    ({"max_configs": 0}, ValueError, "max_configs"),
    ({"max_configs": 2.5}, TypeError, "max_configs"),
    ({"max_configs": "6"}, TypeError, "max_configs"),
    ({"iterations": 0}, ValueError, "iterations must be an int >= 1"),
    ({"iterations": True}, TypeError, "iterations"),
    ({"method": "bogus"}, ValueError, "method must be one of"),
    # CUPTI times NVIDIA kernels: on this CPU every config failed and autotune returned.
    ({"method": "cupti"}, ValueError, "method='cupti' times NVIDIA GPU kernels"),
    ({"timeout": -1}, ValueError, "timeout must be > 0"),
    ({"timeout": "x"}, TypeError, "timeout"),
    ({"max_workers": 0}, ValueError, "max_workers"),
    ({"lowering_processes": -1}, ValueError, "lowering_processes"),
    ({"all_implementations": "sometimes"}, TypeError, "all_implementations must be True"),
    ({"cache": "yes"}, TypeError, "cache must be True or False"),
    ({"ignore_cache": None}, TypeError, "ignore_cache"),
    ({"progress": 1}, TypeError, "progress"),
    ({"search_losers": "no"}, TypeError, "search_losers"),
])
def test_autotune_bad_options(kwargs, error, match):
    with pytest.raises(error, match=f"autotune: .*{match}"):
        tokamax.autotune(_loss, X, S, **kwargs)


@pytest.mark.parametrize("f,args,error,match", [
    (5, (), TypeError, "autotune: f must be a callable"),
    (None, (), TypeError, "autotune: f must be a callable"),
    (_loss, (X,), TypeError, "missing 1 required positional argument: 's'"),
    (_loss, (X, S, S), TypeError, "takes 2 positional arguments"),
    (_loss, ([1, 2], S), TypeError, "argument 0 .*static argument.*hashable"),
    ([1, 2], (), TypeError, "a list must hold only BoundArguments"),
])
def test_autotune_bad_function_or_arguments(f, args, error, match):
    with pytest.raises(error, match=match):
        tokamax.autotune(f, *args)


def _lowered():
    return jax.jit(_loss).lower(X, S)


@pytest.mark.parametrize("source,name", [
    (lambda: _lowered().compile(), "a jax.stages.Compiled"),
    (_lowered, "a jax.stages.Lowered"),
    (lambda: _lowered().as_text(), "StableHLO/HLO text"),
])
def test_get_bound_args_of_a_lowered_program_takes_no_further_arguments(source, name):
    """A `Compiled` silently ignored extra arguments (`get_bound_args(compiled, x)`):
    its op calls were fixed when it was lowered, whatever their shapes. Each is named."""
    get_bound_args = tokamax.autotuning.get_bound_args
    program = source()
    with pytest.raises(TypeError, match=rf"get_bound_args: {name} takes no further "
                                        rf"arguments .*got 2 more: float32\[8, 32\] array, 3;"):
        get_bound_args(program, X, 3)
    with pytest.raises(TypeError, match=r"got 1 more: s=float32\[32\] array; call "
                                        r"get_bound_args\(\w+\) alone"):
        get_bound_args(program, s=S)
    # Alone, each finds the calls `get_bound_args(f, *args)` finds.
    assert [b.to_json() for b in get_bound_args(program)] == [
        b.to_json() for b in get_bound_args(_loss, X, S)]


# --- AutotuningResult -------------------------------------------------------------------

@pytest.mark.parametrize("text,error,match", [
    ("{not json", SpecError, "not valid JSON"),
    ("[1]", SpecError, "not a tokamax_pass AutotuningResult"),
    (json.dumps({"format": "other"}), SpecError, "not a tokamax_pass AutotuningResult"),
    (_document(schema_version=99), SpecError, "schema version 99, newer"),
    (_document(schema_version="1"), SpecError, "no integer 'schema_version'"),
    (_document(entries=[{"op": "no.such.Op", "arguments": {}}]), SpecError,
     r"entry 0: 'no.such.Op' does not name an Op"),
    (_document(entries="abc"), SpecError, "'entries' must be a list"),
    (_document(entries=[1]), SpecError, "entry 0: a bound-arguments spec needs 'op'"),
    (_document(device_kind=5), SpecError, "'device_kind' must be a string"),
    (b"\xff\xfe\x00", SpecError, "autotuning result"),
    (None, TypeError, "loads: text must be a JSON str or bytes"),
    (json.loads(_document()), TypeError, "loads: text must be .* got dict"),
])
def test_result_loads_bad_documents(text, error, match):
    with pytest.raises(error, match=match):
        AutotuningResult.loads(text, strict=True)


def test_result_of_a_wrong_device_kind_is_not_merged():
    cpu = AutotuningResult.loads(_document())
    h200 = AutotuningResult.loads(_document(device_kind="NVIDIA H200"))
    with pytest.raises(ValueError, match="different device kinds"):
        cpu | h200


def _path(tmp_path, name):
    (tmp_path / "dir").mkdir(exist_ok=True)
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.json").write_text("{bad")
    return {"missing": tmp_path / "missing.json", "dir": tmp_path / "dir",
            "bad": tmp_path / "bad.json", "file": tmp_path / "file",
            "under_file": tmp_path / "file" / "x.json",
            "no_parent": tmp_path / "no" / "x.json", "fifo": _fifo(tmp_path)}.get(name, name)


def _fifo(tmp_path):
    path = tmp_path / "fifo"
    if not path.exists():
        os.mkfifo(path)
    return path


@pytest.mark.parametrize("source,error,match", [
    ("missing", FileNotFoundError, "load: path_or_file .*missing.json' does not exist"),
    ("dir", IsADirectoryError, "load: path_or_file .* is a directory"),
    ("fifo", OSError, "load: path_or_file .*fifo' is not a regular file"),
    ("bad", SpecError, "bad.json' is not valid JSON"),
    (5, TypeError, "load: path_or_file must be a path or a readable file"),
    (None, TypeError, "load: path_or_file"),
])
def test_result_load_bad_sources(tmp_path, source, error, match):
    with pytest.raises(error, match=match):
        AutotuningResult.load(_path(tmp_path, source))


@pytest.mark.parametrize("target,error,match", [
    ("dir", IsADirectoryError, "dump: path_or_file .* is a directory"),
    ("under_file", NotADirectoryError, "dump: cannot write path_or_file .* is a file"),
    ("no_parent", FileNotFoundError, "dump: cannot write path_or_file .* does not exist"),
    (5, TypeError, "dump: path_or_file must be a path or a writable file"),
])
def test_result_dump_to_unwritable_targets(tmp_path, target, error, match):
    with pytest.raises(error, match=match):
        AutotuningResult("cpu").dump(_path(tmp_path, target))


@pytest.mark.parametrize("make,error,match", [
    (lambda: AutotuningResult("cpu").dumps(indent="x"), TypeError, "dumps: indent"),
    (lambda: AutotuningResult(5), TypeError, "device_kind must be a str"),
    (lambda: AutotuningResult("cpu", 5), TypeError, "data must be a sequence of Entry"),
    (lambda: AutotuningResult("cpu", [1]), TypeError, "data must hold Entry objects"),
])
def test_result_bad_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_result_lookups_take_bound_arguments():
    """`result.best_config(5)` and `5 in result` raised `AttributeError: 'int' object has
    no attribute 'op'` from the key function; a real call is still looked up."""
    (ba,) = tokamax.autotuning.get_bound_args(_loss, X, S)
    result = AutotuningResult("cpu")
    for lookup, where, argument in ((result.best_config, r"\.best_config", "ba"),
                                    (result.entry, r"\.entry", "ba"),
                                    (result.__contains__, r" \(`x in result`\)", "x")):
        for bad in (5, "x", None, [ba]):
            with pytest.raises(TypeError, match=rf"AutotuningResult{where}: {argument} must "
                                                rf"be a BoundArguments .*got {type(bad).__name__}"):
                lookup(bad)
    with pytest.raises(TypeError, match="must be a BoundArguments"):
        5 in result  # noqa: B015
    assert ba not in result and result.best_config(ba) is None and result.entry(ba) is None


# --- the user cache -----------------------------------------------------------------------

@pytest.mark.parametrize("corrupt", ["not json", "directory", "not utf-8", "unknown op"])
def test_a_corrupt_user_cache_file_is_reported_and_skipped(tmp_path, corrupt):
    path = cache_lib.cache_file("cpu")
    path.parent.mkdir(parents=True)
    if corrupt == "directory":
        path.mkdir()
    elif corrupt == "not utf-8":
        path.write_bytes(b"\xff\xfe\xfa")
    else:
        path.write_text("{bad" if corrupt == "not json" else _document(
            entries=[{"op": "no.such.Op", "arguments": {}}]))
    # A bad entry is skipped alone; a file that cannot be read at all is skipped whole.
    message = ("skipping an entry .*cache file .*entry 0" if corrupt == "unknown op"
               else "ignoring the user autotuning cache")
    with pytest.warns(UserWarning, match=message) as warned:
        # Every op call reads the user cache: a directory or non-UTF-8 bytes where the
        # file should be must not crash it; it runs without the cache.
        assert float(jax.jit(lambda x, s: _loss_default(x, s))(X, S)) == float(_loss(X, S))
    # The warning points at the user's line, not at the library's (or its kernels') own.
    assert {w.filename for w in warned if "cache" in str(w.message)} == {__file__}
    if corrupt == "unknown op":
        AutotuningResult("cpu").save_to_cache()
    else:
        with pytest.raises(cache_lib.CacheError, match="left in place"):
            AutotuningResult("cpu").save_to_cache()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_pipe_in_place_of_the_user_cache_file_is_reported_not_read():
    """Reading a pipe waits for a writer: every op call (and `cache list`) hung on it."""
    path = cache_lib.cache_file("cpu")
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    errors: list[Exception] = []

    def read() -> None:
        try:
            cache_lib.read(path)
        except SpecError as e:
            errors.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():
        with open(path, "wb"):  # a writer that closes at once: the reader sees the end
            pass
        pytest.fail("reading the user cache waited on a pipe")
    assert "is not a regular file (a pipe or a device)" in str(errors[0])
    with pytest.warns(UserWarning, match="ignoring the user autotuning cache: .*pipe"):
        assert float(jax.jit(lambda x, s: _loss_default(x, s))(X, S)) == float(_loss(X, S))


def test_a_cache_directory_that_is_a_file(tmp_path, monkeypatch):
    (tmp_path / "cachefile").write_text("x")
    monkeypatch.setenv(cache_lib.ENV_CACHE_DIR, str(tmp_path / "cachefile"))
    with pytest.warns(UserWarning, match="is a file, not a directory"):
        jax.jit(lambda x, s: _loss_default(x, s))(X, S)
    with pytest.raises(NotADirectoryError, match="save_to_cache: the cache directory"):
        AutotuningResult("cpu").save_to_cache()
    with pytest.raises(NotADirectoryError, match="save_to_cache: the cache directory"):
        AutotuningResult("cpu").save_to_cache(tmp_path / "cachefile")
    with pytest.raises(TypeError, match="user cache: directory must be a path"):
        AutotuningResult("cpu").save_to_cache(5)


# --- optimize -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    ({"fun": 5}, TypeError, "fun must be callable"),
    ({"autotune": "sometimes"}, ValueError, "autotune must be one of"),
    ({"autotune": True}, ValueError, "autotune must be one of"),
    ({"results": 5}, TypeError, "results must be an AutotuningResult"),
    # Any context manager passed the old duck-typed check, then applied nothing.
    ({"results": threading.Lock()}, TypeError, "results must be an AutotuningResult"),
    ({"results": pathlib.Path("tuned.json")}, TypeError,
     r"results must be an AutotuningResult.*AutotuningResult\.load\(path\)"),
    ({"static_argnums": "a"}, TypeError, "static_argnums must be an int"),
    ({"donate_argnums": [1.5]}, TypeError, "donate_argnums must be an int"),
    ({"static_argnames": 3}, TypeError, "static_argnames must be a str"),
])
def test_optimize_bad_options(kwargs, error, match):
    with pytest.raises(error, match=f"optimize: {match}"):
        tokamax.optimize(**{"fun": _loss, **kwargs})


@pytest.mark.parametrize("method", ["__call__", "plan", "lower"])
def test_optimized_wrong_argument_count(method):
    with pytest.raises(TypeError, match="missing 1 required positional argument: 's'"):
        getattr(tokamax.optimize(_loss), method)(X)


# --- export, artifacts, inspect -------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    ({"fun": 5}, TypeError, "export: fun must be a function"),
    ({"platforms": ("gpuu",)}, ValueError, "export: platforms must name cpu"),
    ({"platforms": 5}, TypeError, "export: platforms must be a str or a sequence"),
    ({"device_kind": 5}, TypeError, "export: device_kind must be a str"),
    # A misspelled shipped device kind was taken for a device of its own: the artifact
    # was built without the library cache's configs, silently.
    ({"device_kind": "H200"}, ValueError, "device_kind 'H200' is not a device kind JAX "
                                          "reports; did you mean 'NVIDIA H200'"),
    ({"device_kind": "nvidia_h200"}, ValueError, "'nvidia_h200' .* did you mean 'NVIDIA H200'"),
    ({"device_kind": ("NVIDIA-H200", "TPU v6 lite")}, ValueError,
     "'NVIDIA-H200' .* did you mean 'NVIDIA H200'"),
    ({"name": "a/b"}, ValueError, "export: name must be a file name"),
    ({"name": 5}, TypeError, "export: name must be a file name"),
])
def test_export_bad_options(kwargs, error, match):
    kwargs = {"fun": _loss, **kwargs}
    with pytest.raises(error, match=match):
        tokamax.export(kwargs.pop("fun"), X, S, **kwargs)


def test_only_a_misspelled_shipped_device_kind_is_an_error(tmp_path):
    """`"H200"`, `"nvidia_h200"`: the shipped kind in another case or spelling, or without
    its vendor word, which no device reports. Real kinds that merely look alike (the H20,
    the H200 NVL, the GH200) and kinds with no shipped cache are left alone; a GPU kind
    that names no GPU model anyone makes and is a typo away from a shipped one
    (`"NVIDIA H2000"`) is a misspelling too."""
    from tokamax_pass.core import device

    assert "NVIDIA H200" in device.shipped_device_kinds()
    for typo in ("H200", "h200", "nvidia_h200", "NVIDIA-H200", "nvidia h200", "NVIDIAH200",
                 "NVIDIA  H200 "):
        assert device.misspelled_shipped_kind(typo) == "NVIDIA H200"
        with pytest.raises(ValueError, match="did you mean 'NVIDIA H200'"), \
                device.targeting(typo):
            pass
    # A typo away, naming no GPU model: an error where a user typed it (a target), not
    # where a device or a file reports it (a GPU newer than the lists may).
    for typo in ("NVIDIA H2000", "nvidia h2000"):
        assert device.misspelled_shipped_kind(typo, typed=True) == "NVIDIA H200"
        assert device.misspelled_shipped_kind(typo) is None
        with pytest.raises(ValueError, match="did you mean 'NVIDIA H200'"), \
                device.targeting(typo):
            pass
    assert tokamax.AutotuningResult("NVIDIA H2000", []).device_kind == "NVIDIA H2000"
    with pytest.raises(ValueError, match="did you mean 'NVIDIA H200'"), \
            device.targeting("H200", platform="cuda"):
        pass
    for real in ("NVIDIA H200", "NVIDIA H20", "NVIDIA H200 NVL", "NVIDIA GH200 480GB",
                 "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "TPU v6 lite", "TPU v5",
                 "NVIDIA", "H 200", "NVIDIA B200", "NVIDIA GeForce RTX 4090", "NVIDIA L40S",
                 "NVIDIA H100", "NVIDIA H800", "NVIDIA H100 PCIe", "NVIDIA GB10"):
        assert device.misspelled_shipped_kind(real, typed=True) is None
    artifact = tokamax.export(_loss, X, S, device_kind="NVIDIA H20")
    assert artifact.manifest["device_kinds"] == {"cuda": "NVIDIA H20"}
    # The user cache: clearing a misspelled kind's file that is not there.
    with pytest.raises(ValueError, match="'H200' .* did you mean 'NVIDIA H200'"):
        cache_lib.clear(tmp_path, "H200")
    assert cache_lib.clear(tmp_path, "NVIDIA H100 80GB HBM3") == []
    (tmp_path / "h200.json").write_text(_document(device_kind="H200"))
    assert cache_lib.clear(tmp_path, "H200") == [str(tmp_path / "h200.json")]


@pytest.fixture(scope="module")
def artifact():
    return tokamax.export(_loss, X, S)


def _break(directory, how):
    manifest = json.loads((directory / "manifest.json").read_text())
    if how == "stablehlo":
        (directory / manifest["file"]).write_bytes(b"garbage")
    elif how == "manifest not json":
        (directory / "manifest.json").write_text("{bad")
    elif how == "manifest a list":
        (directory / "manifest.json").write_text("[1]")
    else:
        key, value = how
        manifest[key] = value
        if value is None:
            del manifest[key]
        (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how,error,match", [
    ("stablehlo", SpecError, r"_loss.stablehlo does not match its manifest"),
    ("manifest not json", SpecError, "manifest.json is not valid JSON"),
    ("manifest a list", SpecError, "manifest.json must hold a JSON object"),
    (("file", "../../x.stablehlo"), SpecError, "'file' must name a .stablehlo file in the"),
    (("file", None), SpecError, "manifest.json has no 'file'"),
    (("versions", "x"), SpecError, "'versions' must be a Mapping"),
])
def test_load_artifact_corrupt_directory(tmp_path, artifact, how, error, match):
    directory = artifact.save(tmp_path / "art")
    _break(directory, how)
    with pytest.raises(error, match=match):
        tokamax.load_artifact(directory)(X, S)


@pytest.mark.parametrize("source,kwargs,error,match", [
    ("missing", {}, FileNotFoundError, "load_artifact: directory .* does not exist"),
    ("dir", {}, FileNotFoundError, "is not a tokamax_pass artifact: no manifest.json"),
    (5, {}, TypeError, "load_artifact: directory must be a path"),
    ("dir", {"device": 5}, TypeError, "load_artifact: device must be a jax.Device"),
])
def test_load_artifact_bad_arguments(tmp_path, source, kwargs, error, match):
    with pytest.raises(error, match=match):
        tokamax.load_artifact(_path(tmp_path, source), **kwargs)


def test_saving_an_artifact_under_a_file(tmp_path, artifact):
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="Artifact.save: directory .* is a file"):
        artifact.save(tmp_path / "file" / "art")


@pytest.mark.parametrize("source,error,match", [
    (5, TypeError, "inspect: source must be an Artifact"),
    (None, TypeError, "inspect: source must be an Artifact"),
    (_loss, TypeError, r"export it first: tokamax_pass.export\(f, \*args\)"),
    ("missing", FileNotFoundError, "inspect: .* neither a file nor an artifact directory"),
    ("bad", ValueError, "inspect: .*bad.json is not StableHLO/MLIR or HLO text"),
])
def test_inspect_bad_sources(tmp_path, source, error, match):
    if source is not _loss:
        source = _path(tmp_path, source)
    with pytest.raises(error, match=match):
        tokamax.inspect(source)


def test_inspect_optimized_is_not_an_artifact():
    with pytest.raises(TypeError, match="got Optimized .*export it first"):
        tokamax.inspect(tokamax.optimize(_loss))


# --- bound-arguments JSON -------------------------------------------------------------

@pytest.mark.parametrize("source,error,match", [
    ("missing", FileNotFoundError, "bound_args_from_json: source .* does not exist"),
    ("dir", IsADirectoryError, "bound_args_from_json: source .* is a directory"),
    (5, TypeError, "bound_args_from_json: source must be a path, an open file or JSON"),
])
def test_bound_args_from_json_bad_sources(tmp_path, source, error, match):
    source = _path(tmp_path, source)
    with pytest.raises(error, match=match):
        bound_args_from_json(str(source) if not isinstance(source, int) else source)


# --- benchmarking -----------------------------------------------------------------------

def _run():
    return benchmarking.compile_benchmark(lambda xs: xs[0].sum(), [X])


def _untraceable(x):
    raise AssertionError("traced before the options were checked")


@pytest.mark.parametrize("call,error,match", [
    (lambda: benchmarking.standardize_function(5, X), TypeError,
     "standardize_function: f must be callable"),
    (lambda: benchmarking.standardize_function(_loss, kwargs=5), TypeError,
     "standardize_function: kwargs must be a dict"),
    (lambda: benchmarking.standardize_function(_loss, X, S, seed="a"), TypeError,
     "standardize_function: seed must be an int"),
    (lambda: benchmarking.standardize_function(_loss, X, S, mode="bwd"), ValueError,
     "mode must be 'forward'"),
    (lambda: benchmarking.compile_benchmark(5, [X]), TypeError,
     "compile_benchmark: f_std must be callable"),
    (lambda: benchmarking.compile_benchmark(lambda xs: xs, X), TypeError,
     "compile_benchmark: args must be the list of arrays"),
    (lambda: _run()([X], iterations=0), ValueError, "iterations must be an int >= 1"),
    (lambda: _run()([X], iterations=2.5), TypeError, "iterations must be an int"),
    (lambda: _run()([X], iterations=True), TypeError, "iterations must be an int"),
    (lambda: _run()([X], method="x"), ValueError, "method must be one of"),
    (lambda: benchmarking.benchmark(5, X), TypeError, "f must be callable"),
    (lambda: benchmarking.benchmark(jnp.sum, X, iterations=-1), ValueError, "iterations"),
    # Checked before `f` is traced and compiled (its trace would fail here).
    (lambda: benchmarking.benchmark(_untraceable, X, method="x"), ValueError,
     "method must be one of"),
    (lambda: benchmarking.benchmark(_untraceable, X, iterations=0), ValueError,
     "iterations must be an int >= 1"),
    (lambda: benchmarking.benchmark(_untraceable, X, method="cupti"), ValueError,
     "method='cupti' times NVIDIA GPU kernels"),
    # A key's shape: "Cannot interpret 'key<fry>' as a data type" from NumPy.
    (lambda: benchmarking.benchmark(lambda k, x: x, jax.eval_shape(lambda: jax.random.key(0)),
                                    X), ValueError, "argument 0 is a jax.ShapeDtypeStruct of PRNG"),
])
def test_benchmarking_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --- the command line -------------------------------------------------------------------

@pytest.mark.parametrize("argv,match", [
    (["autotune", "--bound-args", "missing"], "autotune: FileNotFoundError: .*source"),
    (["autotune", "--bound-args", "bad"], "autotune: SpecError: .*not valid JSON"),
    (["autotune", "--bound-args", "dir"], "autotune: IsADirectoryError: .*source"),
    (["autotune", "json:loads", "--args", "f32[8]", "--max-configs", "-3"],
     "autotune: ValueError: max_configs must be an int >= 1"),
    (["autotune", "json:loads", "--args", "f32[8]", "-o", "dir"],
     "autotune: IsADirectoryError: .*--output"),
    (["cache", "import", "missing"], "cache: FileNotFoundError: .*path_or_file"),
    (["cache", "import", "bad"], "cache: SpecError: .*not valid JSON"),
    (["cache", "--cache-dir", "file", "show"], "cache: the cache directory .* is a file"),
    # A misspelled device kind showed "no cache file", or cleared nothing, silently.
    (["cache", "show", "--device-kind", "H200"],
     "cache: ValueError: device_kind 'H200' is not a device kind JAX reports; did you mean "
     "'NVIDIA H200'"),
    (["cache", "clear", "--device-kind", "h200"], "cache: ValueError: device_kind 'h200' .*"
                                                  "did you mean 'NVIDIA H200'"),
    (["inspect", "bad"], "inspect: .* is not StableHLO/MLIR or HLO text"),
    (["bound-args", "--xplane_file", "missing", "-o", "x.json"],
     "bound-args: FileNotFoundError"),
])
def test_cli_bad_input_is_one_line(tmp_path, argv, match, monkeypatch):
    monkeypatch.delenv("TOKAMAX_PASS_TRACEBACK", raising=False)
    argv = [str(_path(tmp_path, a)) if a in ("missing", "bad", "dir", "file") else a
            for a in argv]
    with warnings.catch_warnings(), pytest.raises(SystemExit, match=match) as error:
        warnings.simplefilter("ignore")
        main(argv)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("argv", [["bogus"], ["cache", "bogus"], ["demo", "--shape", "1"],
                                  ["autotune", "m:f", "--max-configs", "abc"]])
def test_cli_bad_flags_are_argparse_errors(argv):
    with pytest.raises(SystemExit) as error:
        main(argv)
    assert error.value.code == 2
