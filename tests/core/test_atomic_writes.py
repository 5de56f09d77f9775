"""Every file the library writes is replaced atomically; the library-cache writer locks;
`autotune(cache=True)` keeps its result when the cache cannot be written."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import warnings

import jax
import pytest

import tokamax_pass as tokamax
from _tunable_ops import ChunkConfig, XlaChunkedMatmul
from tokamax_pass.autotuning import UnsavedResultError, bound_args_to_json, cache, keys
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import atomic_io, current_target


def _result(chunk, m=16):
    ba = keys.canonical(XlaChunkedMatmul().bind(
        jax.ShapeDtypeStruct((m, 64), "float32"), jax.ShapeDtypeStruct((64, 32), "float32")))
    entry = Entry(ba, {ChunkConfig(chunk): Measurement((1.0,))}, keys.provenance(ba.op))
    return tokamax.AutotuningResult(current_target().device_kind, [entry])


def test_write_atomic_fsyncs_the_file_and_its_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(
        f"/proc/self/fd/{fd}")) or real_fsync(fd))
    path = atomic_io.write_atomic(tmp_path / "out.json", "{}")
    assert path.read_text() == "{}"
    assert synced[-1] == str(tmp_path) and synced[0].startswith(str(tmp_path / ".out.json."))


def _disk_full(fd):
    raise OSError(errno.ENOSPC, "No space left on device")


# Each writer, stopped by a full disk: the old file stays whole, no temporary stays.
WRITERS = {
    "AutotuningResult.dump": (lambda d: d / "tuned.json", lambda p: _result(8, m=32).dump(p)),
    "bound_args_to_json": (lambda d: d / "calls.json",
                           lambda p: bound_args_to_json([_result(8).entries[0].bound], p)),
    "user cache": (lambda d: cache.cache_file(current_target().device_kind, d),
                   lambda p: _result(8, m=32).save_to_cache(p.parent)),
    "library cache": (lambda d: d / cache.device_kind_key(current_target().device_kind)
                      / "xla_chunked_matmul.json",
                      lambda p: cache.write_library_cache(_result(8, m=32), p.parent.parent)),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_a_writer_that_fails_leaves_the_old_file_whole(tmp_path, monkeypatch, writer):
    locate, write = WRITERS[writer]
    path = locate(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = _result(16).dumps()
    path.write_text(old)
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(OSError, match="No space left"):
        write(path)
    assert path.read_text() == old
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []


def _write_library_entries(directory, rounds, first_m, barrier):
    barrier.wait()
    for i in range(rounds):
        cache.write_library_cache(_result(8, m=first_m + i), directory)
    os._exit(0)


def test_concurrent_library_cache_writers_lose_no_entry(tmp_path):
    processes, rounds = 4, 6
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    with warnings.catch_warnings():
        # Python and JAX warn that fork and threads mix: the children only write files.
        warnings.simplefilter("ignore", RuntimeWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        workers = [context.Process(target=_write_library_entries,
                                   args=(tmp_path, rounds, 100 * (i + 1), barrier))
                   for i in range(processes)]
        for worker in workers:
            worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    (path,) = (tmp_path / cache.device_kind_key(current_target().device_kind)).glob("*.json")
    assert len(json.loads(path.read_text())["entries"]) == processes * rounds


@pytest.fixture
def unwritable_cache(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "a_file" / "cache"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))


def test_autotune_keeps_its_result_when_the_cache_cannot_be_written(tmp_path,
                                                                    unwritable_cache):
    x = jax.random.normal(jax.random.key(0), (8, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8))
    with pytest.raises(UnsavedResultError, match="the result is in .*tokamax_pass-autotune-"
                       ) as error:
        tokamax.autotune([XlaChunkedMatmul().bind(x, w)], cache=True, progress=False)
    kept = error.value.result
    assert len(kept) == 1 and kept.best_config(kept.entries[0].bound) is not None
    assert "is a file" in str(error.value)
    fallback = tokamax.AutotuningResult.load(error.value.fallback_path)
    assert fallback.dumps() == kept.dumps()
    assert os.path.dirname(error.value.fallback_path) == str(tmp_path)


def test_a_dumped_result_round_trips(tmp_path):
    result = _result(8) | _result(16, m=64)
    result.dump(tmp_path / "tuned.json")
    assert tokamax.AutotuningResult.load(tmp_path / "tuned.json").dumps() == result.dumps()
    assert [p.name for p in tmp_path.iterdir()] == ["tuned.json"]


def test_a_user_cache_file_that_is_a_link_is_written_through(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "user"))
    shared = tmp_path / "shared" / "cache.json"
    shared.parent.mkdir()
    shared.write_text(_result(8).dump_cache_str())
    link = cache.cache_file(current_target().device_kind)
    link.parent.mkdir()
    link.symlink_to(shared)
    assert _result(16, m=64).save_to_cache() == str(link)
    assert link.is_symlink() and link.resolve() == shared
    assert len(cache.read(shared)) == 2
    # No temporary file left; the lock of every save through a link to it is beside it.
    assert sorted(p.name for p in shared.parent.iterdir()) == ["cache.json", "cache.json.lock"]


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_written_files_get_the_mode_open_gives_and_replaced_files_keep_theirs(tmp_path,
                                                                              umask_022):
    result = _result(8)
    result.dump(tmp_path / "new.json")
    assert os.stat(tmp_path / "new.json").st_mode & 0o777 == 0o644
    (tmp_path / "old.json").write_text("{}")
    os.chmod(tmp_path / "old.json", 0o640)
    result.dump(tmp_path / "old.json")
    assert os.stat(tmp_path / "old.json").st_mode & 0o777 == 0o640


def test_a_saved_artifact_gets_the_modes_mkdir_and_open_give(tmp_path, umask_022):
    directory = tokamax.export(jax.numpy.sum, "f32[2,4]").save(tmp_path / "art")
    assert os.stat(directory).st_mode & 0o777 == 0o755
    assert {os.stat(p).st_mode & 0o777 for p in directory.iterdir()} == {0o644}
