"""The cache stack: user cache on disk (atomic, locked, provenance), library cache, order."""

from __future__ import annotations

import json
import logging
import pathlib
import threading

import jax
import pytest

import tokamax_pass as tokamax
from _tunable_ops import ChunkConfig, XlaChunkedMatmul
from tokamax_pass.autotuning import cache, keys
from tokamax_pass.autotuning import result as result_lib
from tokamax_pass.autotuning.entry import Entry, Measurement
from tokamax_pass.core import current_target, selection

KIND = None  # filled per test from the default device


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(cache, "library_cache_dir", lambda kind: tmp_path / "lib" / "none")
    cache.library_result.cache_clear()
    cache._USER.invalidate()
    cache._reported.clear()
    yield
    cache.library_result.cache_clear()


def _ba(m=16, k=64, n=32):
    return keys.canonical(XlaChunkedMatmul().bind(
        jax.ShapeDtypeStruct((m, k), "float32"), jax.ShapeDtypeStruct((k, n), "float32")))


def _result(chunk, ba=None, provenance=None):
    ba = ba or _ba()
    entry = Entry(ba, {ChunkConfig(chunk): Measurement((1.0,))},
                  keys.provenance(ba.op) if provenance is None else provenance)
    return tokamax.AutotuningResult(current_target().device_kind, [entry])


def _resolve(ba=None):
    ba = ba or _ba()
    return selection.resolve_config(ba.op, ba)


def test_resolution_order_result_then_user_then_library_then_heuristics(tmp_path, monkeypatch):
    assert _resolve() == (ChunkConfig(32), "heuristics")
    cache.write_library_cache(_result(8), tmp_path / "lib")
    monkeypatch.setattr(cache, "library_cache_dir",
                        lambda kind: tmp_path / "lib" / cache.device_kind_key(kind))
    cache.library_result.cache_clear()
    assert (tmp_path / "lib" / cache.device_kind_key(current_target().device_kind)
            / "xla_chunked_matmul.json").exists()
    assert _resolve() == (ChunkConfig(8), "library cache")
    _result(16).save_to_cache()
    assert _resolve() == (ChunkConfig(16), "user cache")
    with _result(64):
        assert _resolve() == (ChunkConfig(64), "autotuning result")


def test_save_merges_writes_atomically_and_records_provenance():
    path = _result(16).save_to_cache()
    _result(8, _ba(m=32)).save_to_cache()
    data = json.loads(pathlib.Path(path).read_text())
    assert len(data["entries"]) == 2
    provenance = data["entries"][0]["provenance"]
    assert provenance["jax"] == jax.__version__ and provenance["tokamax_pass"] == "0.1.0"
    assert len(provenance["source_hash"]) == 16
    assert [p.name for p in cache.cache_dir().iterdir() if p.name.endswith(".tmp")] == []


def test_a_save_keeps_the_entries_of_ops_this_process_cannot_name():
    """Another program's op (registered, or called, only there) stays in the file through
    this program's save, as written: its measurements are not this save's to drop."""
    path = pathlib.Path(_result(16).save_to_cache())
    data = json.loads(path.read_text())
    theirs = json.loads(json.dumps(data["entries"][0]))
    theirs["op"]["dataclass"] = "their_models.layers.TheirOp"
    data["entries"].append(theirs)
    path.write_text(json.dumps(data))
    cache._USER.invalidate()
    with pytest.warns(UserWarning, match="TheirOp"):
        _result(8, _ba(m=32)).save_to_cache()
    entries = json.loads(path.read_text())["entries"]
    assert theirs in entries and len(entries) == 3


@pytest.mark.parametrize("writer", ["user cache", "library cache"])
def test_a_save_keeps_the_entries_of_another_version_this_process_cannot_read(tmp_path,
                                                                              writer):
    """An entry whose config has a field this version's config lacks (a newer version's)
    is skipped on reading, and a save kept it no more: the file lost it."""
    save = (cache.save if writer == "user cache"
            else lambda result: cache.write_library_cache(result, tmp_path / "lib")[0])
    path = pathlib.Path(save(_result(16)))
    data = json.loads(path.read_text())
    newer = json.loads(json.dumps(data["entries"][0]))
    newer["configs"][0]["config"]["split_k"] = 2
    data["entries"] = [newer]
    path.write_text(json.dumps(data))
    cache._USER.invalidate()
    with pytest.warns(UserWarning, match="has no fields \\['split_k'\\]"):
        save(_result(8, _ba(m=32)))
    entries = json.loads(path.read_text())["entries"]
    assert newer in entries and len(entries) == 2


def test_concurrent_writers_through_links_to_one_shared_file_lose_nothing(tmp_path):
    """Two cache directories whose files link to one shared file: each save locked its
    own link's name, and concurrent saves through the two lost entries."""
    shared = tmp_path / "shared" / cache.cache_file(current_target().device_kind).name
    shared.parent.mkdir()
    shared.write_text(_result(16).dumps())
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / shared.name).symlink_to(shared)
    threads = [threading.Thread(target=lambda m=m: cache.save(
        _result(16, _ba(m=m)), tmp_path / ("a" if m % 2 else "b"))) for m in range(1, 25)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache.read(shared)) == 24


def test_a_save_past_the_entries_a_file_may_hold_leaves_the_file_readable(monkeypatch):
    """A save that merged the file past `MAX_ENTRIES` wrote a file no reader loads: the
    user cache was ignored from then on, and every later save failed on it."""
    monkeypatch.setattr(result_lib, "MAX_ENTRIES", 2)
    path = _result(16).save_to_cache()
    _result(8, _ba(m=32)).save_to_cache()
    with pytest.raises(cache.CacheError, match="would hold 3 entries, above the 2"):
        _result(8, _ba(m=48)).save_to_cache()
    assert len(cache.read(path)) == 2


def test_concurrent_writers_lose_nothing():
    threads = [threading.Thread(target=lambda m=m: _result(16, _ba(m=m)).save_to_cache())
               for m in (1, 2, 3, 4, 5, 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache.read(cache.cache_file(current_target().device_kind))) == 6


def test_stale_entry_is_reported_once_and_ignored():
    stale = dict(keys.provenance(_ba().op), source_hash="0" * 16)
    _result(16, provenance=stale).save_to_cache()
    with pytest.warns(UserWarning, match="stale user cache entry.*implementation's source"):
        assert _resolve() == (ChunkConfig(32), "heuristics")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _resolve() == (ChunkConfig(32), "heuristics")  # reported only once


def test_corrupt_file_is_reported_left_in_place_and_not_overwritten(caplog):
    """Reported once, as a warning: a log record of it as well printed the message twice
    where logging is not configured."""
    path = cache.cache_file(current_target().device_kind)
    path.parent.mkdir(parents=True)
    path.write_text('{"format": "tokamax_pass.AutotuningResult", "entr')
    with (caplog.at_level(logging.DEBUG),
          pytest.warns(UserWarning, match="ignoring the user autotuning cache")):
        assert _resolve() == (ChunkConfig(32), "heuristics")
    assert "ignoring the user autotuning cache" not in caplog.text
    with pytest.raises(cache.CacheError, match="left in place"):
        _result(16).save_to_cache()
    assert path.read_text() == '{"format": "tokamax_pass.AutotuningResult", "entr'


def test_a_user_cache_entry_with_a_time_no_float_holds_is_skipped_with_a_warning():
    path = cache.cache_file(current_target().device_kind)
    path.parent.mkdir(parents=True)
    document = json.loads(_result(16).dumps())
    document["entries"][0]["configs"][0]["evaluation_times_ms"] = [10**400]
    path.write_text(json.dumps(document))
    with pytest.warns(UserWarning, match="entry 0: 'evaluation_times_ms' must be"):
        assert _resolve() == (ChunkConfig(32), "heuristics")


def _write_user_cache_file(device_kind):
    """The user cache file of this device, holding an entry (m=48) recorded under
    `device_kind`."""
    path = cache.cache_file(current_target().device_kind)
    path.parent.mkdir(parents=True)
    document = json.loads(_result(16, _ba(m=48)).dumps())
    document["device_kind"] = device_kind
    path.write_text(json.dumps(document))
    return path


def test_a_user_cache_file_spelling_its_device_kind_otherwise_is_read_and_merged():
    path = _write_user_cache_file(current_target().device_kind.upper())
    assert _resolve(_ba(m=48)) == (ChunkConfig(16), "user cache")
    _result(8).save_to_cache()
    saved = cache.read(path)
    assert saved.device_kind == current_target().device_kind and len(saved) == 2


def test_a_user_cache_file_of_another_device_kind_is_skipped_and_autotune_keeps_its_result():
    path = _write_user_cache_file("NVIDIA H200")
    text = path.read_text()
    with pytest.warns(UserWarning, match="records device kind 'NVIDIA H200', whose configs "
                                         "belong in nvidia_h200.json"):
        assert _resolve(_ba(m=48)) == (ChunkConfig(32), "heuristics")
    x = jax.random.normal(jax.random.key(0), (8, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8))
    with pytest.raises(tokamax.UnsavedResultError, match="left in place") as error:
        tokamax.autotune([XlaChunkedMatmul().bind(x, w)], cache=True, progress=False,
                         max_configs=1)
    assert len(tokamax.AutotuningResult.load(error.value.fallback_path)) == 1
    assert path.read_text() == text


def test_autotune_cache_true_writes_the_user_cache():
    x = jax.random.normal(jax.random.key(0), (8, 32))
    w = jax.random.normal(jax.random.key(1), (32, 8))
    result = tokamax.autotune([XlaChunkedMatmul().bind(x, w)], cache=True, progress=False)
    stored = cache.read(cache.cache_file(current_target().device_kind))
    [(ba, data)] = list(stored)
    assert all(m.ok for m in data.values())  # failures are not cached
    assert stored.best_config(ba) == result.best_config(ba)
    assert _resolve(ba)[1] == "user cache"


def test_clear_removes_files():
    _result(16).save_to_cache()
    assert len(cache.clear()) == 1
    assert _resolve() == (ChunkConfig(32), "heuristics")


def test_shipped_library_caches_are_fresh():
    """Every entry shipped as package data still matches its kernel's source: editing a
    kernel means retuning it on the device (`python -m benchmarks.tune_library_cache`)
    or dropping its entries, never shipping entries every user would see reported."""
    import pathlib

    import tokamax_kernels  # noqa: F401 - registers the op families the entries name

    folder = pathlib.Path(tokamax.__file__).parent / "data" / "autotuning"
    files = sorted(folder.glob("*/*.json"))
    assert files, "no library cache is shipped"
    for path in files:
        for entry in tokamax.AutotuningResult.load(path).entries:
            reason = keys.stale_reason(entry.bound.op, entry.provenance)
            assert reason is None, f"{path.name}: {entry.bound!r}: {reason}"


def test_every_shipped_entry_has_a_timed_config():
    """An entry without one ranks nothing: `None` would skip its implementation there
    while the freshness check above stays green (`tune_library_cache` keeps the stale
    entry instead and says so)."""
    import pathlib

    import tokamax_kernels  # noqa: F401 - registers the op families the entries name

    folder = pathlib.Path(tokamax.__file__).parent / "data" / "autotuning"
    for path in sorted(folder.glob("*/*.json")):
        for entry in tokamax.AutotuningResult.load(path).entries:
            assert entry.fastest is not None, f"{path.name}: {entry.bound!r}: no timed config"


def test_source_hash_covers_the_kernel_modules_an_implementation_calls():
    """Editing a kernel body (not only the implementation class's module) stales entries."""
    from tokamax_kernels.attention import PallasMosaicGpuFlashAttentionVjp

    modules = keys._op_modules(PallasMosaicGpuFlashAttentionVjp())
    assert {"tokamax_kernels.attention._mosaic_gpu_bwd_kernels",
            "tokamax_kernels.attention._mosaic_gpu_dq_adds",
            "tokamax_kernels.attention._mosaic_gpu_common",
            "tokamax_kernels.attention.pallas_mosaic_gpu_vjp"} <= set(modules)
    assert "tokamax_kernels.attention.base" not in modules  # the family class, not a kernel
