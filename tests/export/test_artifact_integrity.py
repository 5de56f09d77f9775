"""Artifacts are tied to their bytes: a digest checked on load, saves that never tear.

The kill tests fork a writer that saves in a loop and SIGKILL it after a random short
delay; whatever it left must load as a complete old or new artifact (or result), or fail
with a clear error, never as a mix.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import shutil
import signal
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_pass as tokamax
from _tunable_ops import ChunkConfig, XlaChunkedMatmul
from tokamax_pass.artifact import Artifact, ArtifactIntegrityError
from tokamax_pass.autotuning import cache, keys
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import current_target, spec

KILLS_PER_WRITER = 10  # five writers: 50 kills in all


@pytest.fixture(scope="module")
def programs():
    """Two artifacts of one name and signature, different programs."""
    return (tokamax.export(jnp.sum, "f32[2,4]", name="prog"),
            tokamax.export(jnp.max, "f32[2,4]", name="prog"))


def test_the_manifest_digests_the_program_and_a_saved_artifact_runs(tmp_path, programs):
    summed, _ = programs
    directory = summed.save(tmp_path / "art")
    manifest = json.loads((directory / "manifest.json").read_text())
    program = (directory / "prog.stablehlo").read_bytes()
    assert manifest["sha256"] == {"prog.stablehlo": hashlib.sha256(program).hexdigest()}
    assert manifest == json.loads(json.dumps(dict(summed.manifest)))
    x = jax.random.normal(jax.random.key(0), (2, 4))
    np.testing.assert_allclose(tokamax.load_artifact(directory)(x), jnp.sum(x), rtol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no temporary left


def test_a_program_swapped_under_its_manifest_fails_naming_both_files(tmp_path, programs):
    summed, maxed = programs
    first, second = summed.save(tmp_path / "a"), maxed.save(tmp_path / "b")
    shutil.copyfile(second / "prog.stablehlo", first / "prog.stablehlo")
    with pytest.raises(ArtifactIntegrityError) as error:
        tokamax.load_artifact(first)
    message = str(error.value)
    assert str(first / "prog.stablehlo") in message and str(first / "manifest.json") in message
    assert "does not match" in message
    with pytest.raises(ArtifactIntegrityError):
        tokamax.inspect(first)


def test_a_manifest_without_a_digest_is_refused_with_re_export(tmp_path, programs):
    directory = programs[0].save(tmp_path / "art")
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["sha256"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactIntegrityError, match="carries no SHA-256 .* re-export"):
        tokamax.load_artifact(directory)


@pytest.mark.parametrize("key,value", [
    ("platforms", ["cpu", "cuda"]),
    ("in_specs", ["f32[3,4]"]),
    ("out_specs", ["bf16[]"]),
    ("custom_calls", ["mosaic_gpu"]),
])
def test_a_manifest_that_misdescribes_its_program_is_refused(tmp_path, programs, key, value):
    """The digest ties the program to its manifest; the load ties the manifest to the
    program: a manifest edited (and digested again) to claim what the program is not
    fails on load, not inside XLA."""
    directory = programs[0].save(tmp_path / "art")
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest[key] != value
    manifest[key] = value
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactIntegrityError, match=rf"manifest's '{key}' is .* re-export"):
        tokamax.load_artifact(directory)
    x = jax.random.normal(jax.random.key(0), (2, 4))
    if key != "platforms":  # unchecked, the program still runs as what it is
        np.testing.assert_allclose(tokamax.load_artifact(directory, check=False)(x), jnp.sum(x),
                                   rtol=1e-6)


@pytest.mark.parametrize("digests,error,match", [
    ({"notes.txt": "0" * 64}, ArtifactIntegrityError, r"notes.txt does not match its manifest"),
    ({"../prog.stablehlo": "0" * 64}, ArtifactIntegrityError, "must map file names"),
    ({"gone.bin": "0" * 64}, FileNotFoundError, "digests gone.bin, which is missing"),
])
def test_every_file_the_manifest_digests_is_checked(tmp_path, programs, digests, error, match):
    directory = programs[0].save(tmp_path / "art")
    (directory / "notes.txt").write_text("not what the manifest digests")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["sha256"].update(digests)
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(error, match=match):
        Artifact.load(directory)


def test_save_fills_an_empty_directory_as_bazel_declares_it(tmp_path, programs):
    (tmp_path / "out").mkdir()
    directory = programs[0].save(tmp_path / "out")
    assert sorted(p.name for p in directory.iterdir()) == ["manifest.json", "prog.stablehlo"]
    assert Artifact.load(directory).serialized == programs[0].serialized
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_save_into_a_directory_whose_folder_is_read_only(tmp_path, programs, monkeypatch):
    directory = programs[0].save(tmp_path / "art")
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(**kwargs):
        if pathlib.Path(kwargs["dir"]) == tmp_path:
            raise PermissionError(13, "Permission denied", str(tmp_path))
        return real_mkdtemp(**kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    programs[1].save(directory)
    assert Artifact.load(directory).serialized == programs[1].serialized
    assert sorted(p.name for p in directory.iterdir()) == ["manifest.json", "prog.stablehlo"]


def test_save_replaces_an_artifact_and_keeps_other_files(tmp_path, programs):
    summed, maxed = programs
    directory = summed.save(tmp_path / "art")
    (directory / "notes.txt").write_text("kept")
    maxed.save(directory)
    assert Artifact.load(directory).serialized == maxed.serialized
    assert (directory / "notes.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


@pytest.mark.parametrize("stop_at", ["program", "manifest"])
def test_a_save_stopped_between_its_moves_never_loads_a_mix(tmp_path, programs, monkeypatch,
                                                            stop_at):
    """Over an existing artifact the files move in one by one, program first: stopped
    before the manifest moves, the new program under the old manifest fails its digest."""
    summed, maxed = programs
    directory = summed.save(tmp_path / "art")
    real_replace = os.replace
    stop = directory / ("prog.stablehlo" if stop_at == "program" else "manifest.json")

    def replace(source, destination):
        if pathlib.Path(destination) == stop:
            raise OSError("the save stops here")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="the save stops here"):
        maxed.save(directory)
    monkeypatch.setattr(os, "replace", real_replace)
    if stop_at == "program":
        assert Artifact.load(directory).serialized == summed.serialized
    else:
        with pytest.raises(ArtifactIntegrityError, match="does not match its manifest"):
            Artifact.load(directory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # the temporary is removed


@pytest.mark.parametrize("name", ["../escape", "sub/prog", "sub\\prog", "..", ""])
def test_save_refuses_a_name_with_a_path_separator(tmp_path, programs, name):
    art = Artifact(name, programs[0].serialized, programs[0].manifest)
    with pytest.raises(ValueError, match="name must be a file name"):
        art.save(tmp_path / "art")
    with pytest.raises(ValueError, match="name must be a file name"):
        tokamax.export(jnp.sum, "f32[2,4]", name=name)
    assert list(tmp_path.iterdir()) == []


# --- killed writers ------------------------------------------------------------------------

def _kill_while_writing(write_forever, check, rng) -> None:
    """Forks a process that runs `write_forever`, SIGKILLs it after a random short delay,
    then runs `check` on what it left."""
    with warnings.catch_warnings():
        # Python and JAX warn that fork and threads mix: the child only writes files.
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        try:
            write_forever()
        finally:
            os._exit(0)
    time.sleep(rng.uniform(0.0, 0.04))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status), "the writer stopped before it was killed"
    check()


def _alternating(save, items):
    def write_forever():
        i = 0
        while True:
            save(items[i % len(items)])
            i += 1
    return write_forever


def test_a_killed_artifact_save_over_an_artifact_never_leaves_a_mix(tmp_path, programs):
    rng = random.Random(0)
    directory = tmp_path / "art"
    programs[0].save(directory)
    complete = {a.serialized: json.loads(json.dumps(dict(a.manifest))) for a in programs}

    def check():
        try:
            loaded = Artifact.load(directory)
        except ArtifactIntegrityError:
            return  # the new program under the old manifest: refused, as it must be
        assert complete[loaded.serialized] == dict(loaded.manifest)

    for _ in range(KILLS_PER_WRITER):
        _kill_while_writing(_alternating(lambda a: a.save(directory), programs), check, rng)


def test_a_killed_first_artifact_save_leaves_it_whole_or_absent(tmp_path, programs):
    rng = random.Random(1)
    base = tmp_path / "fresh"
    base.mkdir()

    def write_forever():  # each save into a directory not there before
        for i in range(10**9):
            programs[i % 2].save(base / f"art{i}")

    def check():
        for directory in base.iterdir():
            if directory.name.startswith("."):
                continue  # the killed writer's temporary directory: no artifact's name
            loaded = Artifact.load(directory)  # the directory appears whole or not at all
            assert loaded.serialized in {a.serialized for a in programs}
        for directory in list(base.iterdir()):
            shutil.rmtree(directory)

    for _ in range(KILLS_PER_WRITER):
        _kill_while_writing(write_forever, check, rng)


def _results():
    def result(chunk, m):
        ba = keys.canonical(XlaChunkedMatmul().bind(
            jax.ShapeDtypeStruct((m, 64), "float32"), jax.ShapeDtypeStruct((64, 32), "float32")))
        entry = Entry(ba, {ChunkConfig(chunk): Measurement((1.0,))}, keys.provenance(ba.op))
        return tokamax.AutotuningResult(current_target().device_kind, [entry])
    # Large enough that a write takes several system calls.
    return [result(8, 16), result(16, 32)], [result(32, 16 + i) for i in range(200)]


def test_a_killed_dump_leaves_the_old_or_the_new_result(tmp_path):
    rng = random.Random(2)
    small, large = _results()
    merged_large = large[0]
    for r in large[1:]:
        merged_large = merged_large | r
    versions = [small[0], merged_large]
    path = tmp_path / "tuned.json"
    versions[0].dump(path)
    texts = {v.dumps() for v in versions}

    def check():
        assert tokamax.AutotuningResult.load(path).dumps() in texts

    for _ in range(KILLS_PER_WRITER):
        _kill_while_writing(_alternating(lambda r: r.dump(path), versions), check, rng)


def test_a_killed_cache_save_leaves_a_readable_cache(tmp_path):
    rng = random.Random(3)
    small, large = _results()
    directory = tmp_path / "cache"
    small[0].save_to_cache(directory)
    known = {e.key for r in small + large for e in r.entries}

    def check():
        stored = cache.read(cache.cache_file(current_target().device_kind, directory))
        assert stored is not None and {e.key for e in stored.entries} <= known

    for _ in range(KILLS_PER_WRITER):
        _kill_while_writing(_alternating(lambda r: r.save_to_cache(directory),
                                         small + large), check, rng)


def test_a_killed_library_cache_write_leaves_a_readable_file(tmp_path):
    rng = random.Random(4)
    small, large = _results()
    cache.write_library_cache(small[0], tmp_path)
    (path,) = (tmp_path / cache.device_kind_key(current_target().device_kind)).glob("*.json")
    known = {e.key for r in small + large for e in r.entries}

    def check():
        assert {e.key for e in cache.read(path).entries} <= known

    for _ in range(KILLS_PER_WRITER):
        _kill_while_writing(_alternating(lambda r: cache.write_library_cache(r, tmp_path),
                                         small + large), check, rng)


def test_a_torn_manifest_is_a_clear_error_not_a_load(tmp_path, programs):
    directory = programs[0].save(tmp_path / "art")
    text = (directory / "manifest.json").read_text()
    (directory / "manifest.json").write_text(text[: len(text) // 2])
    with pytest.raises(spec.SpecError, match="manifest.json"):
        Artifact.load(directory)


def test_a_manifest_of_a_schema_version_below_1_is_refused(tmp_path, programs):
    directory = programs[0].save(tmp_path / "art")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["schema_version"] = -5
    (directory / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(spec.SpecError, match="schema version -5, which no tokamax_pass"):
        Artifact.load(directory)


def test_a_program_larger_than_memory_is_refused_before_it_is_read(tmp_path, programs,
                                                                    monkeypatch):
    """A program file is read whole: one past this machine's memory (a sparse file of a
    terabyte) is a clear error, not a `MemoryError`, from `load_artifact` and from
    `inspect` of the directory or of the file itself. Files beside it that the manifest
    digests are hashed in blocks, never read whole."""
    directory = programs[0].save(tmp_path / "art")
    monkeypatch.setattr(spec, "physical_memory_bytes", lambda: 1 << 20)
    program = directory / "prog.stablehlo"
    with open(program, "r+b") as f:
        f.truncate((1 << 20) + 1)  # sparse where the file system allows it
    for load in (tokamax.load_artifact, tokamax.inspect, lambda _: tokamax.inspect(program)):
        with pytest.raises(spec.SpecError, match=r"is 1048577 bytes long, more than this "
                                                 r"machine's 1048576 bytes of memory"):
            load(directory)
