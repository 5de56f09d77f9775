"""Every op call the shipped H200 library cache measured can be ranked by it.

A measurement the ranking cannot use is dead weight, and worse: the seed model's
self-attention backward goes back to cuDNN, although the shipped cache measured the
Mosaic shared-input kernel faster, where XLA's gradient was not measured and the ranking
gives up (`Op.yields_unmeasured_to` prevents that). This test ranks every
shipped call's implementations, as `implementation=None` does on the H200, and fails on
any call that cannot be ranked: a new entry whose plain-JAX side was not timed needs
`python -m benchmarks.tune_library_cache` on the device for that workload.
"""

from __future__ import annotations

import pathlib

import pytest

import tokamax_pass as tokamax
from tokamax_pass import core
from tokamax_pass.autotuning import cache
from tokamax_pass.core import current_target, registry

H200 = "NVIDIA H200"


@pytest.fixture
def shipped_only(tmp_path, monkeypatch):
    """The shipped library cache, with an empty user cache."""
    monkeypatch.setenv("TOKAMAX_PASS_CACHE_DIR", str(tmp_path / "user"))
    cache.library_result.cache_clear()
    cache._USER.invalidate()
    yield
    cache.library_result.cache_clear()


def _shipped_calls():
    """One bound call per (family's implementations, argument spec) in the H200 files."""
    import tokamax_kernels  # noqa: F401 - registers the op families the entries name

    folder = pathlib.Path(tokamax.__file__).parent / "data" / "autotuning" / "nvidia_h200"
    calls = {}
    for path in sorted(folder.glob("*.json")):
        for entry in tokamax.AutotuningResult.load(path).entries:
            family = tuple(sorted(type(op).__name__
                                  for op in registry.implementations_of(entry.bound.op)))
            calls.setdefault((family, entry.bound.cache_key), entry.bound)
    return list(calls.values())


def _label(ba):
    """The op and its main operand's shape (`x`, `query` or `lhs`)."""
    shapes = tuple(sorted((name, tuple(value.shape)) for name, value in ba.arguments.items()
                          if name in ("x", "query", "lhs")))
    return type(ba.op).__name__, shapes


def test_every_shipped_call_can_be_ranked(shipped_only, monkeypatch):
    from tokamax_kernels.attention import cudnn

    monkeypatch.setattr(cudnn, "_require_cudnn_library", lambda: None)  # a CPU machine
    calls = _shipped_calls()
    assert len(calls) > 40, "the shipped cache lost most of its calls"
    unranked = set()
    with core.targeting(H200):
        target = current_target()
        for ba in calls:
            candidates = []
            for op in registry.implementations_of(ba.op):
                try:
                    op.check_supported(ba.replace(op=op), target)
                except NotImplementedError:
                    continue
                candidates.append(ba.replace(op=op))
            if cache.SOURCE.rank(candidates, H200) is None:
                unranked.add(_label(ba))
    assert not unranked, f"calls the shipped cache cannot rank: {sorted(unranked)}"
