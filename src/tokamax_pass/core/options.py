"""Runtime options under upstream Tokamax's names (`tokamax_pass.config`).

Each option has a default, may be set for the whole program on the command line
(`--tokamax_<name>=value`, or `--tokamax_<name>` / `--notokamax_<name>` for a boolean), and
for a block of code with `with option(value):`, innermost first. Only `--tokamax_*`
arguments of `sys.argv` are read: the rest belongs to the host program.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

_UNSET = object()
_TRUE, _FALSE = ("1", "true", "t", "yes", "y"), ("0", "false", "f", "no", "n")


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One option: `option.value` reads it, `with option(value):` sets it for a block.

    `choices`: the values an enum option takes (`None`: a boolean option).
    """

    name: str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    _scoped: contextvars.ContextVar = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_scoped", contextvars.ContextVar(self.name, default=_UNSET))

    @property
    def flag(self) -> str:
        return f"tokamax_{self.name}"

    def parse(self, value: Any) -> Any:
        """`value` (or its text) as this option's value; `ValueError` when it is not one."""
        try:
            if self.choices is None:
                parsed = _parse_bool(value) if isinstance(value, str) else value
                if not isinstance(parsed, bool):
                    raise ValueError(value)
                return parsed
            if value not in self.choices:
                raise ValueError(value)
            return value
        except ValueError:
            allowed = "a boolean" if self.choices is None else f"one of {self.choices}"
            raise ValueError(f"Invalid value for config `{self.flag}`: {value!r} "
                             f"(takes {allowed})") from None

    @contextlib.contextmanager
    def __call__(self, value: Any) -> Iterator[None]:
        token = self._scoped.set(self.parse(value))
        try:
            yield
        finally:
            self._scoped.reset(token)

    @property
    def value(self) -> Any:
        scoped = self._scoped.get()
        if scoped is not _UNSET:
            return scoped
        given = command_line_value(self, sys.argv[1:])
        return self.default if given is _UNSET else self.parse(given)


def command_line_value(option: ConfigOption, args: list[str]) -> Any:
    """The last value `args` give `option` (`--flag=v`, `--flag v`, `--flag`, `--noflag`),
    as text or a bool; `_UNSET` where they give none."""
    found: Any = _UNSET
    for i, arg in enumerate(args):
        name, has_value, text = arg.lstrip("-").partition("=")
        if not arg.startswith("-"):
            continue
        if name == option.flag:
            if has_value:
                found = text
            elif option.choices is None:
                found = True
            elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                found = args[i + 1]
        elif name == f"no{option.flag}" and option.choices is None and not has_value:
            found = False
    return found


autotuning_cache_miss_fallback = ConfigOption(
    "autotuning_cache_miss_fallback", "heuristics",
    "What a call whose op takes a config gets when no pinned config, active autotuning "
    "result or cache answers it: 'heuristics' (the op's heuristic config), 'autotune' "
    "(its candidate configs measured now, the fastest kept and cached) or 'error' "
    "(ValueError).", choices=("heuristics", "autotune", "error"))

cross_compile = ConfigOption(
    "cross_compile", False,
    "Lower kernels for hardware this machine lacks. Implementations here are checked "
    "against the platform being lowered for (jax.export's platforms), never against the "
    "local devices, so lowering for another machine works with either value.")

ignore_autotuning_cache = ConfigOption(
    "ignore_autotuning_cache", False,
    "Look up no config and no measurement in active autotuning results or the user and "
    "library caches: pinned configs, then heuristics (or the cache-miss fallback).")

OPTIONS: tuple[ConfigOption, ...] = (
    autotuning_cache_miss_fallback, cross_compile, ignore_autotuning_cache)

