"""Bad input to the command line and the export/artifact API: a clear error naming the
argument, never a crash deep in JAX, a silently lost result or deleted files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

import tokamax_pass as tokamax
from tokamax_pass.artifact import ArtifactMismatchError, check_compatible
from tokamax_pass.cli import main
from tokamax_pass.core.spec import SpecError

# Imports cleanly and sums any array: a real target for `MODULE:FUNCTION`.
TARGET = "jax.numpy:sum"
HUGE = "f32[99999999999999999999]"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    """One-line errors, and a user cache of the test's own: `cache clear --device-kind ''`
    deleted every cache file."""
    monkeypatch.delenv("TOKAMAX_PASS_TRACEBACK", raising=False)
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path_factory.mktemp("user_cache")))


def _argparse_error(argv, capsys) -> str:
    """argparse's error line for `argv` (exit status 2, before any work is done)."""
    with pytest.raises(SystemExit) as error:
        main(argv)
    assert error.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


# --- empty paths and names -----------------------------------------------------------------

@pytest.mark.parametrize("argv,option", [
    (["export", TARGET, "--args", "f32[4]", "-o", ""], "-o/--output"),
    (["export", TARGET, "--args", "f32[4]", "--device-kind", "", "-o", "x"], "--device-kind"),
    (["export", TARGET, "--args", "f32[4]", "--results", "", "-o", "x"], "--results"),
    (["autotune", TARGET, "--args", "f32[4]", "-o", ""], "-o/--output"),
    (["autotune", TARGET, "--args", "f32[4]", "--write-library-cache", ""],
     "--write-library-cache"),
    (["autotune", "--bound-args", ""], "--bound-args"),
    (["bound-args", TARGET, "--args", "f32[4]", "-o", ""], "--output_file/--output-file/-o"),
    (["bound-args", "--xplane_file", " ", "-o", "x.json"], "--xplane_file/--xplane-file"),
    (["cache", "--cache-dir", "", "list"], "--cache-dir"),
    (["cache", "show", "--device-kind", ""], "--device-kind"),
    (["cache", "clear", "--device-kind", ""], "--device-kind"),
    (["cache", "import", ""], "file"),
    (["inspect", ""], "file"),
])
def test_an_empty_path_or_name_is_an_argparse_error(argv, option, capsys, tmp_path, monkeypatch):
    """An empty value (an unset shell variable) was read as the working directory or as
    "not given": `export -o ''` wrote into the working directory, `autotune -o ''` tuned
    and then wrote no result."""
    monkeypatch.chdir(tmp_path)
    line = _argparse_error(argv, capsys)
    assert f"argument {option}: must not be empty" in line
    assert list(tmp_path.iterdir()) == []


def test_empty_cache_options_delete_nothing(tmp_path, monkeypatch, capsys):
    """`cache --cache-dir '' clear` deleted every `*.json` in the working directory, and
    `cache clear --device-kind ''` every cache file, not one kind's."""
    work, cache_dir = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    cache_dir.mkdir()
    (work / "precious.json").write_text("{}")
    (cache_dir / "nvidia_h200.json").write_text("{}")
    monkeypatch.chdir(work)
    _argparse_error(["cache", "--cache-dir", "", "clear"], capsys)
    _argparse_error(["cache", "--cache-dir", str(cache_dir), "clear", "--device-kind", ""],
                    capsys)
    assert (work / "precious.json").exists() and (cache_dir / "nvidia_h200.json").exists()


@pytest.mark.parametrize("damage", ["not json", "a link to itself"])
def test_an_unreadable_cache_file_is_named_with_the_command_that_removes_it(tmp_path, capsys,
                                                                            damage):
    """A link that loops ended `cache list` (every file's line) in one `OSError` line."""
    if damage == "not json":
        (tmp_path / "nvidia_h200.json").write_text("{not json")
    else:
        (tmp_path / "nvidia_h200.json").symlink_to("nvidia_h200.json")
    assert main(["cache", "--cache-dir", str(tmp_path), "list"]) == 0
    line = capsys.readouterr().out.splitlines()[1]
    assert "nvidia_h200.json: unreadable" in line and "`tokamax-pass cache clear`" in line
    with pytest.raises(SystemExit) as raised:
        main(["cache", "--cache-dir", str(tmp_path), "show", "--device-kind", "NVIDIA H200"])
    assert str(raised.value).startswith("tokamax-pass cache: cache file ")
    assert str(raised.value).endswith(
        "`tokamax-pass cache clear --device-kind 'NVIDIA H200'` removes it")
    assert main(["cache", "--cache-dir", str(tmp_path), "clear", "--device-kind",
                 "NVIDIA H200"]) == 0
    assert not (tmp_path / "nvidia_h200.json").is_symlink()
    assert not (tmp_path / "nvidia_h200.json").exists()


@pytest.mark.parametrize("call", [
    lambda: tokamax.export(jnp.sum, "f32[4]").save(""),
    lambda: tokamax.load_artifact(""),
    lambda: tokamax.inspect(""),
])
def test_the_api_refuses_an_empty_directory(call, tmp_path, monkeypatch):
    """`Artifact.save("")` wrote `sum.stablehlo` and `manifest.json` into the working
    directory; `load_artifact("")` and `inspect("")` read whatever artifact was there."""
    monkeypatch.chdir(tmp_path)
    tokamax.export(jnp.sum, "f32[4]").save(tmp_path)  # an artifact that "" would find
    before = sorted(tmp_path.iterdir())
    with pytest.raises(ValueError, match="must not be empty, got ''; pass '.'"):
        call()
    assert sorted(tmp_path.iterdir()) == before


# --- demo sizes --------------------------------------------------------------------------

@pytest.mark.parametrize("argv,line", [
    (["demo", "--shape", "-1", "2", "2", "2"], "argument --shape: must be an int >= 1, got -1"),
    (["demo", "--shape", "2", "0", "2", "2"], "argument --shape: must be an int >= 1, got 0"),
    (["demo", "--iterations", "0"], "argument --iterations: must be an int >= 1, got 0"),
])
def test_demo_sizes_are_checked_before_it_runs(argv, line, capsys):
    """A negative size crashed in MLIR with a traceback; `--iterations 0` failed only
    after the gradient had run."""
    assert _argparse_error(argv, capsys).endswith(line)


# --- array specs -------------------------------------------------------------------------

def test_an_unknown_dtype_lists_the_spelling(capsys):
    with pytest.raises(SystemExit,
                       match=r"'i32\[4\]' is not an array spec .*spells them: bf16, .*s32"):
        main(["export", TARGET, "--args", "i32[4]", "-o", "x"])


@pytest.mark.parametrize("command", [["export", "-o", "x"], ["bound-args", "-o", "x.json"]])
def test_a_dimension_too_large_for_xla(command):
    """It failed deep in MLIR: `TypeError: get(): incompatible function arguments`."""
    with pytest.raises(SystemExit, match=r"--args: .* has a dimension above 9223372036854775807"):
        main([command[0], TARGET, "--args", HUGE, *command[1:]])


def test_export_api_dimension_too_large_for_xla():
    with pytest.raises(ValueError, match=r"export: .* has a dimension above 9223372036854775807"):
        tokamax.export(jnp.sum, HUGE)


# --- platforms -----------------------------------------------------------------------------

@pytest.mark.parametrize("platforms,twice", [(("cpu", "cpu"), "cpu"), ("gpu,cuda", "cuda")])
def test_a_platform_named_twice(platforms, twice):
    """The manifest listed it twice (`"gpu,cuda"` gave `['cuda', 'cuda']`)."""
    with pytest.raises(ValueError, match=f"export: platforms names {twice} more than once"):
        tokamax.export(jnp.sum, "f32[4]", platforms=platforms, device_kind="NVIDIA H200")


def test_cli_errors_are_prefixed_once(tmp_path):
    """Every error line starts `tokamax-pass CMD: `, once (not `export: export: platforms
    ...`, nor `autotune: ValueError: autotune: ...`, nor a bare `inspect: ... neither a
    file`, nor `cannot import ...`)."""
    with pytest.raises(SystemExit, match="^tokamax-pass export: platforms names cpu more "
                                         "than once"):
        main(["export", TARGET, "--args", "f32[4]", "--platforms", "cpu,cpu",
              "-o", str(tmp_path / "art")])
    with pytest.raises(SystemExit, match="^tokamax-pass inspect: .* neither a file nor an "
                                         "artifact"):
        main(["inspect", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="^tokamax-pass export: cannot import "):
        main(["export", "no_such_module_here:f", "--args", "f32[4]",
              "-o", str(tmp_path / "art")])
    # An error raised in the library, named by its type (not `ValueError: autotune: ...`).
    with pytest.raises(SystemExit, match="^tokamax-pass autotune: ValueError: max_configs "):
        main(["autotune", TARGET, "--args", "f32[4]", "--max-configs", "-1"])


def test_bound_args_xplane_file_is_a_directory(tmp_path):
    """It ended in a bare `[Errno 21] Is a directory` naming no option."""
    with pytest.raises(SystemExit, match="--xplane_file .* is a directory; give the path"):
        main(["bound-args", "--xplane_file", str(tmp_path), "-o", str(tmp_path / "x.json")])


# --- manifests ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifact():
    return tokamax.export(jnp.sum, "f32[4]")


def _with_manifest(directory, **changes):
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest.update(changes)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


@pytest.mark.parametrize("changes,error,match", [
    # "exported with jax None, newer than the installed 0.x; upgrade jax".
    ({"versions": {}}, ArtifactMismatchError, "records no jax version"),
    # A TypeError from `re`, and a version with no digits passed the check.
    ({"versions": {"jax": 5}}, SpecError, r"versions\['jax'\] must be a version string"),
    ({"versions": {"jax": "abc"}}, SpecError, r"versions\['jax'\] must be a version string"),
    # An AttributeError ('int' object has no attribute 'startswith') or a TypeError.
    ({"custom_calls": [5]}, SpecError, "'custom_calls' must be a list of strs"),
    ({"custom_calls": 5}, SpecError, "'custom_calls' must be a list"),
    # A TypeError from `", ".join` in the platform check.
    ({"platforms": [1]}, SpecError, "'platforms' must be a list of strs"),
    # An OSError ("File name too long") from the file system.
    ({"file": "x" * 300 + ".stablehlo"}, SpecError, "'file' must name a .stablehlo file"),
    ({"file": ""}, SpecError, "'file' must name a .stablehlo file"),
])
def test_load_artifact_bad_manifest_fields(tmp_path, artifact, changes, error, match):
    directory = _with_manifest(artifact.save(tmp_path / "art"), **changes)
    with pytest.raises(error, match=match):
        tokamax.load_artifact(directory)


@pytest.mark.parametrize("ops", [[{}], "x", [None]], ids=["no fields", "str", "null row"])
def test_inspect_refuses_a_manifest_whose_ops_it_cannot_print(tmp_path, artifact, ops):
    """`inspect` printed the manifest's `ops` as they were: a `KeyError` traceback from
    the command line, a `TypeError` from the API."""
    directory = _with_manifest(artifact.save(tmp_path / "art"), ops=ops)
    with pytest.raises(SpecError, match=r"manifest.json: .*ops"):
        tokamax.inspect(directory)
    with pytest.raises(SystemExit, match=r"^tokamax-pass inspect: .*manifest.json: .*ops"):
        main(["inspect", str(directory)])


@pytest.mark.parametrize("manifest,dev,match", [
    (None, "device", "check_compatible: manifest must be a Mapping"),
    ("manifest", "cpu", r"check_compatible: dev must be a jax.Device"),
])
def test_check_compatible_bad_arguments(artifact, manifest, dev, match):
    """An `AttributeError` on `.get` or `.platform`."""
    manifest = artifact.manifest if manifest == "manifest" else manifest
    dev = jax.devices()[0] if dev == "device" else dev
    with pytest.raises(TypeError, match=match):
        check_compatible(manifest, dev)


def test_a_mismatch_names_an_option_that_exists(tmp_path, artifact):
    """It said "pass check=False (CLI: --no-check)", a flag no command has, and offered
    `check=False` for a program with no code for this platform, which then failed in
    JAX. Another device kind may be overridden; another platform is re-exported, with
    the Python argument named as well as the command line's."""
    directory = _with_manifest(artifact.save(tmp_path / "art"), platforms=["tpu"])
    with pytest.raises(ArtifactMismatchError, match=r"platforms=\['tpu', 'cpu'\]") as e:
        tokamax.load_artifact(directory)
    assert "check=False" not in str(e.value) and "--no-check" not in str(e.value)
    kind = jax.devices()[0].device_kind
    other = _with_manifest(artifact.save(tmp_path / "other"),
                           device_kinds={"cpu": f"not {kind}"})
    with pytest.raises(ArtifactMismatchError,
                       match=r"device_kind=.*load_artifact\(\.\.\., check=False\)") as e:
        tokamax.load_artifact(other)
    assert "--no-check" not in str(e.value)


# --- warnings ------------------------------------------------------------------------------

def test_a_warning_is_one_line_naming_the_command(tmp_path, capsys):
    """A warning is one line naming the command, as errors are: no library file and line
    (`.../result.py:291:`, `<frozen runpy>:88:`) or source line, which would point at
    the library's code rather than the file the user gave."""
    result = tmp_path / "result.json"
    result.write_text(json.dumps({
        "format": "tokamax_pass.AutotuningResult", "schema_version": 1, "device_kind": "cpu",
        "entries": [{"op": {"dataclass": "no_such_module.NoSuchOp", "fields": {}},
                     "arguments": {}, "configs": []}]}))

    def show(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with warnings.catch_warnings():
        warnings.showwarning = show  # as Python shows a warning (pytest records them)
        assert main(["cache", "import", str(result)]) == 0
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("tokamax-pass cache: BadEntryWarning: skipping an entry")
        assert "no_such_module.NoSuchOp" in line and ".py:" not in line
        assert main(["autotune", TARGET, "--args", "f32[4]", "--no-progress"]) == 0
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("tokamax-pass autotune: NothingToTuneWarning: the function ")
        assert "tokamax-pass export --autotune always" in line


# --- output paths ------------------------------------------------------------------------

@pytest.mark.parametrize("command,option", [
    (["export", "-o"], "--output"),
    (["bound-args", "-o"], "--output_file"),
])
def test_an_output_under_a_file_is_refused_before_any_work(command, option, tmp_path):
    """The output path is checked before the function is imported, planned, lowered or
    traced: here the module is never imported."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match=f"^tokamax-pass {command[0]}: NotADirectoryError: "
                                         f".*{option} .*{blocker.name}.* is a file"):
        main([command[0], "no_such_module_here:f", "--args", "f32[4]", *command[1:],
              str(blocker / "out")])


@pytest.mark.parametrize("argv", [["cache", "list"], ["cache", "show"]])
def test_a_reader_that_closes_the_output_ends_the_command_quietly(argv, tmp_path):
    """`tokamax-pass inspect DIR | head`: once `head` has read its lines, the command
    stops with a failing status and no `tokamax-pass CMD: BrokenPipeError` line (the
    closed pipe is no bad input). The output here is a pipe whose reader has already
    closed it."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "TOKAMAX_PASS_CACHE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        done = subprocess.run([sys.executable, "-m", "tokamax_pass", *argv], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=300)
    finally:
        os.close(write_end)
    assert "Broken pipe" not in done.stderr and "tokamax-pass" not in done.stderr, done.stderr
    assert done.returncode != 0
