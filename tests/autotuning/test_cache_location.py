"""Where the user autotuning cache lives when no directory is given."""

import pathlib
import sys

import platformdirs

from tokamax_pass.autotuning import cache


def test_the_environment_variable_names_the_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "mine"))
    assert cache.cache_dir() == tmp_path / "mine"
    assert cache.cache_file("cpu").parent == tmp_path / "mine"


def test_without_it_the_platform_user_cache_directory_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv(cache.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == pathlib.Path(platformdirs.user_cache_dir("tokamax_pass"))
    if sys.platform.startswith("linux"):  # the XDG rule, not a fixed ~/.cache
        assert cache.cache_dir() == tmp_path / "xdg" / "tokamax_pass"


def test_an_explicit_directory_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "env"))
    assert cache.cache_dir(tmp_path / "given") == tmp_path / "given"
